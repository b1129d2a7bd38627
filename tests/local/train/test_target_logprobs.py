"""The trainer's log-prob of each target and its entropy (local/train/logprobs.py: `target_logprobs`, a backward
written out): the values and gradients of log_softmax + gather; the chunked, recomputed path of
`token_logprobs` giving what one chunk gives."""

from __future__ import annotations

import pytest
import torch

from artrl.local.train.logprobs import target_logprobs, token_logprobs
from artrl.local.train.pack import collate
from artrl.local.train.rows import Row


def reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits, dim=-1)  # (c, V)
    return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def test_values_entropy_and_gradients_are_log_softmax_and_gathers():
    torch.manual_seed(0)
    logits = (4 * torch.randn(37, 101)).requires_grad_(True)  # (c, V)
    targets = torch.randint(0, 101, (37,))
    targets[3] = targets[4] = 7  # (a target repeated across rows)
    grad = torch.randn(37)
    results = []
    for fn in (reference, target_logprobs):
        logits.grad = None
        picked, entropy = fn(logits, targets)
        (picked * grad).sum().backward()
        results.append((picked.detach(), entropy.detach(), logits.grad.clone()))
    (p_ref, h_ref, g_ref), (p, h, g) = results
    assert torch.allclose(p, p_ref, atol=1e-5) and torch.allclose(h, h_ref, atol=1e-5)
    assert torch.allclose(g, g_ref, atol=1e-6)
    assert not target_logprobs(logits, targets)[1].requires_grad  # (the entropy is a measurement)
    _, none = target_logprobs(logits, targets, with_entropy=False)
    assert torch.equal(none, torch.zeros(37))


def test_gradient_matches_finite_differences_in_float64():
    torch.manual_seed(1)
    logits = torch.randn(5, 11, dtype=torch.float64)
    targets = torch.tensor([0, 10, 3, 3, 7])
    weights = torch.randn(5, dtype=torch.float64)

    def objective(x: torch.Tensor) -> torch.Tensor:
        return (target_logprobs(x, targets)[0] * weights).sum()

    x = logits.clone().requires_grad_(True)
    objective(x).backward()
    eps = 1e-6
    numeric = torch.zeros_like(logits)
    for i in range(logits.numel()):
        step = torch.zeros(logits.numel(), dtype=torch.float64)
        step[i] = eps
        step = step.view_as(logits)
        numeric.view(-1)[i] = (objective(logits + step) - objective(logits - step)) / (2 * eps)
    assert torch.allclose(x.grad, numeric, atol=1e-8)


def test_a_second_backward_through_the_same_graph_is_refused():
    # (the backward overwrites the softmax it kept: autograd refuses a second use, never a wrong gradient)
    x = torch.randn(3, 7, requires_grad=True)
    picked, _ = target_logprobs(x, torch.tensor([1, 2, 3]))
    picked.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        picked.sum().backward()


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1000.0, 0.0, -1000.0], [-50.0, -50.0, 80.0]], requires_grad=True)
    picked, entropy = target_logprobs(logits, torch.tensor([2, 2]))
    picked.sum().backward()
    assert (
        torch.isfinite(picked).all() and torch.isfinite(entropy).all() and torch.isfinite(logits.grad).all()
    )
    assert picked[0].item() == -2000.0 and abs(picked[1].item()) < 1e-6


def test_chunked_recomputed_logprobs_and_gradients_equal_one_chunk(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = [
        Row(list(range(5, 40)), [0] * 10 + [1] * 25, [0.0] * 35, advantage=1.0),
        Row(list(range(50, 70)), [0] * 5 + [1] * 15, [0.0] * 20, advantage=-1.0),
    ]
    batch = collate(rows, torch.device("cpu"))
    results = []
    for chunk in (None, 8):  # (40 trainable targets: one chunk; five, each recomputed in the backward)
        model.zero_grad()
        lp, entropy = token_logprobs(model, batch, chunk)  # (B, T-1) each
        (lp * batch.mask * torch.tensor([1.0, -0.5])[:, None]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((lp.detach(), entropy, grads))
    (lp_one, h_one, one), (lp_chunked, h_chunked, chunked) = results
    assert torch.allclose(lp_chunked, lp_one, atol=1e-6) and torch.allclose(h_chunked, h_one, atol=1e-6)
    assert (lp_one[batch.mask.bool()] < 0).all() and (h_one[batch.mask.bool()] > 0).all()
    assert one.keys() == chunked.keys() and one
    for name, grad in one.items():
        assert torch.allclose(chunked[name], grad, rtol=1e-4, atol=1e-4 * grad.abs().max()), name
