"""Running rollouts concurrently: groups of trajectories behind a live progress bar, with an exception budget.

A *group* is given as an iterable of awaitables (coroutines, tasks), one per rollout, each resolving to an
`artrl.Trajectory` (bare, or as ART writes it: `artrl.TrajectoryGroup(rollout(...) for _ in range(8))`,
which keeps the group's `metadata`); a group may also be given as one awaitable resolving to a whole
`artrl.TrajectoryGroup`. Every rollout of every group runs at once (or at most `max_concurrency` at a time). A rollout that raises an
`Exception` is recorded on its group (`TrajectoryGroup.exceptions`, as ``"Type: message"``) and left out of
it; the others go on until more rollouts have failed than `max_exceptions` allows, at which point everything
still running is cancelled (and awaited) and `GatherError` is raised.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any, TypeAlias

from artrl.trajectory import PendingGroup, Trajectory, TrajectoryGroup

GroupSpec: TypeAlias = Iterable[Awaitable[Trajectory]] | PendingGroup | Awaitable[TrajectoryGroup]
"""One group: its rollouts (awaitables of `Trajectory`, or `TrajectoryGroup(awaitables)` as ART writes it),
or one awaitable of a whole `TrajectoryGroup`."""

AfterEach: TypeAlias = Callable[[TrajectoryGroup], TrajectoryGroup | Awaitable[TrajectoryGroup | None] | None]
"""Called with each group as it completes; returns the group to keep (the same or a replacement) or None."""


class GatherError(RuntimeError):
    """More rollouts failed than `max_exceptions` allows. Chained (``from``) to the first failure."""

    def __init__(self, message: str, *, failures: int, total: int, max_exceptions: float) -> None:
        super().__init__(message)
        self.failures = failures
        self.total = total
        self.max_exceptions = max_exceptions


def format_exception(exc: BaseException) -> str:
    """How a failed rollout is recorded on its group: ``"ValueError: message"``."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def sampled_tokens(trajectory: Trajectory) -> int:
    """Tokens the model sampled in a trajectory (the `token_ids` the gateway attaches to each Choice)."""
    return sum(len(getattr(choice, "token_ids", None) or []) for choice in trajectory.choices())


def allowed_failures(max_exceptions: int | float, total: int) -> float:
    """The most failures tolerated: `max_exceptions` itself, or that fraction of `total` when it is in (0, 1)."""
    if isinstance(max_exceptions, bool) or not isinstance(max_exceptions, int | float):
        raise TypeError(f"max_exceptions must be an int or a float, not {type(max_exceptions).__name__}")
    if math.isnan(max_exceptions) or max_exceptions < 0:
        raise ValueError(f"max_exceptions must be >= 0 (a count, or a fraction if < 1), got {max_exceptions}")
    if isinstance(max_exceptions, float) and 0 < max_exceptions < 1:
        return max_exceptions * total
    return float(max_exceptions)


@dataclass
class _Slot:
    """One input group while it runs."""

    rollouts: list[Awaitable[Any]] | None  # None: the group is one awaitable of a TrajectoryGroup
    whole: Awaitable[Any] | None = None
    trajectories: list[Trajectory | None] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    remaining: int = 0
    result: TrajectoryGroup | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # the group's, given to TrajectoryGroup(...)
    group_class: type[TrajectoryGroup] = TrajectoryGroup  # (a subclass, when one was given awaitables)


def _close_unstarted(slots: list[_Slot]) -> None:
    """Close the coroutines that never started (bad input, or cancelled while queued), so that Python does
    not warn that they were never awaited."""
    for slot in slots:
        for aw in slot.rollouts if slot.rollouts is not None else [slot.whole]:
            if inspect.iscoroutine(aw) and inspect.getcoroutinestate(aw) == inspect.CORO_CREATED:
                aw.close()


