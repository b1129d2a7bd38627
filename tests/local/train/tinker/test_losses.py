"""The Tinker losses (train/tinker/losses.py) against artrl's own objectives (train/loss.py): with artrl's
normalisation folded into the per-token inputs, value and gradient agree (float64, to 1e-12), and bad
requests say what the loss needs."""

from __future__ import annotations

import pytest
import torch

from artrl.config import TrainConfig
from artrl.local.train.loss import policy_loss, sft_loss
from artrl.local.train.tinker.losses import tinker_loss

B, T = 3, 7


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(B, T, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    mu = (
        lp.detach() + torch.randn(B, T, generator=generator, dtype=torch.float64) * 0.4
    )  # (off the clip range too)
    mask = (torch.rand(B, T, generator=generator) > 0.3).double()
    advantages = torch.randn(B, generator=generator, dtype=torch.float64)
    weights = torch.rand(B, generator=generator, dtype=torch.float64) + 0.5
    normaliser = float((mask * weights[:, None]).sum())
    return lp, mu, mask, advantages, weights, normaliser


def value_and_grad(loss: torch.Tensor, lp: torch.Tensor) -> tuple[float, torch.Tensor]:
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss), grad


@pytest.mark.parametrize("loss", ["ppo", "cispo"])
def test_artrls_policy_losses_are_tinkers_with_the_normalisation_in_the_advantages(loss):
    lp, mu, mask, advantages, weights, normaliser = batch()
    settings = TrainConfig(loss=loss, clip_low=0.2, clip_high=0.28)
    ours = policy_loss(lp, mu, advantages, mask, weights, normaliser, settings).loss
    per_token = advantages[:, None] * weights[:, None] * mask / normaliser  # (B, T)
    low = 1 - settings.clip_low if loss == "ppo" else 0.0  # (artrl's CISPO caps the ratio above only)
    theirs = tinker_loss(
        loss,
        lp,
        {"logprobs": mu, "advantages": per_token},
        {"clip_low_threshold": low, "clip_high_threshold": 1 + settings.clip_high},
    )
    (a, grad_a), (b, grad_b) = value_and_grad(ours, lp), value_and_grad(theirs, lp)
    assert a == pytest.approx(b, abs=1e-12)
    torch.testing.assert_close(grad_a, grad_b, rtol=0, atol=1e-12)


def test_artrls_sft_loss_is_cross_entropy_with_the_normalisation_in_the_weights():
    lp, _, mask, _, weights, normaliser = batch(1)
    ours = sft_loss(lp, mask, weights, normaliser)
    theirs = tinker_loss("cross_entropy", lp, {"weights": weights[:, None] * mask / normaliser})
    (a, grad_a), (b, grad_b) = value_and_grad(ours, lp), value_and_grad(theirs, lp)
    assert a == pytest.approx(b, abs=1e-12)
    torch.testing.assert_close(grad_a, grad_b, rtol=0, atol=1e-12)


def test_importance_sampling_is_the_unclipped_ratio_times_the_advantage():
    lp, mu, _, _, _, _ = batch(2)
    advantages = torch.ones(B, T, dtype=torch.float64)
    loss = tinker_loss("importance_sampling", lp, {"logprobs": mu, "advantages": advantages})
    _, grad = value_and_grad(loss, lp)
    torch.testing.assert_close(grad, -torch.exp(lp.detach() - mu))  # ∂(-r·A)/∂lp = -r·A


def test_bad_requests_say_what_the_loss_needs():
    lp = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="this server computes cross_entropy"):
        tinker_loss("dro", lp, {})
    with pytest.raises(ValueError, match=r"needs loss_fn_inputs \['logprobs', 'advantages'\]"):
        tinker_loss("ppo", lp, {"advantages": torch.zeros(1, 2)})
    with pytest.raises(ValueError, match="unknown loss_fn_config"):
        tinker_loss(
            "ppo", lp, {"logprobs": torch.zeros(1, 2), "advantages": torch.zeros(1, 2)}, {"beta": 1.0}
        )
