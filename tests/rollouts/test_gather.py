"""Gathering rollouts (concurrency, exception budget, after_each, progress bar), retry, iterate_dataset.

Fakes, not mocks: rollouts are plain async functions that sleep, return a Trajectory or raise.
"""

from __future__ import annotations

import asyncio
import gc
import io
import math
from pathlib import Path

import pytest
from openai.types.chat.chat_completion import Choice

import artrl
import artrl.rollouts.gather
from artrl import Trajectory, TrajectoryGroup
from artrl.rollouts.retry import backoff_delay


async def rollout(reward: float, delay: float = 0.0) -> Trajectory:
    await asyncio.sleep(delay)
    return Trajectory(reward=reward)


async def failing(message: str = "boom", delay: float = 0.0) -> Trajectory:
    await asyncio.sleep(delay)
    raise ValueError(message)


class Sleeper:
    """A rollout that would take long; records whether it was cancelled."""

    def __init__(self) -> None:
        self.started = False
        self.cancelled = False

    async def __call__(self) -> Trajectory:
        self.started = True
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return Trajectory(reward=1.0)


def _started_here(task: asyncio.Task) -> bool:
    code = getattr(task.get_coro(), "cr_code", None)
    return code is not None and Path(code.co_filename).resolve() in {
        Path(__file__).resolve(),
        Path(artrl.rollouts.gather.__file__).resolve(),
    }


def other_tasks() -> set[asyncio.Task]:
    """Unfinished tasks of gather or of this file's rollouts. Tasks of other tests' leftovers (e.g. an httpx
    client that `gc.collect()` closes) share the session's loop and are not ours to judge."""
    return {
        t
        for t in asyncio.all_tasks()
        if t is not asyncio.current_task() and not t.done() and _started_here(t)
    }


def choice_with_tokens(n: int) -> Choice:
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "ok"},
            "token_ids": list(range(n)),
        }
    )


# --- gather_trajectory_groups ---------------------------------------------------------------------------


async def test_groups_keep_input_order_and_run_concurrently() -> None:
    # Later rollouts finish first: the order must come from the input, not from completion.
    running, most = 0, 0

    async def counted(reward: float, delay: float) -> Trajectory:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            return await rollout(reward, delay)
        finally:
            running -= 1

    groups = [[counted(10 * g + j, delay=0.05 - 0.01 * j) for j in range(4)] for g in range(5)]
    result = await artrl.gather_trajectory_groups(groups, pbar=False)
    assert [[t.reward for t in group] for group in result] == [
        [10 * g + j for j in range(4)] for g in range(5)
    ]
    assert all(isinstance(group, TrajectoryGroup) and group.exceptions == [] for group in result)
    assert most == 20  # every rollout was running at once (an event count, not a wall-clock bound)


async def test_groups_accept_generators_and_whole_group_awaitables() -> None:
    async def whole_group() -> TrajectoryGroup:
        return TrajectoryGroup([Trajectory(reward=7.0), Trajectory(reward=8.0)])

    result = await artrl.gather_trajectory_groups(
        [(rollout(r) for r in (1.0, 2.0)), whole_group(), []], pbar=False
    )
    assert [[t.reward for t in g] for g in result] == [[1.0, 2.0], [7.0, 8.0], []]


async def test_max_concurrency_limits_rollouts_in_flight() -> None:
    running = peak = 0

    async def counted() -> Trajectory:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return Trajectory(reward=1.0)

    result = await artrl.gather_trajectory_groups(
        [[counted() for _ in range(4)] for _ in range(3)], max_concurrency=2, pbar=False
    )
    assert peak == 2
    assert sum(len(g) for g in result) == 12


async def test_exception_within_budget_is_recorded_on_its_group() -> None:
    groups = [
        [rollout(1.0), failing("bad tool call"), rollout(3.0)],
        [rollout(4.0, delay=0.02), rollout(5.0)],
    ]
    result = await artrl.gather_trajectory_groups(groups, max_exceptions=1, pbar=False)
    assert [t.reward for t in result[0]] == [1.0, 3.0]
    assert result[0].exceptions == ["ValueError: bad tool call"]
    assert [t.reward for t in result[1]] == [4.0, 5.0]
    assert result[1].exceptions == []