def _prepare(groups: Iterable[GroupSpec]) -> list[_Slot]:
    slots: list[_Slot] = []
    try:
        for index, spec in enumerate(groups):
            if isinstance(spec, PendingGroup):  # TrajectoryGroup(awaitables): its rollouts run one by one
                rollouts = spec.take()
                slots.append(
                    _Slot(
                        rollouts=rollouts,
                        trajectories=[None] * len(rollouts),
                        remaining=len(rollouts),
                        exceptions=list(spec.exceptions),
                        metadata=dict(spec.metadata),
                        group_class=spec.group_class,
                    )
                )
                continue
            if inspect.isawaitable(spec):
                slots.append(_Slot(rollouts=None, whole=spec, remaining=1))
                continue
            if isinstance(spec, str | bytes) or not isinstance(spec, Iterable):
                raise TypeError(
                    f"group {index} must be an iterable of rollout awaitables (each returning an "
                    f"artrl.Trajectory) or an awaitable returning an artrl.TrajectoryGroup, "
                    f"got {type(spec).__name__}"
                )
            rollouts = list(spec)
            slot = _Slot(rollouts=rollouts, trajectories=[None] * len(rollouts), remaining=len(rollouts))
            slots.append(slot)
            for j, aw in enumerate(rollouts):
                if not inspect.isawaitable(aw):
                    raise TypeError(
                        f"group {index}, rollout {j} is a {type(aw).__name__}, not an awaitable: pass "
                        f"the coroutine (rollout(...)), not its result"
                    )
    except BaseException:
        _close_unstarted(slots)
        raise
    return slots


class _Gathering:
    """The shared state of one `gather_trajectory_groups` call."""

    def __init__(
        self,
        slots: list[_Slot],
        *,
        max_exceptions: int | float,
        after_each: AfterEach | None,
        pbar: Any,
        max_concurrency: int | None,
    ) -> None:
        self.slots = slots
        self.total = sum(len(s.rollouts) if s.rollouts is not None else 1 for s in slots)
        self.max_exceptions = max_exceptions
        self.allowed = allowed_failures(max_exceptions, self.total)
        self.after_each = after_each
        self.pbar = pbar
        self.semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self.failures = 0
        self.first_exception: BaseException | None = None
        self.reward_sum = 0.0
        self.finished_trajectories = 0
        self.tokens = 0

    async def _await(self, aw: Awaitable[Any]) -> Any:
        if self.semaphore is None:
            return await aw
        async with self.semaphore:
            return await aw

    def _fail(self, index: int, exc: Exception) -> None:
        self.failures += 1
        if self.first_exception is None:
            self.first_exception = exc
        self.slots[index].exceptions.append(format_exception(exc))
        self._tick()
        if self.failures > self.allowed:
            budget = (
                f"max_exceptions={self.max_exceptions} ({self.allowed:g} of {self.total})"
                if self.allowed != self.max_exceptions
                else f"max_exceptions={self.max_exceptions}"
            )
            raise GatherError(
                f"{self.failures} of {self.total} rollouts failed, more than {budget} allows; "
                f"the rest were cancelled. First failure: {format_exception(self.first_exception)}",
                failures=self.failures,
                total=self.total,
                max_exceptions=self.max_exceptions,
            ) from self.first_exception

    def _count(self, trajectory: Trajectory) -> None:
        self.reward_sum += trajectory.reward
        self.finished_trajectories += 1
        self.tokens += sampled_tokens(trajectory)

    def _tick(self) -> None:
        if self.pbar is None:
            return
        mean = self.reward_sum / self.finished_trajectories if self.finished_trajectories else float("nan")
        self.pbar.set_postfix(
            {"reward": f"{mean:.3f}", "exceptions": self.failures, "tokens": self.tokens}, refresh=False
        )
        self.pbar.update(1)

    async def run_rollout(self, index: int, position: int, aw: Awaitable[Any]) -> None:
        slot = self.slots[index]
        try:
            value = await self._await(aw)
        except Exception as exc:
            self._fail(index, exc)
        else:
            if not isinstance(value, Trajectory):
                raise TypeError(
                    f"group {index}, rollout {position} returned a {type(value).__name__}, "
                    f"not an artrl.Trajectory"
                )
            slot.trajectories[position] = value
            self._count(value)
            self._tick()
        slot.remaining -= 1
        if slot.remaining == 0:
            await self.finish(index)

    async def run_whole(self, index: int, aw: Awaitable[Any]) -> None:
        slot = self.slots[index]
        try:
            value = await self._await(aw)
        except Exception as exc:
            self._fail(index, exc)
            slot.result = TrajectoryGroup([], exceptions=list(slot.exceptions))
        else:
            if not isinstance(value, TrajectoryGroup):
                raise TypeError(
                    f"group {index} (one awaitable) returned a {type(value).__name__}, "
                    f"not an artrl.TrajectoryGroup"
                )
            for trajectory in value.trajectories:
                self._count(trajectory)
            slot.result = value
            self._tick()
        await self.finish(index)

    async def finish(self, index: int) -> None:
        slot = self.slots[index]
        if slot.result is None:
            slot.result = slot.group_class(
                [t for t in slot.trajectories if t is not None],
                exceptions=list(slot.exceptions),
                metadata=slot.metadata,
            )
        if self.after_each is None:
            return
        replaced = self.after_each(slot.result)
        if inspect.isawaitable(replaced):
            replaced = await replaced
        if replaced is not None and not isinstance(replaced, TrajectoryGroup):
            raise TypeError(
                f"after_each returned a {type(replaced).__name__} for group {index}: "
                f"return an artrl.TrajectoryGroup, or None to drop the group"
            )
        slot.result = replaced


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_leaf(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]


