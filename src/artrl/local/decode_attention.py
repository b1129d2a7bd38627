"""Attention for one-token decode steps on CPU, registered with transformers under its own name.

torch's CPU flash-attention kernel, which transformers' "sdpa" attention calls, is slow for a decode step
(one query per sequence) over the engine's growing key/value buffers: ~1 ms per layer in fp32 and ~4 ms in
bf16 for 32 sequences of 350 tokens on two cores, most of a bf16 decode step. Two batched matrix products
over the key/value heads (the query heads of a group side by side, so no key or value is repeated) do it
in a fraction of that. Everything else (prefill, training with gradients, dropout, attention sinks, soft
capping, position biases) goes to transformers' own sdpa function unchanged, so only inference-mode decode
steps take this path, and the mask is built exactly as for sdpa (sliding windows included).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

log = logging.getLogger(__name__)

NAME = "artrl_cpu_decode"
_UNSUPPORTED = ("s_aux", "sinks", "softcap", "position_bias")  # left to sdpa


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H, q, D)
    key: torch.Tensor,  # (B, H_kv, T, D)
    value: torch.Tensor,  # (B, H_kv, T, D)
    attention_mask: torch.Tensor | None,  # (B, 1, q, T) bool, True = attend; None = all (q == 1)
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """(B, q, H, D) attention output, like transformers' attention functions."""
    batch, heads, q_length, dim = query.shape
    kv_heads = key.shape[1]
    if (
        q_length != 1
        or torch.is_grad_enabled()
        or dropout
        or heads % kv_heads
        or any(kwargs.get(name) is not None for name in _UNSUPPORTED)
        or (attention_mask is not None and attention_mask.dtype != torch.bool)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = scaling if scaling is not None else dim**-0.5
    grouped = (query * scale).reshape(batch, kv_heads, heads // kv_heads, dim)  # (B, H_kv, G, D)
    # keys on the left: their (T, D) rows are read in place (a transposed, strided bf16 operand is copied first)
    scores = torch.matmul(key, grouped.transpose(-1, -2)).float()  # (B, H_kv, T, G)
    if attention_mask is not None:
        scores.masked_fill_(~attention_mask.reshape(batch, 1, -1, 1), float("-inf"))
    probs = torch.softmax(scores, dim=-2).to(value.dtype)  # (B, H_kv, T, G)
    out = torch.matmul(probs.transpose(-1, -2), value)  # (B, H_kv, G, D)
    return out.reshape(batch, 1, heads, dim), None


AttentionInterface.register(NAME, decode_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_decode_attention(model: Any) -> bool:
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
