"""The policy-gradient objective, as pure functions of per-token tensors.

Notation, per token t of row b (all tensors (B, T)):
    m        loss mask: 1 on sampled tokens
    w        row weight (1 / rows of its trajectory), broadcast over T
    A        the trajectory's advantage, broadcast over T
    lp       log π_θ(token) under the current weights (with grad)
    mu       log μ(token): the behaviour logprob the sampler recorded (NaN = unknown: taken as lp.detach())
    r        exp(lp - mu): the importance ratio against the behaviour policy

PPO-clip with separate bounds (DAPO's clip-higher):
    ℓ_t = -min(r·A, clip(r, 1 - ε_low, 1 + ε_high)·A)
CISPO (clip the importance weight, keep every token's gradient):
    ℓ_t = -sg(min(r, 1 + ε_high))·A·lp
Truncated importance sampling (tis_cap = C): the ratio is split into the trainer's own ratio
r' = exp(lp - sg(lp)) (= 1 in value, ∇ = ∇lp) used above, times a detached weight min(exp(sg(lp) - mu), C)
that corrects a train/inference mismatch without letting one token's weight explode.
KL penalty to the base policy (adapter disabled), the k3 estimator, added per token:
    ℓ_t += β·(exp(lp_ref - lp) - (lp_ref - lp) - 1)
Token-level normalisation over the whole optimizer step (all micro-batches):
    L = Σ_{b,t} w·m·ℓ_t / N,    N = Σ_{b,t} w·m   (computed once per step and passed in)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from artrl.config import TrainConfig


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar, with grad: this micro-batch's share of L
    clipped_tokens: float  # weighted count of tokens whose ratio was clipped
    kl: float  # weighted sum of the KL estimate
    ratio: float  # weighted sum of r
    mismatch: float  # weighted sum of |lp - mu| (trainer vs sampler, before this step's update)
    mismatch_max: float  # largest |lp - mu| over sampled tokens whose mu is known
    mismatch_over: float  # weighted count of such tokens with |lp - mu| > mismatch_threshold
    known: float  # weighted count of sampled tokens whose mu is known


def policy_loss(
    lp: torch.Tensor,  # (B, T) current logprobs, with grad
    mu: torch.Tensor,  # (B, T) behaviour logprobs, NaN where unknown
    advantages: torch.Tensor,  # (B,) per row
    mask: torch.Tensor,  # (B, T) float, 1 on sampled tokens
    weights: torch.Tensor,  # (B,) per row
    normaliser: float,  # N: weighted trainable tokens of the whole optimizer step
    settings: TrainConfig,  # loss, clip_low, clip_high, tis_cap, kl_coef, mismatch_threshold
    lp_ref: torch.Tensor | None = None,  # (B, T) base-model logprobs, no grad (when kl_coef > 0)
) -> LossTerms:
    known_mu = torch.where(torch.isnan(mu), lp.detach(), mu)  # (B, T)
    token_weight = mask * weights[:, None]  # (B, T)
    adv = advantages[:, None]  # (B, 1)
    if settings.tis_cap is not None:
        ratio = torch.exp(lp - lp.detach())  # (B, T) value 1, gradient of lp
        is_weight = torch.exp(lp.detach() - known_mu).clamp(max=settings.tis_cap)  # (B, T)
    else:
        ratio = torch.exp(lp - known_mu)  # (B, T)
        is_weight = torch.ones_like(lp)  # (B, T)
    if settings.loss == "ppo":
        clipped_ratio = ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)  # (B, T)
        per_token = -torch.minimum(ratio * adv, clipped_ratio * adv) * is_weight  # (B, T)
        clipped = (ratio * adv > clipped_ratio * adv).float()  # (B, T) the clip is active
    elif settings.loss == "cispo":
        capped = ratio.detach().clamp(max=1 + settings.clip_high)  # (B, T)
        per_token = -capped * adv * lp * is_weight  # (B, T)
        clipped = (ratio.detach() > 1 + settings.clip_high).float()  # (B, T)
    else:
        raise ValueError(f"unknown loss {settings.loss!r}; use 'ppo' or 'cispo'")
    kl = torch.zeros_like(lp)  # (B, T)
    if settings.kl_coef > 0:
        if lp_ref is None:
            raise ValueError("kl_coef > 0 needs reference logprobs")
        delta = lp_ref - lp  # (B, T)
        kl = torch.exp(delta) - delta - 1  # (B, T)
        per_token = per_token + settings.kl_coef * kl  # (B, T)
    loss = (per_token * token_weight).sum() / normaliser  # ()
    with torch.no_grad():
        known = ~torch.isnan(mu) & (mask > 0)  # (B, T)
        gap = (lp - known_mu).abs()  # (B, T) 0 where mu is unknown
        return LossTerms(
            loss=loss,
            clipped_tokens=float((clipped * token_weight).sum()),
            kl=float((kl * token_weight).sum()),
            ratio=float((torch.exp(lp - known_mu) * token_weight).sum()),
            mismatch=float((gap * token_weight).sum()),
            mismatch_max=float(gap[known].max()) if bool(known.any()) else 0.0,
            mismatch_over=float(((gap > settings.mismatch_threshold) * token_weight).sum()),
            known=float((known * token_weight).sum()),
        )


def sft_loss(
    lp: torch.Tensor,  # (B, T) current logprobs, with grad
    mask: torch.Tensor,  # (B, T) float, 1 on assistant tokens
    weights: torch.Tensor,  # (B,)
    normaliser: float,  # Σ w·m over the optimizer step
) -> torch.Tensor:
    """Supervised fine-tuning: L = -Σ w·m·lp / N (token-level mean negative log-likelihood)."""
    return -(lp * mask * weights[:, None]).sum() / normaliser  # ()
