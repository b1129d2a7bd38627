"""The embedded engine's batch sampler: right distribution, per-row seeds, top-p and top logprobs per row."""

from __future__ import annotations

import random

import pytest
import torch

from artrl.local.engine.hf.sampling import SamplingError, SamplingParams, sample_rows, top_p_filter, uniforms

LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0]))  # (V,) one impossible token


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Unseeded rows draw from torch's global RNG, whose state depends on which tests ran before: each test
    here starts it from one seed (the frequencies below come from the same draws in any test order), and
    the state is put back afterwards for the tests that follow."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


def _params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=1, **kwargs)


def test_frequencies_follow_the_distribution_and_never_an_impossible_token():
    rows = 4000
    logits = LOGITS.expand(rows, -1)  # (B, V)
    choices = sample_rows(logits, [_params()] * rows, [None] * rows)
    counts = torch.bincount(torch.tensor([c.token_id for c in choices]), minlength=5).float() / rows
    assert counts[4] == 0
    assert torch.allclose(counts[:4], torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    assert all(abs(c.logprob - float(LOGITS[c.token_id])) < 1e-5 for c in choices)


def test_temperature_sharpens_and_zero_is_greedy():
    rows = 2000
    logits = LOGITS.expand(rows, -1)
    cold = sample_rows(logits, [_params(temperature=0.25)] * rows, [None] * rows)
    share = sum(c.token_id == 0 for c in cold) / rows  # 0.5^4 / (0.5^4 + 0.3^4 + ...) ~ 0.88
    assert 0.83 < share < 0.93
    greedy = sample_rows(logits[:3], [_params(temperature=0.0)] * 3, [None] * 3)
    assert [c.token_id for c in greedy] == [0, 0, 0]


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))  # (B, V)
    alone = [
        sample_rows(logits[i : i + 1], [_params()], [random.Random(7 + i)])[0].token_id for i in range(6)
    ]
    together = sample_rows(logits, [_params()] * 6, [random.Random(7 + i) for i in range(6)])
    assert [c.token_id for c in together] == alone
    shuffled = sample_rows(
        logits.flip(0), [_params()] * 6, [random.Random(7 + i) for i in reversed(range(6))]
    )
    assert [c.token_id for c in shuffled][::-1] == alone


def test_top_p_applies_per_row_and_top_logprobs_per_row():
    rows = 1000
    logits = LOGITS.expand(rows, -1)
    params = [_params(top_p=0.7, top_logprobs=2) if i % 2 else _params() for i in range(rows)]
    choices = sample_rows(logits, params, [None] * rows)
    assert {c.token_id for c in choices[1::2]} == {0, 1}  # top-p 0.7 keeps the two likeliest
    assert len({c.token_id for c in choices[0::2]}) == 4
    assert [t for t, _ in choices[1].top_logprobs] == [0, 1] and choices[0].top_logprobs == ()
    assert abs(choices[1].top_logprobs[1][1] - float(LOGITS[1])) < 1e-5  # raw logprobs, before top-p


def test_rows_that_cannot_be_sampled_fail_alone():
    logits = torch.stack([LOGITS, torch.full((5,), float("nan")), torch.full((5,), float("-inf")), LOGITS])
    choices = sample_rows(logits, [_params()] * 4, [None] * 4)
    assert not isinstance(choices[0], SamplingError) and not isinstance(choices[3], SamplingError)
    assert isinstance(choices[1], SamplingError) and isinstance(choices[2], SamplingError)
    assert "no finite logit" in str(choices[2])


def test_top_p_filter_takes_a_threshold_per_row():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2)
    out = top_p_filter(probs, torch.tensor([0.7, 1.0]))
    assert torch.allclose(out, torch.tensor([[0.625, 0.375, 0.0, 0.0], [0.5, 0.3, 0.15, 0.05]]))


def test_seeded_draws_are_uniform_and_below_one():
    rows = [random.Random(seed) for seed in range(4000)]
    u = uniforms(rows, torch.device("cpu"))  # (B,) one draw per row
    assert u.dtype == torch.float32 and bool((u >= 0).all()) and bool((u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.02 and abs(float((u < 0.25).float().mean()) - 0.25) < 0.03
    again = uniforms([random.Random(seed) for seed in range(4000)], torch.device("cpu"))
    assert torch.equal(u, again)  # (a seed gives its row the same draw)
    mixed = uniforms([None, random.Random(3), None], torch.device("cpu"))  # (unseeded rows: torch's RNG)
    assert mixed[1] == u[3] and bool((mixed < 1).all())


def test_the_compiled_choice_is_in_use_and_equals_the_eager_one():
    from artrl.local.engine.hf import sampling

    compiled = sampling._scripted_choose()
    assert isinstance(compiled, torch.jit.ScriptFunction)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(4))  # (B, V)
    logits[4] = float("nan")  # a row without a valid distribution
    settings = torch.tensor([[1.0, 1.0], [0.7, 0.9], [0.0, 1.0], [1.3, 0.5], [1.0, 1.0], [1e-6, 0.3]])
    u = torch.rand(6, generator=torch.Generator().manual_seed(5))
    rows, logprobs = compiled(logits, settings, u, 1e-5)
    want_rows, want_logprobs = sampling.choose(logits, settings, u, 1e-5)
    assert torch.equal(rows.nan_to_num(), want_rows.nan_to_num())
    assert torch.equal(logprobs.nan_to_num(), want_logprobs.nan_to_num())
    assert rows[3].tolist() == [1, 1, 1, 1, 0, 1]  # (valid: only the NaN row is not)
