"""ART's `limit_concurrency`: at most n calls at once, per key (artrl.rollouts.concurrency)."""

from __future__ import annotations

import asyncio

import pytest

import artrl


async def test_at_most_n_calls_run_at_once_per_key():
    running: dict[str, int] = {}
    most: dict[str, int] = {}
    release = asyncio.Event()

    @artrl.limit_concurrency(2, derive_key=lambda model, scenario, **kwargs: model)
    async def rollout(model: str, scenario: int, *, note: str = "") -> tuple[str, int]:
        running[model] = running.get(model, 0) + 1
        most[model] = max(most.get(model, 0), running[model])
        await release.wait()
        running[model] -= 1
        return model, scenario

    calls = [asyncio.create_task(rollout(m, s, note="x")) for m in ("a", "b") for s in range(5)]
    for _ in range(10):  # let every call that may start, start
        await asyncio.sleep(0)
    assert running == {"a": 2, "b": 2}
    release.set()
    assert await asyncio.gather(*calls) == [(m, s) for m in ("a", "b") for s in range(5)]
    assert most == {"a": 2, "b": 2} and rollout.__name__ == "rollout"


async def test_without_a_key_every_call_shares_the_limit_and_bad_uses_are_refused():
    running, most = 0, 0

    @artrl.limit_concurrency(1)
    async def work() -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0)
        running -= 1

    await asyncio.gather(*(work() for _ in range(4)))
    assert most == 1
    with pytest.raises(ValueError, match="n >= 1"):
        artrl.limit_concurrency(0)
    with pytest.raises(TypeError, match="async functions"):
        artrl.limit_concurrency(2)(lambda: None)


def test_limits_belong_to_the_running_loop():
    @artrl.limit_concurrency(1)
    async def work() -> int:
        await asyncio.sleep(0)
        return 1

    assert asyncio.run(work()) == 1 and asyncio.run(work()) == 1  # a second asyncio.run starts afresh
