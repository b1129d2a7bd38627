"""Attention for training in bf16/fp16 on the CPU: one autograd function, computed over chunks of queries,
with the backward pass written out.

torch's CPU flash-attention kernel (what transformers' "sdpa" calls) runs no faster in bf16 than in fp32, and
with a mask (shared prompts, padding) its backward pass is slow: a (8, 8, 65, 104) attention, the 27M `small`
model's GRPO step with shared prompts, 3.3 ms forward and 14.7 ms backward per layer in bf16 on a 2-core AMD
EPYC. Plain attention through autograd (scores, softmax, weighted values) is quick there (2.2 and 2.9 ms) but
materialises every (q, T) score matrix several times: on 16 rows of 1,000 tokens the step took 22 s in bf16, as
long as in fp32. Here (2.2 and 2.7 ms; that long step 11.8 s, the flash kernel's 12.3 s), per chunk of
queries (so that a chunk's fp32 scores stay in cache, `CHUNK_BYTES`), with G query heads per key/value head
side by side (no key or value repeated):

    S = (q·s)·Kᵀ   (bf16 product, widened to fp32)   + the fp32 minimum where not attended (one pass)
    P = softmax(S) in fp32,   O = P·V   (bf16 product)

only over the keys some query of the chunk can see (causal attention skips the rest, about half of them).
The backward pass, per chunk, with Δ = rowsum(dO ⊙ O) in fp32:

    dV += Pᵀ·dO,   dP = dO·Vᵀ,   dS = P ⊙ (dP − Δ),   d(q·s) = dS·K,   dK += dSᵀ·(q·s)

P is kept (bf16) for the backward pass while all of a layer's fit in `KEEP_PROBS_BYTES`; above it only each
row's largest score and log-sum-exp are kept and P recomputed from them (memory linear in the length, as the
flash kernel's).
A row that attends to nothing (padding) gets a uniform mix of the chunk's keys, never NaN, and no gradient.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_BYTES = 8 * 2**20  # a chunk's fp32 scores (B, H, c, keys): the number c of queries per chunk
KEEP_PROBS_BYTES = 64 * 2**20  # largest bf16 probabilities (B, H, q, T) of a layer kept for the backward pass
_MIN = torch.finfo(torch.float32).min


def chunked_attention(
    query: torch.Tensor,  # (B, H, q, D) bf16/fp16
    key: torch.Tensor,  # (B, H_kv, T, D)
    value: torch.Tensor,  # (B, H_kv, T, D)
    mask: torch.Tensor | None,  # (B, 1, q, T) bool, True = attend; None = causal (the last q of T)
    scale: float,
) -> torch.Tensor:
    """(B, q, H, D) attention output (contiguous), with gradients for query, key and value."""
    return _ChunkedAttention.apply(query, key, value, mask, scale)


def _chunks(batch: int, heads: int, q_length: int, length: int) -> list[tuple[int, int]]:
    per = max(1, min(q_length, CHUNK_BYTES // max(1, 4 * batch * heads * length)))
    return [(start, min(start + per, q_length)) for start in range(0, q_length, per)]


class _Visibility:
    """Which keys the queries see, in the forms the chunks use: per query the number of leading keys it needs,
    per chunk an additive fp32 mask (0 where attended, the fp32 minimum elsewhere: one promoting sum turns the
    chunk's bf16 scores into masked fp32 ones), and the rows that see nothing."""

    def __init__(self, mask: torch.Tensor | None, q_length: int, length: int) -> None:
        self.q_length, self.length = q_length, length
        self.seen = self.blind = None
        if mask is None:  # causal: query i sees keys up to length - q_length + i
            self.needed = torch.arange(length - q_length + 1, length + 1)  # (q,)
            return
        self.seen = mask[:, 0].expand(mask.shape[0], q_length, length)  # (B, q, T) (a view)
        positions = torch.arange(1, length + 1)
        self.needed = torch.where(self.seen.any(0), positions, 0).amax(-1)  # (q,)
        blind = ~self.seen.any(-1)  # (B, q)
        self.blind = blind[:, None, :, None, None] if bool(blind.any()) else None

    def chunk(self, start: int, end: int) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """(k keys, additive mask (B or 1, 1, c, 1, k) or None, blind rows (B, 1, c, 1, 1) or None)."""
        keys = max(1, int(self.needed[start:end].max()))
        if self.seen is not None:
            hidden = ~self.seen[:, start:end, :keys]  # (B, c, k)
            blind = None if self.blind is None else self.blind[:, :, start:end]
        else:
            offset = self.length - self.q_length + start
            hidden = torch.ones(1, end - start, keys, dtype=torch.bool).triu(offset + 1)  # (1, c, k)
            blind = None
            if not bool(hidden.any()):
                return keys, None, None
        bias = torch.zeros(hidden.shape, dtype=torch.float32).masked_fill_(hidden, _MIN)
        return keys, bias[:, None, :, None, :], blind


def _scores(qs, key_t, bias, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 scores (B·H_kv, c·G, k) of a chunk's scaled queries (B·H_kv, c·G, D) against keys (B·H_kv, D, k),
    plus the additive mask (or as they are)."""
    batch, kv_heads, chunk, groups, keys = shape
    scores = torch.bmm(qs, key_t)  # (B·H_kv, c·G, k) bf16
    if bias is None:
        return scores.float()
    return torch.add(scores.view(batch, kv_heads, chunk, groups, keys), bias).view(scores.shape)


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query, key, value, mask, scale: float):  # type: ignore[override]
        batch, heads, q_length, dim = query.shape
        kv_heads, length = key.shape[1], key.shape[2]
        groups = heads // kv_heads
        # scaled queries, each key/value head's G query heads side by side per position: (B·H_kv, q·G, D)
        qs = torch.empty(batch, kv_heads, q_length, groups, dim, dtype=query.dtype)
        torch.mul(query.view(batch, kv_heads, groups, q_length, dim).transpose(2, 3), scale, out=qs)
        qs = qs.view(batch * kv_heads, q_length * groups, dim)
        key3 = key.reshape(batch * kv_heads, length, dim)  # (B·H_kv, T, D)
        key_t = key3.transpose(1, 2).contiguous()  # (B·H_kv, D, T): its leading columns are read in place
        value3 = value.reshape(batch * kv_heads, length, dim)
        out = torch.empty(batch * kv_heads, q_length * groups, dim, dtype=query.dtype)
        visibility = _Visibility(mask, q_length, length)
        keep = 2 * batch * heads * q_length * length <= KEEP_PROBS_BYTES
        kept: list[torch.Tensor] = []
        # without P: each row's largest score and log-sum of exponentials after it (kept apart, so that a row
        # that sees nothing, all scores the fp32 minimum, is a uniform mix again)
        top = None if keep else torch.empty(batch * kv_heads, q_length * groups, 1)
        log_total = None if keep else torch.empty_like(top)
        for start, end in _chunks(batch, heads, q_length, length):
            keys, bias, _ = visibility.chunk(start, end)
            rows = slice(start * groups, end * groups)
            shape = (batch, kv_heads, end - start, groups, keys)
            scores = _scores(qs[:, rows], key_t[:, :, :keys], bias, shape)  # (B·H_kv, c·G, k) fp32
            if keep:
                probs = torch.softmax(scores, dim=-1).to(query.dtype)
                kept.append(probs)
            else:
                top[:, rows] = scores.amax(-1, keepdim=True)
                exps = scores.sub_(top[:, rows]).exp_()
                total = exps.sum(-1, keepdim=True)
                log_total[:, rows] = total.log()
                probs = exps.div_(total).to(query.dtype)
            out[:, rows].baddbmm_(probs, value3[:, :keys], beta=0)
        result = (
            out.view(batch, kv_heads, q_length, groups, dim)
            .transpose(1, 2)
            .reshape(batch, q_length, heads, dim)
        )
        ctx.save_for_backward(qs, key3, key_t, value3, result, top, log_total, *kept)
        ctx.visibility = visibility
        ctx.shape = (batch, heads, kv_heads, q_length, length, dim)
        ctx.scale = scale
        return result

    @staticmethod
    def backward(ctx: Any, grad):  # type: ignore[override]
        qs, key3, key_t, value3, out, top, log_total, *kept = ctx.saved_tensors
        batch, heads, kv_heads, q_length, length, dim = ctx.shape
        groups = heads // kv_heads
        # dO and Δ in the (B·H_kv, q·G, ·) layout of the forward pass
        grad5 = grad.contiguous().view(batch, q_length, kv_heads, groups, dim)
        d_out = grad5.transpose(1, 2).reshape(batch * kv_heads, q_length * groups, dim)
        delta = (grad5.float() * out.view(grad5.shape).float()).sum(-1)  # (B, q, H_kv, G)
        delta = delta.transpose(1, 2).reshape(batch * kv_heads, q_length * groups, 1)
        d_qs = torch.empty_like(qs)
        d_key = torch.zeros_like(key3)
        d_value = torch.zeros_like(value3)
        for index, (start, end) in enumerate(_chunks(batch, heads, q_length, length)):
            keys, bias, blind = ctx.visibility.chunk(start, end)
            rows = slice(start * groups, end * groups)
            shape = (batch, kv_heads, end - start, groups, keys)
            if kept:
                probs = kept[index]  # (B·H_kv, c·G, k) bf16
            else:
                probs = _scores(qs[:, rows], key_t[:, :, :keys], bias, shape).sub_(top[:, rows])
                probs = probs.sub_(log_total[:, rows]).exp_().to(qs.dtype)
            d_value[:, :keys].baddbmm_(probs.transpose(1, 2), d_out[:, rows])
            d_probs = torch.bmm(d_out[:, rows], value3[:, :keys].transpose(1, 2))  # (B·H_kv, c·G, k)
            d_scores = torch.sub(d_probs, delta[:, rows]).mul_(probs)  # fp32
            if blind is not None:  # rows that see nothing: no gradient (their P is a uniform mix)
                d_scores.view(shape).masked_fill_(blind, 0.0)
            d_scores = d_scores.to(qs.dtype)
            d_qs[:, rows].baddbmm_(d_scores, key3[:, :keys], beta=0)
            d_key[:, :keys].baddbmm_(d_scores.transpose(1, 2), qs[:, rows])
        d_query = d_qs.view(batch, kv_heads, q_length, groups, dim).mul_(ctx.scale).permute(0, 1, 3, 2, 4)
        d_query = d_query.reshape(batch, heads, q_length, dim)
        d_key = d_key.view(batch, kv_heads, length, dim)
        d_value = d_value.view(batch, kv_heads, length, dim)
        return d_query, d_key, d_value, None, None
