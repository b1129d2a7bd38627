"""A request pinned to a step (`name@step`) never goes on with other weights: when a training step lands
while it waits or generates, it ends with an error saying so; requests that are not pinned go on."""

from __future__ import annotations

import threading

import pytest

from artrl.config import EngineConfig
from artrl.local.engine.contract import EngineError
from artrl.local.engine.hf.engine import HFEngine
from artrl.local.engine.hf.sampling import SamplingParams


@pytest.fixture
async def engine(hf_model):
    engine = HFEngine(hf_model, max_context=2048, config=EngineConfig(max_batch_size=16))
    yield engine
    await engine.close()


async def test_a_step_that_lands_mid_generation_ends_the_pinned_requests(engine):
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=1)
    pinned_params = SamplingParams(max_tokens=200, temperature=1.0, seed=2, pinned=True)
    free = engine.generate([5, 6, 7], params, 1)[0]
    pinned = engine.generate([5, 6, 8], pinned_params, 1)[0]
    first = [await anext(aiter(pinned)), await anext(aiter(free))]  # (both generating)
    assert len(first) == 2
    started, release = threading.Event(), threading.Event()

    def training_step() -> None:  # (holds the engine thread while a waiting pinned request arrives)
        started.set()
        release.wait(60)

    step = engine.call(training_step)  # changes_weights=True: a training step
    assert started.wait(60)
    waiting = engine.generate([5, 6, 9], pinned_params, 1)[0]
    release.set()
    step.result(timeout=60)
    with pytest.raises(EngineError, match="pinned to its step"):
        async for _ in pinned:
            pass
    tokens = [c async for c in free]  # (not pinned: goes on to its max_tokens)
    assert len(tokens) == 199 and free.finish_reason == "length"
    # (a pinned request that arrived while the step ran was prepared for the step before it)
    with pytest.raises(EngineError, match="pinned to its step"):
        async for _ in waiting:
            pass


async def test_a_step_that_changes_nothing_ends_nothing(engine):
    pinned = engine.generate([5, 6, 8], SamplingParams(max_tokens=30, seed=2, pinned=True), 1)[0]
    await anext(aiter(pinned))
    engine.call(lambda: None, changes_weights=False).result(timeout=60)  # (a checkpoint write)
    assert len([c async for c in pinned]) == 29 and pinned.finish_reason == "length"


def test_the_gateway_pins_a_request_that_names_the_served_step():
    from artrl.local.gateway.names import ServedNames

    names = ServedNames(["tiny"], 3)
    assert names.check("tiny") is False and names.check("tiny@3") is True