async def test_budget_exceeded_cancels_the_rest_and_says_why() -> None:
    sleepers = [Sleeper() for _ in range(3)]
    groups = [[failing("first", delay=0.01), sleepers[0]()], [sleepers[1](), sleepers[2]()]]
    with pytest.raises(artrl.GatherError) as info:
        await artrl.gather_trajectory_groups(groups, pbar=False)  # default budget: 0
    message = str(info.value)
    assert "1 of 4 rollouts failed" in message
    assert "max_exceptions=0" in message
    assert "ValueError: first" in message
    assert isinstance(info.value.__cause__, ValueError)
    assert (info.value.failures, info.value.total) == (1, 4)
    assert all(s.started and s.cancelled for s in sleepers)
    assert other_tasks() == set()


async def test_budget_error_is_chained_to_the_first_failure() -> None:
    groups = [[failing("one", delay=0.0), failing("two", delay=0.01), Sleeper()()]]
    with pytest.raises(artrl.GatherError, match="2 of 3 rollouts failed") as info:
        await artrl.gather_trajectory_groups(groups, max_exceptions=1, pbar=False)
    assert str(info.value.__cause__) == "one"
    assert "First failure: ValueError: one" in str(info.value)


async def test_fractional_budget() -> None:
    ok = [[failing() for _ in range(2)] + [rollout(1.0) for _ in range(8)]]
    result = await artrl.gather_trajectory_groups(ok, max_exceptions=0.25, pbar=False)
    assert len(result[0]) == 8 and len(result[0].exceptions) == 2

    too_many = [[failing() for _ in range(3)] + [rollout(1.0, delay=0.01) for _ in range(7)]]
    with pytest.raises(artrl.GatherError, match=r"max_exceptions=0\.25 \(2\.5 of 10\)"):
        await artrl.gather_trajectory_groups(too_many, max_exceptions=0.25, pbar=False)

    never = [[failing() for _ in range(3)]]
    result = await artrl.gather_trajectory_groups(never, max_exceptions=math.inf, pbar=False)
    assert result[0].trajectories == [] and len(result[0].exceptions) == 3


async def test_failed_whole_group_awaitable_is_an_empty_group_with_its_exception() -> None:
    async def broken() -> TrajectoryGroup:
        raise RuntimeError("judge down")

    result = await artrl.gather_trajectory_groups([broken(), [rollout(1.0)]], max_exceptions=1, pbar=False)
    assert result[0].trajectories == [] and result[0].exceptions == ["RuntimeError: judge down"]
    assert [t.reward for t in result[1]] == [1.0]


async def test_coroutines_that_never_started_are_closed(recwarn: pytest.WarningsRecorder) -> None:
    # With max_concurrency=1 the queued rollouts never start: no "coroutine was never awaited" warning.
    groups = [[failing()] + [rollout(1.0) for _ in range(5)]]
    raised = False
    try:
        await artrl.gather_trajectory_groups(groups, max_concurrency=1, pbar=False)
    except artrl.GatherError:  # not pytest.raises: its ExceptionInfo would keep the coroutines alive
        raised = True
    del groups
    gc.collect()
    assert raised
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert other_tasks() == set()


async def test_non_trajectory_result_is_a_type_error_naming_the_group() -> None:
    async def wrong() -> str:
        return "not a trajectory"

    sleeper = Sleeper()
    with pytest.raises(TypeError, match=r"group 1, rollout 0 returned a str, not an artrl.Trajectory"):
        await artrl.gather_trajectory_groups([[sleeper()], [wrong()]], max_exceptions=10, pbar=False)
    assert sleeper.cancelled


