"""Pure sampling math for the embedded engine: one step of next-token choice for a batch of rows.

Reported logprobs are the model's raw distribution (temperature 1, before top-p), the same convention as
vLLM's default and what the trainer recomputes; temperature and top-p only shape which token is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_logprobs: int = 0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class TokenChoice:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


def sample_rows(
    logits: torch.Tensor,  # (B, V) float
    params: list[SamplingParams],  # len B
    generators: list[torch.Generator | None],  # len B; None = the global RNG
) -> list[TokenChoice]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    choices: list[TokenChoice] = []
    for row, p in enumerate(params):
        row_logprobs = logprobs[row]  # (V,)
        if p.temperature == 0.0:
            token = int(torch.argmax(row_logprobs))
        else:
            probs = torch.softmax(logits[row].float() / p.temperature, dim=-1)  # (V,)
            if p.top_p < 1.0:
                probs = top_p_filter(probs, p.top_p)
            token = int(torch.multinomial(probs, 1, generator=generators[row]))
        top: tuple[tuple[int, float], ...] = ()
        if p.top_logprobs > 0:
            values, indices = torch.topk(row_logprobs, p.top_logprobs)  # (k,), (k,)
            top = tuple(zip(indices.tolist(), values.tolist(), strict=True))
        choices.append(TokenChoice(token, float(row_logprobs[token]), top))
    return choices


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always >= 1 token); renormalise."""
    sorted_probs, order = torch.sort(probs, descending=True)  # (V,), (V,)
    cumulative = torch.cumsum(sorted_probs, dim=-1)  # (V,)
    drop_sorted = cumulative - sorted_probs >= top_p  # (V,) mass before this token already reaches top_p
    kept = sorted_probs.masked_fill(drop_sorted, 0.0)  # (V,)
    filtered = torch.zeros_like(probs).scatter(0, order, kept)  # (V,)
    return filtered / filtered.sum()
