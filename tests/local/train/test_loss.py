"""Numerical checks of the advantages and the policy loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from artrl.config import TrainConfig
from artrl.local.train.advantages import group_advantages
from artrl.local.train.loss import policy_loss


def test_group_advantages_by_hand():
    out = group_advantages([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0], [3.0, 1.0]], scale_rewards=True, eps=0.0)
    assert out.advantages[0] == pytest.approx([1.0, -1.0, -1.0, 1.0])  # mean .5, std .5
    assert out.advantages[1] == [0.0, 0.0]
    assert out.advantages[2] == pytest.approx([1.0, -1.0])
    assert out.zero_variance_groups == 1
    dr = group_advantages([[3.0, 1.0]], scale_rewards=False)
    assert dr.advantages[0] == pytest.approx([1.0, -1.0])


def test_non_finite_reward_is_an_error():
    with pytest.raises(ValueError, match="finite"):
        group_advantages([[1.0, math.nan]])


def inputs():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.2]], requires_grad=True)  # (B, T)
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return lp, mask


def test_ratio_one_is_plain_policy_gradient():
    lp, mask = inputs()
    adv = torch.tensor([2.0, -1.0])
    weights = torch.tensor([1.0, 0.5])
    terms = policy_loss(lp, lp.detach().clone(), adv, mask, weights, normaliser=3.0, settings=TrainConfig())
    # L = -(1/N) Σ w·m·A·r with r = 1:  -(2·2 + 0.5·(-1)·2)/3 = -1
    assert terms.loss.item() == pytest.approx(-1.0)
    terms.loss.backward()
    # ∂L/∂lp = -w·m·A / N  (ratio 1, clip inactive)
    expected = -(mask * (weights * adv)[:, None]) / 3.0
    assert torch.allclose(lp.grad, expected)
    assert lp.grad[0, 0] == 0 and lp.grad[1, 2] == 0  # zero gradient where the mask is zero
    assert terms.clipped_tokens == 0.0
    assert terms.ratio == pytest.approx(3.0)  # Σ w·m·r


def test_ppo_clip_bounds_are_separate():
    lp = torch.tensor([[math.log(1.5), math.log(0.5)]], requires_grad=True)
    mu = torch.zeros(1, 2)  # behaviour prob 1: r = p
    mask = torch.ones(1, 2)
    settings = TrainConfig(clip_low=0.2, clip_high=0.28)
    pos = policy_loss(lp, mu, torch.tensor([1.0]), mask, torch.ones(1), 2.0, settings)
    # A>0: token 0 ratio 1.5 clipped to 1.28 (no grad); token 1 ratio .5: min(.5, .8) = .5 (grad)
    assert pos.loss.item() == pytest.approx(-(1.28 + 0.5) / 2)
    assert pos.clipped_tokens == 1.0
    pos.loss.backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] == pytest.approx(-0.5 / 2)
    lp.grad = None
    neg = policy_loss(lp, mu, torch.tensor([-1.0]), mask, torch.ones(1), 2.0, settings)
    # A<0: -min(-1.5, -1.28) = 1.5 (unclipped, grad); -min(-.5, -.8) = .8 (clipped to 1-0.2)
    assert neg.loss.item() == pytest.approx((1.5 + 0.8) / 2)
    neg.loss.backward()
    assert lp.grad[0, 0] == pytest.approx(1.5 / 2) and lp.grad[0, 1] == 0


def test_cispo_keeps_gradient_of_clipped_tokens():
    lp = torch.tensor([[math.log(2.0), math.log(0.5)]], requires_grad=True)
    mu = torch.zeros(1, 2)
    terms = policy_loss(
        lp,
        mu,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        torch.ones(1),
        1.0,
        TrainConfig(loss="cispo", clip_high=0.28),
    )
    terms.loss.backward()
    # ℓ = -sg(min(r, 1.28))·A·lp  →  ∂/∂lp = -min(r, 1.28)
    assert lp.grad[0].tolist() == pytest.approx([-1.28, -0.5])
    assert terms.clipped_tokens == 1.0


def test_truncated_importance_sampling_caps_the_weight():
    lp = torch.tensor([[0.0, 0.0]], requires_grad=True)  # trainer prob 1
    mu = torch.tensor([[math.log(0.25), math.log(0.8)]])  # sampler probs
    terms = policy_loss(
        lp, mu, torch.tensor([1.0]), torch.ones(1, 2), torch.ones(1), 1.0, TrainConfig(tis_cap=2.0)
    )
    terms.loss.backward()
    # weights min(1/.25, 2) = 2 and min(1/.8, 2) = 1.25; gradient -A·weight
    assert lp.grad[0].tolist() == pytest.approx([-2.0, -1.25])


def test_kl_penalty_k3():
    lp = torch.tensor([[-1.0]], requires_grad=True)
    ref = torch.tensor([[-2.0]])
    terms = policy_loss(
        lp,
        lp.detach().clone(),
        torch.tensor([0.0]),
        torch.ones(1, 1),
        torch.ones(1),
        1.0,
        TrainConfig(kl_coef=0.5),
        lp_ref=ref,
    )
    k3 = math.exp(-1.0) - (-1.0) - 1
    assert terms.loss.item() == pytest.approx(0.5 * k3)
    assert terms.kl == pytest.approx(k3)
    terms.loss.backward()
    assert lp.grad[0, 0] == pytest.approx(0.5 * (1 - math.exp(-1.0)))  # ∂k3/∂lp = 1 - exp(ref - lp)


def test_unknown_behaviour_logprob_means_on_policy():
    lp, mask = inputs()
    mu = torch.full_like(lp, float("nan"))
    terms = policy_loss(lp, mu, torch.tensor([1.0, 1.0]), mask, torch.ones(2), 4.0, TrainConfig())
    assert terms.loss.item() == pytest.approx(-1.0)
    assert terms.mismatch == 0.0
