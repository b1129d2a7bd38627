"""The Tinker API's built-in losses (`forward_backward(data, loss_fn=...)`), as pure functions of per-token
tensors, for the training server's Tinker routes (issue 42). Tinker's losses are sums over every token of
every datum (no normalisation: a client that wants a mean scales its weights or advantages), and each input
is aligned with the datum's model input: position t predicts `target_tokens[t]`.

Notation, per token t (tensors (B, T), padding: zero weights and advantages):
    lp    log π_θ(target_tokens) under the current weights (with grad)
    q     the sampler's logprobs of the same tokens (`logprobs`)
    A     per-token advantages (`advantages`)
    r     exp(lp - q)
    lo, hi  `clip_low_threshold`, `clip_high_threshold` of loss_fn_config (default 0.8, 1.2)

    cross_entropy        L = -Σ weights·lp
    importance_sampling  L = -Σ r·A
    ppo                  L = -Σ min(r·A, clip(r, lo, hi)·A)
    cispo                L = -Σ sg(clip(r, lo, hi))·lp·A

artrl's own objectives are these with its normalisation folded into the per-token inputs (`loss.py`):
its SFT loss is cross_entropy with weights w·m/N, its PPO-clip ppo with advantages A·w·m/N and thresholds
1 - clip_low, 1 + clip_high (min(r·cA, clip(r)·cA) = c·min(r·A, clip(r)·A) for c >= 0), its CISPO cispo with
lo = 0 (tests/local/train/tinker/test_losses.py checks each, value and gradient).
"""

from __future__ import annotations

import torch

INPUTS = {  # the loss_fn_inputs each loss reads, besides target_tokens (which give lp)
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
}
DEFAULT_CLIP = (0.8, 1.2)  # Tinker's clip_low_threshold, clip_high_threshold


def tinker_loss(
    name: str,
    lp: torch.Tensor,  # (B, T) logprobs of the target tokens, with grad
    inputs: dict[str, torch.Tensor],  # (B, T) each: weights, logprobs, advantages (as `name` reads them)
    config: dict[str, float] | None = None,  # loss_fn_config: clip_low_threshold, clip_high_threshold
) -> torch.Tensor:
    """The summed loss (a scalar with grad). ValueError for an unknown loss, a missing input or an unknown
    setting, saying what the loss needs."""
    if name not in INPUTS:
        raise ValueError(f"unknown loss_fn {name!r}: this server computes {', '.join(INPUTS)}")
    missing = [key for key in INPUTS[name] if key not in inputs]
    if missing:
        raise ValueError(f"loss_fn {name!r} needs loss_fn_inputs {list(INPUTS[name])} (missing {missing})")
    config = dict(config or {})
    unknown = sorted(set(config) - {"clip_low_threshold", "clip_high_threshold"})
    if unknown:
        raise ValueError(
            f"unknown loss_fn_config {unknown}: this server takes clip_low_threshold, clip_high_threshold"
        )
    if name == "cross_entropy":
        return -(inputs["weights"] * lp).sum()
    ratio = torch.exp(lp - inputs["logprobs"])  # (B, T)
    advantages = inputs["advantages"]  # (B, T)
    if name == "importance_sampling":
        return -(ratio * advantages).sum()
    low = float(config.get("clip_low_threshold", DEFAULT_CLIP[0]))
    high = float(config.get("clip_high_threshold", DEFAULT_CLIP[1]))
    clipped = ratio.clamp(low, high)  # (B, T)
    if name == "ppo":
        return -torch.minimum(ratio * advantages, clipped * advantages).sum()
    return -(clipped.detach() * lp * advantages).sum()  # cispo
