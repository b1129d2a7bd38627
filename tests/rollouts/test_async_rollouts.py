"""Asynchronous rollouts (issue 17): `artrl.rollouts_ahead` gathers later steps while one trains, every
choice records the policy step that sampled it, and training reports staleness and drops what
`TrainConfig.max_staleness` does not allow."""

from __future__ import annotations

import asyncio

import pytest
from scored_rollouts import PROMPT

import artrl
import artrl.storage


async def test_steps_come_in_order_with_ahead_steps_running_meanwhile():
    started: list[int] = []
    events: list[str] = []

    async def body(k: int) -> str:
        await asyncio.sleep(0.01 * (3 - k % 3))  # later steps may finish first: order is kept anyway
        return f"groups {k}"

    def gather(k: int):
        started.append(k)  # when the step is started (its coroutine created and scheduled)
        return body(k)

    async for k, groups in artrl.rollouts_ahead(gather, steps=5, ahead=2):
        assert groups == f"groups {k}"
        events.append(f"train {k}")
        # while step k trains, steps up to k + ahead have started, and none beyond
        assert max(started) == min(k + 2, 4)
        await asyncio.sleep(0.05)
    assert started == [0, 1, 2, 3, 4] and events == [f"train {k}" for k in range(5)]


async def test_ahead_zero_is_the_synchronous_loop():
    running = 0
    peak = 0

    async def gather(k: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return k

    assert [k async for k, _ in artrl.rollouts_ahead(gather, steps=4, ahead=0)] == [0, 1, 2, 3]
    assert peak == 1


async def test_a_failing_step_raises_in_turn_and_leaving_early_cancels_the_rest():
    cancelled: list[int] = []

    async def gather(k: int) -> int:
        try:
            if k == 1:
                raise RuntimeError("rollouts of step 1 failed")
            await asyncio.sleep(10)
            return k
        except asyncio.CancelledError:
            cancelled.append(k)
            raise

    async def quick(k: int) -> int:
        return k if k == 0 else await gather(k)

    seen = []
    with pytest.raises(RuntimeError, match="step 1 failed"):
        async for k, _ in artrl.rollouts_ahead(quick, steps=4, ahead=2):
            seen.append(k)
    assert seen == [0] and cancelled == [2]  # step 2 was running ahead; step 3 never started
    with pytest.raises(ValueError):
        async for _ in artrl.rollouts_ahead(quick, steps=-1):
            pass


async def test_closing_the_steps_cancels_what_runs_ahead_at_once():
    import contextlib

    cancelled: list[int] = []

    async def gather(k: int) -> int:
        try:
            await asyncio.sleep(0 if k == 0 else 10)
            return k
        except asyncio.CancelledError:
            cancelled.append(k)
            raise

    async with contextlib.aclosing(artrl.rollouts_ahead(gather, steps=5, ahead=2)) as steps:
        async for _step in steps:
            break  # (a training step that raised, say)
    assert sorted(cancelled) == [1, 2]  # both steps running ahead, cancelled as the block closed


async def test_the_callers_cancellation_is_not_swallowed_by_a_step_that_ignores_its_cancel():
    """Closing the steps waits for the ones running ahead to end; a step whose cleanup ignores its cancel keeps
    it waiting, and cancelling the caller then ends the wait at once with CancelledError (before: the wait
    swallowed every exception, the caller's own cancellation too, and the caller carried on)."""
    import contextlib

    ignoring, release = asyncio.Event(), asyncio.Event()
    stubborn: list[asyncio.Task] = []

    async def gather(k: int) -> int:
        if k == 0:
            return k
        stubborn.append(asyncio.current_task())
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            ignoring.set()  # a cleanup that takes its time: the first cancel is ignored
        await release.wait()
        return k

    async def caller() -> str:
        async with contextlib.aclosing(artrl.rollouts_ahead(gather, steps=3, ahead=1)) as steps:
            async for _step in steps:
                break  # closing cancels step 1, which ignores it: the close waits for it
        return "carried on"

    task = asyncio.create_task(caller())
    try:
        await asyncio.wait_for(ignoring.wait(), timeout=10)
        await asyncio.sleep(0.05)  # the caller waits on step 1 now
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        assert done, "the cancelled caller is still waiting"
        with pytest.raises(asyncio.CancelledError):
            task.result()
    finally:
        release.set()
        await asyncio.wait({task, *stubborn}, timeout=5)


async def _group(model, seed: int, n: int = 2) -> artrl.TrajectoryGroup:
    client = model.openai_client()
    trajectories = []
    for j in range(n):
        out = await client.chat.completions.create(
            model=model.name, messages=PROMPT, max_tokens=4, seed=seed + j, temperature=1.0
        )
        trajectories.append(artrl.Trajectory(messages_and_choices=[*PROMPT, out.choices[0]], reward=float(j)))
    return artrl.TrajectoryGroup(trajectories)


async def test_choices_record_their_policy_step_and_training_drops_stale_ones(fresh_model):
    model = fresh_model
    old = await _group(model, 1)  # sampled by step 0
    assert [c.model_extra["policy_step"] for t in old for c in t.choices()] == [0, 0]
    first = await model.train([await _group(model, 11)], artrl.TrainConfig(learning_rate=1e-3))
    assert first.metrics["staleness_mean"] == 0 and first.metrics["trajectories_dropped_stale"] == 0
    fresh = await _group(model, 21)  # sampled by step 1
    assert {c.model_extra["policy_step"] for t in fresh for c in t.choices()} == {1}

    # at step 1, `old` is one update old: kept with max_staleness=1 ...
    kept = await model.train([old, fresh], artrl.TrainConfig(learning_rate=1e-3, max_staleness=1))
    assert kept.metrics["staleness_mean"] == 0.5 and kept.metrics["staleness_max"] == 1
    assert kept.metrics["trajectories_dropped_stale"] == 0 and kept.metrics["rows"] == 4
    # ... and at step 2 two updates old: dropped with max_staleness=1 (its group no longer counts), while
    # `fresh` is one update old and trains
    dropped = await model.train([old, fresh], artrl.TrainConfig(learning_rate=1e-3, max_staleness=1))
    assert dropped.metrics["trajectories_dropped_stale"] == 2 and dropped.metrics["staleness_max"] == 2
    assert dropped.metrics["rows"] == 2 and dropped.metrics["groups_skipped_too_small"] == 1
    # every trajectory is still in the step's record, the dropped ones included
    # a bad reward is refused even on a trajectory the call would drop as stale
    bad = old.model_copy(
        update={
            "trajectories": [
                old.trajectories[0].model_copy(update={"reward": float("nan")}),
                old.trajectories[1],
            ]
        }
    )
    with pytest.raises(ValueError, match="rewards must be finite"):
        await model.train([bad, fresh], artrl.TrainConfig(max_staleness=0))
    history = artrl.storage.read_history(model._backend.directory(model))
    assert [h["staleness_max"] for h in history if h["split"] == "train"] == [0, 1, 2]
