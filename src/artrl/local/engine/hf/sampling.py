"""Pure sampling math for the embedded engine: one step of next-token choice for a batch of rows.

Reported logprobs are the model's raw distribution (temperature 1, before top-p), the same convention as
vLLM's default and what the trainer recomputes; temperature and top-p only shape which token is drawn.

The whole batch is sampled with a handful of tensor operations (no per-row distribution work): each row
draws one uniform number from its own generator (seeded rows stay reproducible whatever else shares the
batch) and takes the token where its cumulative distribution passes that number (inverse CDF).
"""

from __future__ import annotations

import logging
import random
import threading
import warnings

import torch

from artrl.local.engine.contract import SamplingParams, TokenChoice

log = logging.getLogger(__name__)

__all__ = ["SamplingError", "SamplingParams", "TokenChoice", "sample_rows", "top_p_filter"]


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (as vLLM does): 1/T would overflow


class SamplingError(ValueError):
    """The model's output for one row cannot be sampled from (non-finite logits)."""


def uniforms(generators: list[random.Random | None], device: torch.device) -> torch.Tensor:
    """(B,) one draw in [0, 1) per row from the row's generator (None: torch's global RNG).

    A seeded row draws 24 random bits from its own `random.Random` (exact in float32, so never 1.0): no
    torch operation per row, each of which would hand the interpreter lock to another thread and wait to
    get it back (a torch.Generator per row cost ~30 such round trips per decode step of 30 rows)."""
    draws = [g.getrandbits(24) * 2.0**-24 if g is not None else 0.0 for g in generators]
    u = torch.tensor(draws, dtype=torch.float32)  # (B,)
    unseeded = [row for row, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded))
    return u.to(device)


def top_p_filter(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always >= 1 token); renormalise.

    probs (..., V); top_p a float or a (...,) tensor of per-row thresholds."""
    if not isinstance(top_p, torch.Tensor):
        top_p = torch.full(probs.shape[:-1], float(top_p), dtype=probs.dtype, device=probs.device)
    return _top_p_rows(probs, top_p)


def _top_p_rows(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:  # (..., V), (...,) -> (..., V)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # (..., V), (..., V)
    cumulative = torch.cumsum(sorted_probs, dim=-1)  # (..., V)
    # (..., V) the mass before this token already reaches top_p
    drop_sorted = cumulative - sorted_probs >= top_p.unsqueeze(-1)
    kept = sorted_probs.masked_fill(drop_sorted, 0.0)  # (..., V)
    filtered = torch.zeros_like(probs).scatter(-1, order, kept)  # (..., V)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B,) token per row by inverse CDF: probs (B, V) non-negative rows, u (B,) in [0, 1)."""
    cdf = torch.cumsum(probs, dim=-1)  # (B, V)
    target = (u * cdf[:, -1]).unsqueeze(-1)  # (B, 1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)  # (B,)
    # rounding can land on a zero-probability token at the very end: take the likeliest instead
    missed = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) <= 0  # (B,)
    return torch.where(missed, probs.argmax(dim=-1), tokens)


def choose(
    logits: torch.Tensor,  # (B, V)
    settings: torch.Tensor,  # (B, 2) float: each row's temperature and top_p
    u: torch.Tensor,  # (B,) each row's uniform draw
    greedy_below: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's sampling as tensors: (4, B) float64 rows token, its logprob, whether the row has a finite
    logit, whether its distribution is valid; and the (B, V) logprobs. (TorchScript compiles it: one call
    into C++ instead of ~25 operations, each a round trip of the interpreter lock.)"""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)  # (B, V)
    temperature, top_p = settings[:, 0], settings[:, 1]  # (B,) each
    greedy = temperature < greedy_below  # (B,)
    probs = torch.softmax(logits / temperature.clamp(min=greedy_below).unsqueeze(-1), dim=-1)  # (B, V)
    if bool((top_p < 1.0).any()):
        probs = torch.where(top_p.unsqueeze(-1) < 1.0, _top_p_rows(probs, top_p), probs)
    finite = torch.isfinite(logprobs).any(dim=-1)  # (B,)
    valid = greedy | (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0))  # (B,)
    safe = torch.where(valid.unsqueeze(-1), probs, torch.ones_like(probs)).nan_to_num(0.0)  # (B, V)
    drawn = _draw(safe, u)  # (B,)
    tokens = torch.where(greedy, logprobs.argmax(dim=-1), drawn)  # (B,)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B,)
    rows = torch.stack([tokens.double(), chosen.double(), finite.double(), valid.double()])  # (4, B)
    return rows, logprobs


_SCRIPTED: list = []
_COMPILING = threading.Lock()


def _scripted_choose():
    """`choose` compiled by TorchScript once per process; `choose` itself where TorchScript fails."""
    with _COMPILING:
        if not _SCRIPTED:
            try:
                with warnings.catch_warnings():  # (torch calls TorchScript deprecated: see scripted_layers)
                    warnings.simplefilter("ignore", DeprecationWarning)
                    _SCRIPTED.append(torch.jit.script(choose))
            except Exception as exc:  # (a torch without TorchScript)
                log.info("sampling runs eagerly: TorchScript failed (%s: %s)", type(exc).__name__, exc)
                _SCRIPTED.append(choose)
        return _SCRIPTED[0]


def sample_rows(
    logits: torch.Tensor,  # (B, V) float
    params: list[SamplingParams],  # len B
    generators: list[random.Random | None],  # len B; None = torch's global RNG
) -> list[TokenChoice | SamplingError]:
    """One token per row; a row that cannot be sampled gives its SamplingError instead (the others go on)."""
    settings = torch.tensor([[p.temperature, p.top_p] for p in params], device=logits.device)  # (B, 2)
    rows, logprobs = _scripted_choose()(logits, settings, uniforms(generators, logits.device), GREEDY_BELOW)
    k = max(p.top_logprobs for p in params)
    top_pairs: list[list[tuple[int, float]]] = [[] for _ in params]
    if k > 0:
        values, indices = torch.topk(logprobs, k, dim=-1)  # (B, k), (B, k)
        top_pairs = [
            list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)
        ]
    out: list[TokenChoice | SamplingError] = []
    for row, (token, logprob, has_finite, ok) in enumerate(zip(*rows.tolist(), strict=True)):
        p = params[row]
        if not has_finite:
            out.append(SamplingError("the model produced no finite logit for this sequence"))
        elif not ok:
            out.append(SamplingError(f"no valid distribution at temperature {p.temperature}"))
        else:
            out.append(TokenChoice(int(token), logprob, tuple(top_pairs[row][: p.top_logprobs])))
    return out
