"""The fused decode step's decoder layers as one TorchScript function: one call into C++ per step.

Every eager torch operation releases the interpreter lock while it runs and takes it back afterwards. On a
small model a decode step is ~30 operations per layer of a few microseconds each, and when another thread of
the process is running Python (the gateway parsing a request, rendering a chat template), taking the lock
back waits for that thread to let go: up to the switch interval (5 ms) per operation. Measured on 2 cores
with a pure-Python thread beside it, a 2-layer step of 70 small operations took 350 ms eager and 32 ms as a
TorchScript function, which takes the lock back a few times per call instead of once per operation.

The computation is FusedDecode's (`fused_decode.py`), op for op: RMS norms in fp32 then the weight in the
model's dtype, q/k/v and gate/up as one product each (oneDNN-packed weights where given), Qwen3's q/k norms
as one pass over the joined heads, the rotation as `x·cos + roll(x)·signed_sin`, attention as
`cpu_attention.decode_attention`, and the cache column written in place into each layer's buffers. With
rows of several LoRA adapters (`adapter_factors.py`), each product adds each adapter's low-rank product on
its own rows (`_adapted`); with no groups, the base weights' (or the folded ones') product alone.
"""

from __future__ import annotations

import threading
import warnings

import torch
import torch.nn.functional as F


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> torch.Tensor:
    if packed:
        scalars = torch.jit.annotate(list[int | float | complex | None], [])
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", scalars, "")
    return F.linear(x, weight, bias)


def _adapted(
    x: torch.Tensor,  # (B, L, in): the product's input
    y: torch.Tensor,  # (B, L, out): the base weights' product
    lora_a: list[torch.Tensor],  # per group and product: A (Σr, in), or empty
    lora_b: list[torch.Tensor],  # per group and product: s·B (Σout, Σr)
    masks: list[torch.Tensor],  # per group: its rows, a (B, 1, 1) mask, or empty for every row
    at: int,  # the product's index among a model's products
    products: int,  # a model's products (4 per layer)
) -> torch.Tensor:
    """y plus, on each group's rows, (x·Aᵀ)·(s·B)ᵀ of the group's adapter."""
    for group in range(len(masks)):
        a = lora_a[group * products + at]
        if a.numel() > 0:
            low = F.linear(F.linear(x.float(), a), lora_b[group * products + at]).to(y.dtype)
            mask = masks[group]
            y = y + low if mask.numel() == 0 else y + low * mask
    return y


