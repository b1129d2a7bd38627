"""The Tinker API's training calls on artrl's trainer (train/tinker/steps.py): forward_backward then
optim_step on the same tokens, behaviour logprobs and advantages (artrl's normalisation folded into the
per-token advantages) is one artrl training step — the same logprobs, loss and trained weights (fp32,
tolerances below); gradients add up across forward_backward calls until optim_step; bad datums are refused
with what is wrong."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from artrl.config import LoraConfig, TrainConfig
from artrl.local.train.adapters import attach_adapter
from artrl.local.train.batch import TrainingBatch
from artrl.local.train.rows import Row
from artrl.local.train.tinker.steps import TinkerSteps, TokenDatum
from artrl.local.train.trainer import Trainer

pytestmark = pytest.mark.slow  # (the tiny model, trained: ~10 s a test on 2 cores)


def rows(seed: int = 0) -> list[Row]:
    rng = random.Random(seed)
    out = []
    for i in range(4):
        n, prompt = rng.randint(12, 30), rng.randint(3, 8)
        out.append(
            Row(
                ids=[rng.randrange(2048) for _ in range(n)],
                mask=[0] * prompt + [1] * (n - prompt),
                logprobs=[math.nan] * prompt + [rng.uniform(-8.0, -6.5) for _ in range(n - prompt)],
                trajectory=i,
                weight=0.5 if i == 3 else 1.0,
                advantage=rng.choice([1.0, -1.0]) * rng.uniform(0.5, 1.5),
            )
        )
    return out


@pytest.fixture
def twin_models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = attach_adapter(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(rank=4, dropout=0.0)
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # (B = 0 at init would leave A's gradient zero: both factors train here)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return model, copy.deepcopy(model)


def datums_of(batch: list[Row]) -> list[TokenDatum]:
    """The rows as Tinker datums: inputs and next-token targets; per target its behaviour logprob and its
    advantage with artrl's normalisation (row weight, mask, 1/N) folded in."""
    normaliser = sum(r.weight * (r.trainable_tokens - r.mask[0]) for r in batch)
    return [
        TokenDatum(
            r.ids[:-1],
            {
                "target_tokens": r.ids[1:],
                "logprobs": [0.0 if math.isnan(x) else x for x in r.logprobs[1:]],
                "advantages": [r.advantage * r.weight * m / normaliser for m in r.mask[1:]],
            },
        )
        for r in batch
    ]


def test_forward_backward_then_optim_step_is_one_artrl_step(twin_models):
    ours, theirs = twin_models
    config = TrainConfig(
        loss="ppo", tis_cap=None, learning_rate=2e-3, betas=(0.9, 0.95), max_grad_norm=0.5, save_rows=True
    )
    batch = TrainingBatch(rows=rows())
    metrics = Trainer(ours, pad_id=0).step(batch, config)

    tinker = TinkerSteps(Trainer(theirs, pad_id=0))
    clip = {"clip_low_threshold": 1 - config.clip_low, "clip_high_threshold": 1 + config.clip_high}
    logprobs, result = tinker.forward_backward(datums_of(batch.rows), "ppo", clip)
    tinker.optim_step(2e-3, 0.9, 0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.5)  # (torch AdamW's eps)

    for row, trained, got in zip(batch.rows, batch.trainer_logprobs, logprobs, strict=True):
        expected = [trained[t + 1] for t in range(len(row.ids) - 1) if row.mask[t + 1]]
        sampled = [got[t] for t in range(len(row.ids) - 1) if row.mask[t + 1]]
        assert sampled == pytest.approx(expected, abs=1e-5)  # the logprobs the step saw
    assert result["loss:sum"] == pytest.approx(metrics["loss"], abs=1e-6)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_gradients_add_up_until_optim_step(twin_models):
    """Two forward_backward calls on halves of the data, then one step: the step of one call on all of it."""
    whole, halves = twin_models
    data = datums_of(rows(1))
    one = TinkerSteps(Trainer(whole, pad_id=0))
    one.forward_backward(data, "importance_sampling")
    one.optim_step(1e-3)
    two = TinkerSteps(Trainer(halves, pad_id=0))
    two.forward_backward(data[:2], "importance_sampling")
    two.forward_backward(data[2:], "importance_sampling")
    two.optim_step(1e-3)
    for a, b in zip(whole.parameters(), halves.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_forward_changes_nothing(twin_models):
    model, untouched = twin_models
    steps = TinkerSteps(Trainer(model, pad_id=0))
    steps.forward_backward(datums_of(rows(2)), "importance_sampling", None, forward_only=True)
    assert all(p.grad is None for p in model.parameters())
    for a, b in zip(model.parameters(), untouched.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_target_other_than_the_next_input_is_the_token_its_logprob_is_of(twin_models):
    """(The cookbook's rl_loop puts token 0 at its prompt positions.) Each position's logprob is of its own
    target: the model's log-softmax there, next input or not."""
    model = twin_models[0]
    steps = TinkerSteps(Trainer(model, pad_id=0))
    ids, targets = [5, 6, 7, 8], [0, 7, 3, 11]
    (logprobs,), _ = steps.forward_backward(
        [TokenDatum(ids, {"target_tokens": targets, "weights": [0, 1, 1, 1]})], "cross_entropy", None, True
    )
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)  # (4, V)
    want = [float(expected[t, targets[t]]) for t in range(4)]
    assert logprobs == pytest.approx(want, abs=1e-5)


def test_bad_datums_say_what_is_wrong(twin_models):
    steps = TinkerSteps(Trainer(twin_models[0], pad_id=0))
    with pytest.raises(ValueError, match="one per model input token"):
        steps.forward_backward([TokenDatum([1, 2, 3], {"target_tokens": [2, 3]})], "cross_entropy")
    with pytest.raises(ValueError, match=r"needs loss_fn_inputs \['weights'\]"):
        steps.forward_backward([TokenDatum([1, 2, 3], {"target_tokens": [2, 3, 4]})], "cross_entropy")
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        steps.optim_step(0.0)