async def gather_trajectory_groups(
    groups: Iterable[GroupSpec],
    *,
    pbar_desc: str = "gather",
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
    max_concurrency: int | None = None,
    pbar: bool = True,
    pbar_file: IO[str] | None = None,
) -> list[TrajectoryGroup]:
    """Run every rollout of every group concurrently and return the groups, in input order.

    Args:
        groups: each group is an iterable of awaitables (one per rollout) resolving to `artrl.Trajectory`,
            e.g. ``(rollout(model, scenario) for _ in range(8))``; or one awaitable resolving to a whole
            `artrl.TrajectoryGroup` (it counts as one rollout for the bar and the budget).
        pbar_desc: the progress bar's label. The bar counts finished rollouts out of all of them and shows
            the running mean reward, the number of exceptions and the tokens sampled so far.
        max_exceptions: how many rollouts may fail before the whole gather fails: a count, or a fraction of
            all rollouts when it is a float strictly between 0 and 1. The default 0 tolerates none: the
            first failure cancels the rest. Use ``math.inf`` to never fail. Failures within the budget are
            recorded on their group's `exceptions` (``"Type: message"``) and their trajectory is omitted.
        after_each: called (sync or async) with each group as soon as all its rollouts are done; it returns
            the group to keep (the same one or a replacement), or None to drop the group from the result.
        max_concurrency: at most this many rollouts run at a time (None: all at once).
        pbar: False hides the progress bar.
        pbar_file: where the bar is written (default: stderr).

    Returns:
        The groups in input order, without those `after_each` dropped.

    Raises:
        GatherError: more rollouts failed than `max_exceptions` allows; everything still running has been
            cancelled and awaited. It is chained to the first failure.
        TypeError: a rollout returned something other than a `Trajectory` (the message names the group), or
            a group is not given in one of the two accepted forms. Errors raised by `after_each` propagate
            as they are. In every case the other rollouts are cancelled first.
    """
    slots = _prepare(groups)
    try:
        total = sum(len(s.rollouts) if s.rollouts is not None else 1 for s in slots)
        allowed_failures(max_exceptions, total)  # validate before anything starts
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    except BaseException:
        _close_unstarted(slots)
        raise

    from tqdm import tqdm

    bar = tqdm(total=total, desc=pbar_desc, file=pbar_file, disable=not pbar)
    state = _Gathering(
        slots,
        max_exceptions=max_exceptions,
        after_each=after_each,
        pbar=bar,
        max_concurrency=max_concurrency,
    )
    error: BaseException | None = None
    try:
        # A TaskGroup: when one task raises (budget exceeded, wrong type, after_each failed), it cancels
        # all the others and waits for them before raising.
        async with asyncio.TaskGroup() as task_group:
            for index, slot in enumerate(slots):
                if slot.rollouts is None:
                    task_group.create_task(state.run_whole(index, slot.whole))  # type: ignore[arg-type]
                elif not slot.rollouts:
                    task_group.create_task(state.finish(index))
                for position, aw in enumerate(slot.rollouts or []):
                    task_group.create_task(state.run_rollout(index, position, aw))
    except BaseExceptionGroup as group:
        error = _first_leaf(group)
    finally:
        bar.close()
        _close_unstarted(slots)
    if error is not None:
        raise error  # outside the except block: keeps its own cause and context
    return [slot.result for slot in slots if slot.result is not None]


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory]],
    *,
    pbar_desc: str = "gather",
    max_exceptions: int | float = 0,
    max_concurrency: int | None = None,
    pbar: bool = True,
    pbar_file: IO[str] | None = None,
) -> list[Trajectory]:
    """Run rollouts concurrently and return their trajectories in input order (a flat list, no groups).

    The same progress bar and exception budget as `gather_trajectory_groups`; failed rollouts (within the
    budget) are left out of the returned list.
    """
    groups = await gather_trajectory_groups(
        [trajectories],
        pbar_desc=pbar_desc,
        max_exceptions=max_exceptions,
        max_concurrency=max_concurrency,
        pbar=pbar,
        pbar_file=pbar_file,
    )
    return groups[0].trajectories
