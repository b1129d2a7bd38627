"""Pure sampling math for the embedded engine: one step of next-token choice for a batch of rows.

Reported logprobs are the model's raw distribution (temperature 1, before top-p), the same convention as
vLLM's default and what the trainer recomputes; temperature and top-p only shape which token is drawn.
"""

from __future__ import annotations

import torch

from artrl.local.engine import SamplingParams, TokenChoice

__all__ = ["SamplingError", "SamplingParams", "TokenChoice", "sample_row", "sample_rows", "top_p_filter"]


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (as vLLM does): 1/T would overflow


class SamplingError(ValueError):
    """The model's output for one row cannot be sampled from (non-finite logits)."""


def sample_row(
    logits: torch.Tensor,  # (V,) float
    logprobs: torch.Tensor,  # (V,) log_softmax(logits)
    params: SamplingParams,
    generator: torch.Generator | None,  # None = the global RNG
) -> TokenChoice:
    if not bool(torch.isfinite(logprobs).any()):
        raise SamplingError("the model produced no finite logit for this sequence")
    if params.temperature < GREEDY_BELOW:
        token = int(torch.argmax(logprobs))
    else:
        probs = torch.softmax(logits.float() / params.temperature, dim=-1)  # (V,)
        if params.top_p < 1.0:
            probs = top_p_filter(probs, params.top_p)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            raise SamplingError(f"no valid distribution at temperature {params.temperature}")
        token = int(torch.multinomial(probs, 1, generator=generator))
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs > 0:
        values, indices = torch.topk(logprobs, params.top_logprobs)  # (k,), (k,)
        top = tuple(zip(indices.tolist(), values.tolist(), strict=True))
    return TokenChoice(token, float(logprobs[token]), top)


def sample_rows(
    logits: torch.Tensor,  # (B, V) float
    params: list[SamplingParams],  # len B
    generators: list[torch.Generator | None],  # len B; None = the global RNG
) -> list[TokenChoice | SamplingError]:
    """One token per row; a row that cannot be sampled gives its SamplingError instead (the others go on)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    out: list[TokenChoice | SamplingError] = []
    for row, p in enumerate(params):
        try:
            out.append(sample_row(logits[row], logprobs[row], p, generators[row]))
        except (SamplingError, RuntimeError) as exc:
            out.append(exc if isinstance(exc, SamplingError) else SamplingError(str(exc)))
    return out


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always >= 1 token); renormalise."""
    sorted_probs, order = torch.sort(probs, descending=True)  # (V,), (V,)
    cumulative = torch.cumsum(sorted_probs, dim=-1)  # (V,)
    drop_sorted = cumulative - sorted_probs >= top_p  # (V,) mass before this token already reaches top_p
    kept = sorted_probs.masked_fill(drop_sorted, 0.0)  # (V,)
    filtered = torch.zeros_like(probs).scatter(0, order, kept)  # (V,)
    return filtered / filtered.sum()