def _rms_with(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _attention(
    query: torch.Tensor,  # (B, H, 1, D)
    key: torch.Tensor,  # (B, H_kv, T, D)
    value: torch.Tensor,  # (B, H_kv, T, D)
    mask: torch.Tensor,  # (B, T) bool, True = attend
    scale: float,
) -> torch.Tensor:
    """(B, 1, H, D): cpu_attention.decode_attention with a mask."""
    batch, heads, dim = query.shape[0], query.shape[1], query.shape[3]
    kv_heads = key.shape[1]
    grouped = (query * scale).reshape(batch, kv_heads, heads // kv_heads, dim)  # (B, H_kv, G, D)
    scores = torch.matmul(key, grouped.transpose(-1, -2)).float().transpose(-1, -2)  # (B, H_kv, G, T)
    scores = scores.masked_fill(~mask.reshape(batch, 1, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)  # (B, H_kv, G, T)
    out = torch.matmul(probs, value)  # (B, H_kv, G, D)
    return out.reshape(batch, 1, heads, dim)


def decode_layers(
    hidden: torch.Tensor,  # (B, 1, E)
    cos: torch.Tensor,  # (B, 1, 1, D)
    signed_sin: torch.Tensor,  # (B, 1, 1, D)
    attend: torch.Tensor,  # (B, T + 1) bool: the row's tokens, this step's included
    weights: list[torch.Tensor],  # per layer: qkv, o, gate_up, down (4 per layer)
    biases: list[torch.Tensor | None],  # the same 4 per layer
    packed: list[bool],  # the same 4 per layer
    norms: list[
        torch.Tensor
    ],  # per layer: input norm, post-attention norm, joined q/k norm or an empty tensor
    eps: list[float],  # per layer: the input norm's, the post-attention norm's, the q/k norm's
    lora_a: list[torch.Tensor],  # per adapter group and product (see _adapted); [] without groups
    lora_b: list[torch.Tensor],
    masks: list[torch.Tensor],  # per adapter group: its rows (see _adapted)
    keys: list[torch.Tensor],  # per layer (B_cap, H_kv, T_cap, D) buffers
    values: list[torch.Tensor],
    length: int,  # T: columns the buffers hold; this step's keys and values go into column T
    wide: bool,  # attend over the buffers' whole width (bf16/fp16) instead of the filled columns
    heads: int,
    kv_heads: int,
    dim: int,
    intermediate: int,
    scale: float,
) -> torch.Tensor:
    """The hidden states (B, 1, E) after every layer; each layer's buffers get this step's column."""
    batch, n = hidden.shape[0], len(weights)
    for index in range(len(keys)):
        at = 4 * index
        x = _rms_with(hidden, norms[3 * index], eps[3 * index])
        qkv = _adapted(x, _product(x, weights[at], biases[at], packed[at]), lora_a, lora_b, masks, at, n)
        qkv = qkv.view(batch, 1, heads + 2 * kv_heads, dim)
        qk, v = qkv.split([heads + kv_heads, kv_heads], dim=2)  # (B, 1, H + H_kv, D), (B, 1, H_kv, D)
        qk_norm = norms[3 * index + 2]
        if qk_norm.numel() > 0:
            qk = _rms_with(qk, qk_norm, eps[3 * index + 2])
        qk = qk * cos + qk.roll(dim // 2, dims=-1) * signed_sin
        q, k = qk.split([heads, kv_heads], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H or H_kv, 1, D)
        key_buffer, value_buffer = keys[index], values[index]
        key_buffer[:batch, :, length : length + 1] = k
        value_buffer[:batch, :, length : length + 1] = v
        mask = attend
        if wide:
            key, value = key_buffer[:batch], value_buffer[:batch]  # (B, H_kv, T_cap, D)
            if mask.shape[1] != key.shape[2]:  # (per layer: each buffer's own width)
                mask = F.pad(mask, [0, key.shape[2] - mask.shape[1]])  # (B, T_cap): the room masked out
        else:
            key, value = key_buffer[:batch, :, : length + 1], value_buffer[:batch, :, : length + 1]
        out = _attention(q, key, value, mask, scale).reshape(batch, 1, heads * dim)
        o = _product(out, weights[at + 1], biases[at + 1], packed[at + 1])
        hidden = hidden + _adapted(out, o, lora_a, lora_b, masks, at + 1, n)
        x = _rms_with(hidden, norms[3 * index + 1], eps[3 * index + 1])
        gate_up = _product(x, weights[at + 2], biases[at + 2], packed[at + 2])
        gate, up = _adapted(x, gate_up, lora_a, lora_b, masks, at + 2, n).split(intermediate, dim=-1)
        act = F.silu(gate) * up
        down = _product(act, weights[at + 3], biases[at + 3], packed[at + 3])
        hidden = hidden + _adapted(act, down, lora_a, lora_b, masks, at + 3, n)
    return hidden


def prefill_layers(
    hidden: torch.Tensor,  # (R, S, E): S new tokens per row
    cos: torch.Tensor,  # (R, S, 1, D)
    signed_sin: torch.Tensor,  # (R, S, 1, D)
    attend: torch.Tensor,  # (R, 1, S, P + S) bool: what each new token sees
    weights: list[torch.Tensor],  # as decode_layers'
    biases: list[torch.Tensor | None],
    packed: list[bool],
    norms: list[torch.Tensor],
    eps: list[float],
    lora_a: list[torch.Tensor],  # as decode_layers'
    lora_b: list[torch.Tensor],
    masks: list[torch.Tensor],
    past_keys: list[torch.Tensor],  # per layer (R, H_kv, P, D) cached keys; empty lists when P = 0
    past_values: list[torch.Tensor],
    heads: int,
    kv_heads: int,
    dim: int,
    intermediate: int,
    scale: float,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """FusedDecode.prefill's layers: the hidden states (R, S, E) after every layer and per layer the keys and
    values (R, H_kv, P + S, D) of all the rows' tokens (tensors of their own)."""
    rows, length, n = hidden.shape[0], hidden.shape[1], len(weights)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for index in range(len(weights) // 4):
        at = 4 * index
        x = _rms_with(hidden, norms[3 * index], eps[3 * index])
        qkv = _adapted(x, _product(x, weights[at], biases[at], packed[at]), lora_a, lora_b, masks, at, n)
        qkv = qkv.view(rows, length, heads + 2 * kv_heads, dim)
        qk, v = qkv.split([heads + kv_heads, kv_heads], dim=2)  # (R, S, H + H_kv, D), (R, S, H_kv, D)
        qk_norm = norms[3 * index + 2]
        if qk_norm.numel() > 0:
            qk = _rms_with(qk, qk_norm, eps[3 * index + 2])
        qk = qk * cos + qk.roll(dim // 2, dims=-1) * signed_sin
        q, k = qk.split([heads, kv_heads], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (R, H or H_kv, S, D)
        if len(past_keys) > 0:
            k, v = torch.cat([past_keys[index], k], dim=2), torch.cat([past_values[index], v], dim=2)
        else:
            k, v = k.contiguous(), v.contiguous()
        keys.append(k)
        values.append(v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(rows, length, heads * dim)  # (R, S, H·D)
        o = _product(out, weights[at + 1], biases[at + 1], packed[at + 1])
        hidden = hidden + _adapted(out, o, lora_a, lora_b, masks, at + 1, n)
        x = _rms_with(hidden, norms[3 * index + 1], eps[3 * index + 1])
        gate_up = _product(x, weights[at + 2], biases[at + 2], packed[at + 2])
        gate, up = _adapted(x, gate_up, lora_a, lora_b, masks, at + 2, n).split(intermediate, dim=-1)
        act = F.silu(gate) * up
        down = _product(act, weights[at + 3], biases[at + 3], packed[at + 3])
        hidden = hidden + _adapted(act, down, lora_a, lora_b, masks, at + 3, n)
    return hidden, keys, values


_SCRIPTED: dict = {}
_COMPILING = threading.Lock()  # (two engines in one process compile once)


def scripted(name: str):
    """decode_layers or prefill_layers compiled by TorchScript (once per process, on first use)."""
    with _COMPILING:
        return _compiled(name)


def _compiled(name: str):
    if name not in _SCRIPTED:
        with warnings.catch_warnings():  # (torch 2.13 calls TorchScript deprecated; see the module docstring)
            warnings.simplefilter("ignore", DeprecationWarning)
            _SCRIPTED[name] = torch.jit.script({"decode": decode_layers, "prefill": prefill_layers}[name])
    return _SCRIPTED[name]
