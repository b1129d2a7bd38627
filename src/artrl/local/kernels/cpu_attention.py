"""Attention for the CPU, registered with transformers under its own name, for the paths where torch's CPU
flash-attention kernel (what transformers' "sdpa" attention calls) is slow.

- Decode steps in bf16/fp16 (one query per sequence, inference mode) over the engine's growing key/value
  buffers: the flash kernel takes ~4 ms per layer for 32 sequences of 350 tokens on two cores, most of a
  bf16 decode step. Two batched matrix products over the key/value heads (a group's query heads side by
  side, so no key or value is repeated; the keys on the left, read in place) take a fraction. (In fp32 the
  kernel is as fast, or faster for small heads: fp32 decode keeps it.)
- Training in bf16/fp16 (gradients on): the kernel runs no faster in bf16 than in fp32 (its backward pass took
  9 ms per layer on the 27M model's GRPO step, 8 x 104 tokens, a fifth of the step), and plain attention
  through autograd materialises every score matrix several times (the `small` model's step on 16 rows of
  1,000 tokens took 22 s in bf16 that way, as long as in fp32). `chunked_attention`: one autograd function
  over chunks of queries, products at the bf16 rate (that step 11.8 s; the flash kernel's 12.3 s).
- Prefill with a mask (left-padded rows, cached starts) in grouped-query models: the same kernel as transformers'
  sdpa function, told to share each key/value head among its query heads (that function repeats them into
  copies whenever there is a mask).
Everything else (prefill without a mask, fp32 training (the flash kernel is as fast or faster there), dropout,
attention sinks, soft-capping, position biases) goes to transformers' own sdpa function unchanged. The mask is
built exactly as for sdpa (sliding windows included).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from artrl.local.kernels.chunked_attention import chunked_attention

log = logging.getLogger(__name__)

NAME = "artrl_cpu"
_UNSUPPORTED = ("s_aux", "sinks", "softcap", "position_bias")  # left to sdpa
_HALF = (torch.bfloat16, torch.float16)


def cpu_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H, q, D)
    key: torch.Tensor,  # (B, H_kv, T, D)
    value: torch.Tensor,  # (B, H_kv, T, D)
    attention_mask: torch.Tensor | None,  # (B, 1, q, T) bool, True = attend; None = causal
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """(B, q, H, D) attention output, like transformers' attention functions."""
    heads, q_length, dim = query.shape[1:]
    kv_heads = key.shape[1]
    plain = not (
        dropout
        or heads % kv_heads
        or any(kwargs.get(name) is not None for name in _UNSUPPORTED)
        or (attention_mask is not None and attention_mask.dtype != torch.bool)
    )
    scale = scaling if scaling is not None else dim**-0.5
    if plain and q_length == 1 and not torch.is_grad_enabled() and query.dtype in _HALF:
        return decode_attention(query, key, value, attention_mask, scale), None
    if (
        plain
        and q_length > 1
        and not torch.is_grad_enabled()
        and attention_mask is not None
        and heads != kv_heads
    ):
        # a prefill with a mask: transformers' sdpa path repeats every key and value head per query head (it
        # lets the kernel share them only without a mask); the kernel's own sharing gives the same numbers
        # without the copies (27M model, 31 x 95 new tokens over 315: 12 instead of 15 ms per layer)
        return grouped_attention(query, key, value, attention_mask, scale).contiguous(), None
    if plain and torch.is_grad_enabled() and query.dtype in _HALF and query.device.type == "cpu":
        return chunked_attention(query, key, value, attention_mask, scale), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def grouped_attention(query, key, value, mask, scale: float) -> torch.Tensor:
    """(B, q, H, D) attention (a view) of queries (B, H, q, D) over keys and values (B, H_kv, T, D) through
    sdpa's kernel, each key/value head shared by its group of query heads (mask (B, 1, q, T) bool or None)."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def decode_attention(query, key, value, mask, scale: float) -> torch.Tensor:
    """(B, 1, H, D) attention of one query per sequence, query (B, H, 1, D) over keys and values (B, H_kv, T, D)
    (mask (B, T) bool, True = attend; None = all)."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = (query * scale).reshape(batch, kv_heads, heads // kv_heads, dim)  # (B, H_kv, G, D)
    # keys on the left: their (T, D) rows are read in place (a transposed, strided bf16 operand is copied first)
    scores = torch.matmul(key, grouped.transpose(-1, -2)).float().transpose(-1, -2)  # (B, H_kv, G, T)
    # (a copy that makes T the contiguous dimension, which softmax wants: the mask's, out of place)
    if mask is not None:
        scores = scores.masked_fill(~mask.reshape(batch, 1, 1, -1), float("-inf"))
    else:
        scores = scores.contiguous()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)  # (B, H_kv, G, T)
    out = torch.matmul(probs, value)  # (B, H_kv, G, D)
    return out.reshape(batch, 1, heads, dim)


AttentionInterface.register(NAME, cpu_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_cpu_attention(model: Any) -> bool:
    """Switch a model (PEFT-wrapped or not) from "sdpa" to this attention; False (unchanged) if it uses
    another implementation or sits on another device than the CPU."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if next(base.parameters()).device.type != "cpu":
        return False
    try:
        base.set_attn_implementation(NAME)
    except (ValueError, ImportError, AttributeError) as exc:  # a model class that refuses custom attention
        log.info("keeping sdpa attention: %s", exc)
        return False
    return True