async def test_bad_inputs_are_rejected_before_anything_runs(recwarn: pytest.WarningsRecorder) -> None:
    with pytest.raises(TypeError, match="group 1 must be an iterable of rollout awaitables"):
        await artrl.gather_trajectory_groups([[rollout(1.0)], 42], pbar=False)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="group 0, rollout 1 is a Trajectory, not an awaitable"):
        await artrl.gather_trajectory_groups([[rollout(1.0), Trajectory()]], pbar=False)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max_exceptions must be >= 0"):
        await artrl.gather_trajectory_groups([[rollout(1.0)]], max_exceptions=-1, pbar=False)
    with pytest.raises(ValueError, match="max_concurrency"):
        await artrl.gather_trajectory_groups([[rollout(1.0)]], max_concurrency=0, pbar=False)
    gc.collect()
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("is_async", [False, True])
async def test_after_each_replaces_or_drops_groups(is_async: bool) -> None:
    seen: list[list[float]] = []

    def judge(group: TrajectoryGroup) -> TrajectoryGroup | None:
        rewards = [t.reward for t in group]
        seen.append(rewards)
        if len(set(rewards)) == 1:
            return None  # no signal for GRPO: drop it
        return TrajectoryGroup([t.model_copy(update={"reward": t.reward * 10}) for t in group])

    async def async_judge(group: TrajectoryGroup) -> TrajectoryGroup | None:
        await asyncio.sleep(0)
        return judge(group)

    groups = [[rollout(1.0), rollout(2.0)], [rollout(3.0), rollout(3.0)], [rollout(0.0), rollout(0.5)]]
    result = await artrl.gather_trajectory_groups(
        groups, after_each=async_judge if is_async else judge, pbar=False
    )
    assert [[t.reward for t in g] for g in result] == [[10.0, 20.0], [0.0, 5.0]]
    assert sorted(seen) == [[0.0, 0.5], [1.0, 2.0], [3.0, 3.0]]


async def test_after_each_runs_as_each_group_completes() -> None:
    order: list[float] = []
    groups = [[rollout(1.0, delay=0.05)], [rollout(2.0, delay=0.0)]]
    await artrl.gather_trajectory_groups(
        groups, after_each=lambda g: order.append(g.trajectories[0].reward) or g, pbar=False
    )
    assert order == [2.0, 1.0]


async def test_after_each_errors_propagate() -> None:
    def bad(group: TrajectoryGroup) -> TrajectoryGroup:
        raise KeyError("judge")

    with pytest.raises(KeyError, match="judge"):
        await artrl.gather_trajectory_groups([[rollout(1.0)]], after_each=bad, pbar=False)
    with pytest.raises(TypeError, match="after_each returned a list for group 0"):
        await artrl.gather_trajectory_groups([[rollout(1.0)]], after_each=lambda g: [], pbar=False)


async def test_progress_bar_shows_done_total_reward_exceptions_tokens() -> None:
    async def talking(reward: float) -> Trajectory:
        return Trajectory(
            messages_and_choices=[{"role": "user", "content": "hi"}, choice_with_tokens(3)], reward=reward
        )

    stream = io.StringIO()
    groups = [[talking(1.0), talking(0.0)], [failing(), talking(0.5)]]
    await artrl.gather_trajectory_groups(groups, pbar_desc="val", max_exceptions=1, pbar_file=stream)
    final = stream.getvalue().split("\r")[-1]
    assert final.startswith("val")
    assert "4/4" in final
    assert "reward=0.500" in final
    assert "exceptions=1" in final
    assert "tokens=9" in final


async def test_progress_bar_can_be_disabled(capsys: pytest.CaptureFixture[str]) -> None:
    await artrl.gather_trajectory_groups([[rollout(1.0)]], pbar=False)
    assert capsys.readouterr().err == ""


async def test_cancelling_the_gather_cancels_its_rollouts() -> None:
    sleepers = [Sleeper() for _ in range(3)]
    task = asyncio.create_task(artrl.gather_trajectory_groups([[s() for s in sleepers]], pbar=False))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(s.cancelled for s in sleepers)
    assert other_tasks() == set()


