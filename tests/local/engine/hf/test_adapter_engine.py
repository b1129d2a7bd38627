"""The embedded engine serving several LoRA adapters of one model (a training server's models on one base
copy): rows of different adapters in one batch sample as each adapter alone, cached prefixes serve only
the adapter that computed them, the adapters' jobs take turns, and closing one adapter ends its requests
only."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from test_engine import greedy_by_full_forwards, requests_admitted_together

from artrl.config import EngineConfig, LoraConfig
from artrl.local.engine.hf.adapter_engine import AdapterEngine
from artrl.local.engine.hf.engine import HFEngine
from artrl.local.engine.hf.sampling import SamplingParams
from artrl.local.train.adapters import add_adapter, attach_adapter

PROMPT = list(range(40, 90))  # (longer than the prefix cache's minimum: finished rows are cached)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def two_adapters(hf_model):
    """The tiny model with adapters "one" and "two", each with random (non-zero) weights: each answers its own."""
    model = attach_adapter(copy.deepcopy(hf_model), LoraConfig(rank=4), "one")
    add_adapter(model, LoraConfig(rank=4), "two")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model.eval()


@pytest.fixture(params=["fused", "transformers"])
async def engine(two_adapters, request):
    """The engine on the fused CPU forward (base products + each adapter's factors on its rows), and on the
    transformers forward (PEFT's mixed batches)."""
    config = EngineConfig(max_batch_size=16, fused_decode=request.param == "fused")
    engine = HFEngine(two_adapters, max_context=512, config=config, adapters=True)
    yield engine
    assert (engine._fused is not None) == (request.param == "fused")  # (it did not fall back)
    await engine.close()


def alone(model, adapter: str | None, prompt: list[int]) -> list[int]:
    """Greedy tokens from full forwards with only `adapter` on (None: the base model)."""
    if adapter is None:
        with model.disable_adapter():
            return greedy_by_full_forwards(model, prompt, GREEDY.max_tokens)
    model.set_adapter(adapter)
    return greedy_by_full_forwards(model, prompt, GREEDY.max_tokens)


async def settled(engine) -> None:
    """After the engine's current step (finished rows are cached at its end)."""
    await asyncio.wrap_future(engine.call(lambda: None, changes_weights=False))


async def sample(engine, adapter, prompt=PROMPT, params=GREEDY) -> list[int]:
    (stream,) = engine.generate(prompt, params, 1, adapter=adapter)
    return [c.token_id async for c in stream]


async def test_rows_of_several_adapters_in_one_batch_sample_as_each_adapter_alone(engine, two_adapters):
    expected = {name: alone(two_adapters, name, PROMPT) for name in ("one", "two", None)}
    assert len({tuple(v) for v in expected.values()}) == 3  # (the adapters answer differently)
    with requests_admitted_together(engine):
        batch = [asyncio.ensure_future(sample(engine, name)) for name in ("one", "two", None, "one")]
        await asyncio.sleep(0)
    got = await asyncio.gather(*batch)
    assert got == [expected["one"], expected["two"], expected[None], expected["one"]]


async def test_a_cached_prefix_serves_only_the_adapter_that_computed_it(engine, two_adapters):
    """'one' alone first (its prompt and answer cached), then 'two' on a prompt that starts with all of that:
    reusing 'one's keys and values would give 'two' another answer."""
    first = await sample(engine, "one")
    await settled(engine)
    longer = [*PROMPT, *first, 7, 8]
    assert engine.prefix_cache.longest(longer, "one") is not None
    assert engine.prefix_cache.longest(longer, "two") is None
    assert await sample(engine, "two", longer) == alone(two_adapters, "two", longer)
    assert await sample(engine, "one", longer) == alone(two_adapters, "one", longer)  # (this one reuses)


async def test_an_adapters_job_drops_only_its_cached_prefixes(engine):
    await asyncio.gather(sample(engine, "one"), sample(engine, "two"))
    await settled(engine)
    assert engine.prefix_cache.longest([*PROMPT, 1], "one") and engine.prefix_cache.longest(
        [*PROMPT, 1], "two"
    )
    await asyncio.wrap_future(engine.call(lambda: None, adapter="one"))  # (a training step of 'one')
    assert engine.prefix_cache.longest([*PROMPT, 1], "one") is None
    assert engine.prefix_cache.longest([*PROMPT, 1], "two") is not None


async def test_the_adapters_jobs_take_turns(engine):
    """Three jobs of 'one' queued before one of 'two': 'two's runs second, not last."""
    ran: list[str] = []
    with requests_admitted_together(engine):
        futures = [
            engine.call(lambda n=n: ran.append(n), adapter=n[:-1]) for n in ("one1", "one2", "one3", "two1")
        ]
    await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    assert ran == ["one1", "two1", "one2", "one3"]


async def test_closing_one_adapter_ends_its_requests_and_the_others_go_on(engine, two_adapters):
    removed = []
    view = AdapterEngine(engine, "one", activate=lambda: None, remove=lambda: removed.append("one"))
    long = SamplingParams(max_tokens=200, temperature=1.0, seed=1)
    (mine,) = view.generate(PROMPT, long, 1)
    (other,) = engine.generate(PROMPT, long, 1, adapter="two")
    first = await anext(aiter(mine))
    assert first is not None
    await view.close()
    assert removed == ["one"]
    [c async for c in mine]
    assert mine.finish_reason == "abort"
    assert len([c async for c in other]) == 200 and other.finish_reason == "length"
    with pytest.raises(RuntimeError, match="closed"):
        view.generate(PROMPT, GREEDY, 1)


async def test_a_request_for_an_adapter_the_model_lacks_is_refused_alone(engine):
    with pytest.raises(ValueError, match="no adapter 'three'"):
        engine.generate(PROMPT, GREEDY, 1, adapter="three")
    assert len(await sample(engine, "one")) == GREEDY.max_tokens  # (the batch never saw the bad request)


async def test_an_adapters_new_weights_serve_its_rows_from_its_next_step(engine, two_adapters):
    """A job of 'one' changes its weights (as its training step does): its rows sample the new weights, the
    fused forward's factors of 'two' stay as they were."""
    before = {name: await sample(engine, name) for name in ("one", "two")}

    def flip() -> None:
        with torch.no_grad():
            for name, p in two_adapters.named_parameters():
                if "lora_B.one" in name:
                    p.neg_()

    await asyncio.wrap_future(engine.call(flip, adapter="one"))
    try:
        after = {name: await sample(engine, name) for name in ("one", "two")}
        assert after["one"] == alone(two_adapters, "one", PROMPT) != before["one"]
        assert after["two"] == before["two"]
    finally:
        await asyncio.wrap_future(engine.call(flip, adapter="one"))
