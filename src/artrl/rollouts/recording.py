"""ART's current way to write a rollout: the rollout reaches the trajectory it fills with
`art.current_trajectory()` (or opens one: `with art.Trajectory() as t:`), and the caller gets it with
`traj = await art.trajectory(rollout(...))`, a group with `await art.trajectory_group(rollouts)`.

    async def rollout(model, scenario) -> None:
        t = art.current_trajectory()
        t.messages_and_choices.append({"role": "user", "content": scenario.question})
        ...
        t.reward = score(...)

    group = await art.trajectory_group(rollout(model, s) for _ in range(8))
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any

from artrl.trajectory import RECORDING, Trajectory, TrajectoryGroup


def current_trajectory() -> Trajectory:
    """The trajectory being recorded in this context (per asyncio task)."""
    recording = RECORDING.get()
    if recording is None:
        raise RuntimeError(
            "no trajectory is being recorded here: call art.current_trajectory() inside "
            "`await art.trajectory(rollout(...))`, `art.trajectory_group(...)` or `with art.Trajectory() as t:`"
        )
    return recording


async def trajectory(rollout: Awaitable[Any]) -> Trajectory:
    """Run `rollout` with a fresh trajectory being recorded: the Trajectory it returns, if it returns one,
    else the one it filled through `current_trajectory()`."""
    with Trajectory() as recorded:
        result = await rollout
    return result if isinstance(result, Trajectory) else recorded


async def trajectory_group(
    rollouts: Iterable[Awaitable[Any]], *, return_exceptions: bool = True, **data: Any
) -> TrajectoryGroup:
    """The rollouts run concurrently, each as `trajectory(rollout)`, as one group. With return_exceptions
    (the default) a rollout that raised is kept in the group's `exceptions` (ART's idiom: a few failed
    rollouts do not fail the step); without, the first exception is raised. `data`: the group's other
    fields (`metadata`)."""
    results = await asyncio.gather(*(trajectory(r) for r in rollouts), return_exceptions=return_exceptions)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result  # (cancellation, KeyboardInterrupt: never a rollout's failure)
    trajectories = [r for r in results if isinstance(r, Trajectory)]
    failed = [r for r in results if isinstance(r, BaseException)]
    return TrajectoryGroup(trajectories, exceptions=failed, **data)