async def test_gather_trajectories_flat() -> None:
    result = await artrl.gather_trajectories(
        [rollout(1.0, delay=0.02), failing(), rollout(3.0)], max_exceptions=1, pbar=False
    )
    assert [t.reward for t in result] == [1.0, 3.0]
    with pytest.raises(artrl.GatherError):
        await artrl.gather_trajectories([failing(), rollout(1.0)], pbar=False)


# --- retry ----------------------------------------------------------------------------------------------


class Flaky:
    """Fails `failures` times with `error`, then returns "ok"."""

    def __init__(self, failures: int, error: type[Exception] = ConnectionError) -> None:
        self.failures = failures
        self.error = error
        self.calls = 0

    def step(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error(f"attempt {self.calls}")
        return "ok"


FAST = {"initial_delay": 0.001, "max_delay": 0.1, "backoff": 2.0, "jitter": 0.0}


async def test_retry_async_retries_with_exponential_backoff() -> None:
    flaky = Flaky(failures=2)
    waits: list[tuple[int, str, float]] = []

    @artrl.retry(max_attempts=3, on_retry=lambda a, e, d: waits.append((a, str(e), d)), **FAST)
    async def call(x: int) -> str:
        await asyncio.sleep(0)
        return f"{flaky.step()}-{x}"

    assert await call(5) == "ok-5"
    assert flaky.calls == 3
    assert waits == [(1, "attempt 1", 0.001), (2, "attempt 2", 0.002)]
    assert call.__name__ == "call"


async def test_retry_async_reraises_the_last_exception() -> None:
    flaky = Flaky(failures=5)

    @artrl.retry(max_attempts=3, **FAST)
    async def call() -> str:
        return flaky.step()

    with pytest.raises(ConnectionError, match="attempt 3"):
        await call()
    assert flaky.calls == 3


async def test_retry_async_does_not_retry_other_exceptions_or_cancellation() -> None:
    flaky = Flaky(failures=1, error=KeyError)

    @artrl.retry(max_attempts=3, exceptions=(ConnectionError,), **FAST)
    async def call() -> str:
        return flaky.step()

    with pytest.raises(KeyError):
        await call()
    assert flaky.calls == 1

    started = asyncio.Event()
    calls = 0

    @artrl.retry(max_attempts=3, exceptions=BaseException, **FAST)
    async def slow() -> None:
        nonlocal calls
        calls += 1
        started.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(slow())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls == 1


def test_retry_sync() -> None:
    flaky = Flaky(failures=2, error=TimeoutError)
    waits: list[float] = []

    @artrl.retry(max_attempts=4, exceptions=TimeoutError, on_retry=lambda a, e, d: waits.append(d), **FAST)
    def call() -> str:
        return flaky.step()

    assert call() == "ok"
    assert flaky.calls == 3 and waits == [0.001, 0.002]

    wrong = Flaky(failures=1, error=ValueError)
    with pytest.raises(ValueError):
        artrl.retry(max_attempts=4, exceptions=TimeoutError, **FAST)(wrong.step)()
    assert wrong.calls == 1

    exhausted = Flaky(failures=9)
    with pytest.raises(ConnectionError, match="attempt 2"):
        artrl.retry(max_attempts=2, **FAST)(exhausted.step)()
    assert exhausted.calls == 2


def test_retry_bare_decorator_and_validation() -> None:
    @artrl.retry
    def fine() -> int:
        return 1

    assert fine() == 1
    with pytest.raises(ValueError, match="max_attempts"):
        artrl.retry(max_attempts=0)
    with pytest.raises(ValueError, match="backoff"):
        artrl.retry(backoff=0.5)
    with pytest.raises(ValueError, match="jitter"):
        artrl.retry(jitter=2)
    with pytest.raises(TypeError, match="exceptions"):
        artrl.retry(exceptions=(ValueError, "oops"))  # type: ignore[arg-type]


def test_backoff_delay_caps_and_jitters() -> None:
    assert [backoff_delay(k, initial_delay=1, max_delay=5, backoff=2, jitter=0) for k in range(1, 6)] == [
        1,
        2,
        4,
        5,
        5,
    ]
    jittered = [backoff_delay(3, initial_delay=1, max_delay=100, backoff=2, jitter=0.25) for _ in range(200)]
    assert all(3.0 <= d <= 5.0 for d in jittered) and len(set(jittered)) > 1


# --- iterate_dataset ------------------------------------------------------------------------------------


def test_iterate_dataset_epochs_steps_and_partial_batch() -> None:
    items = list(range(10))
    batches = list(artrl.iterate_dataset(items, groups_per_step=4, num_epochs=2, seed=3))
    assert [(b.step, b.epoch, b.epoch_step, len(b.items)) for b in batches] == [
        (0, 0, 0, 4),
        (1, 0, 1, 4),
        (2, 0, 2, 2),  # the remainder is kept, and does not spill into the next epoch
        (3, 1, 0, 4),
        (4, 1, 1, 4),
        (5, 1, 2, 2),
    ]
    for epoch in (0, 1):
        seen = [x for b in batches if b.epoch == epoch for x in b.items]
        assert sorted(seen) == items  # every item once per epoch
    first, second = ([x for b in batches if b.epoch == e for x in b.items] for e in (0, 1))
    assert first != second and first != items  # shuffled, differently each epoch


def test_iterate_dataset_is_deterministic_and_seeded() -> None:
    def run(seed: int) -> list[list[str]]:
        return [
            b.items for b in artrl.iterate_dataset("abcdefghij", groups_per_step=3, num_epochs=3, seed=seed)
        ]

    assert run(0) == run(0)
    assert run(0) != run(1)
    unshuffled = [b.items for b in artrl.iterate_dataset("abcde", groups_per_step=2, shuffle=False)]
    assert unshuffled == [["a", "b"], ["c", "d"], ["e"]]


@pytest.mark.parametrize("groups_per_step", [1, 3, 4, 7])
def test_iterate_dataset_resumes_exactly_at_initial_step(groups_per_step: int) -> None:
    items = [f"scenario-{i}" for i in range(7)]
    full = list(artrl.iterate_dataset(items, groups_per_step=groups_per_step, num_epochs=3, seed=11))
    for initial_step in range(len(full) + 2):
        resumed = list(
            artrl.iterate_dataset(
                items, groups_per_step=groups_per_step, num_epochs=3, initial_step=initial_step, seed=11
            )
        )
        assert resumed == full[initial_step:]


def test_iterate_dataset_batches_are_frozen() -> None:
    batch = next(artrl.iterate_dataset([1, 2, 3]))
    assert isinstance(batch, artrl.DatasetBatch)
    with pytest.raises(AttributeError):
        batch.step = 5  # type: ignore[misc]


def test_iterate_dataset_batches_unpack_as_arts_tuples() -> None:
    """ART's loops unpack each batch: `for batch, epoch, global_step, epoch_step in iterate_dataset(...)`."""
    batches = artrl.iterate_dataset("abcde", groups_per_step=2, num_epochs=2, shuffle=False, initial_step=2)
    unpacked = [(batch, epoch, global_step, epoch_step) for batch, epoch, global_step, epoch_step in batches]
    assert unpacked[:2] == [(["e"], 0, 2, 2), (["a", "b"], 1, 3, 0)] and len(unpacked) == 4


def test_iterate_dataset_rejects_bad_arguments_at_call_time() -> None:
    with pytest.raises(ValueError, match="at least one item"):
        artrl.iterate_dataset([])
    with pytest.raises(ValueError, match="groups_per_step must be >= 1"):
        artrl.iterate_dataset([1], groups_per_step=0)
    with pytest.raises(ValueError, match="num_epochs must be >= 1"):
        artrl.iterate_dataset([1], num_epochs=0)
    with pytest.raises(ValueError, match="initial_step must be >= 0"):
        artrl.iterate_dataset([1], initial_step=-1)
    with pytest.raises(TypeError, match="groups_per_step must be an int"):
        artrl.iterate_dataset([1], groups_per_step=2.0)  # type: ignore[arg-type]
