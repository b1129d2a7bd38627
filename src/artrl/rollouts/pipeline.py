"""Asynchronous rollouts: the next steps' rollouts are gathered while the current step trains.

    async with contextlib.aclosing(artrl.rollouts_ahead(gather_step, steps=40, ahead=1)) as steps:
        async for step, groups in steps:
            await model.train(groups, config=artrl.TrainConfig(max_staleness=1))

(`contextlib.aclosing`: leaving the loop early, by `break` or an exception, then cancels the steps running
ahead at once; a bare `async for` leaves that to the generator's garbage collection.)

`gather_step(k)` is the caller's own code for step k (usually `artrl.gather_trajectory_groups` over that
step's scenarios). Step k's groups are yielded in order; meanwhile up to `ahead` later steps are being
gathered, sampled by whatever weights are served while they run: a step's rollouts may be `ahead` steps
older than the weights they train. Every choice records the step that sampled it (`policy_step`), the
trainer reports the staleness of each step and drops what `TrainConfig.max_staleness` does not allow, and
the loss's importance ratio is taken against the recorded behaviour logprobs, so older samples are weighted
for the policy that produced them (PPO/CISPO clipping, `tis_cap`).

With the vLLM engine the rollouts keep running while the trainer trains. The embedded engine pauses
generation for a training step (one copy of the weights); still, the next step's requests are queued when it
resumes (one full batch instead of a trickle) and the agents' own work (tools, rewards) overlaps the step:
the maze demo's GRPO phase took 0.85x the synchronous time on 2 CPU cores. `ahead=0` is the synchronous loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def rollouts_ahead(
    gather_step: Callable[[int], Awaitable[T]], steps: int, ahead: int = 1
) -> AsyncIterator[tuple[int, T]]:
    """(k, gather_step(k)) for k in 0..steps-1, in order, with up to `ahead` later steps gathered meanwhile
    (step k + ahead starts once the caller has trained step k - 1, so its samples are `ahead` updates old
    when they are trained).

    A failing step raises here when its turn comes (the steps gathered ahead are cancelled); closing the
    generator (`contextlib.aclosing`, see the module's docstring) cancels them too. The staleness bound holds
    when the caller trains once per step."""
    if steps < 0 or ahead < 0:
        raise ValueError(f"steps={steps} and ahead={ahead} must be >= 0")
    running: dict[int, asyncio.Task[T]] = {}

    def start(k: int) -> None:
        if k < steps:
            running[k] = asyncio.ensure_future(gather_step(k))

    try:
        for k in range(min(ahead, steps)):
            start(k)
        for k in range(steps):
            # the caller has trained step k - 1: step k + ahead starts on the weights that step made, and is
            # trained `ahead` updates later (its staleness)
            start(k + ahead)
            result = await running.pop(k)
            yield k, result
    finally:
        for task in running.values():
            task.cancel()
        if running:
            # wait for them to end, whatever their outcome; not `suppress(BaseException): await task`, which
            # also swallowed the caller's own cancellation (a step ignoring its cancel then held it forever)
            await asyncio.wait(running.values())
            for task in running.values():
                if not task.cancelled():
                    task.exception()  # retrieved: no "exception was never retrieved" warning
