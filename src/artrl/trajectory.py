"""Trajectories: what one rollout said and sampled, with its reward. Pure data (pydantic), no torch.

`messages_and_choices` mixes plain message dicts (system/user/tool, or assistant turns from elsewhere) and
OpenAI `Choice` objects returned by the served model: a Choice is a sampled, trainable turn and carries the
exact `prompt_token_ids`, `token_ids` and `token_logprobs` the gateway attached to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

MessageOrChoice = Choice | dict[str, Any]
Messages = list[dict[str, Any]]  # chat-completions messages (ART's `art.Messages`)
MessagesAndChoices = list[MessageOrChoice]
Tools = list[dict[str, Any]]  # chat-completions `tools` (ART's `art.Tools`)


def choice_to_message(choice: Choice) -> dict[str, Any]:
    """The assistant message to send back to the API for a sampled choice."""
    message: dict[str, Any] = {"role": "assistant", "content": choice.message.content}
    if choice.message.tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in choice.message.tool_calls
        ]
    return message


class History(BaseModel):
    """One conversation: messages and sampled choices, and the tools it offered."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages_and_choices: list[MessageOrChoice] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _choices_from_json(cls, items: Any) -> Any:
        """JSON has no types: an object with `finish_reason` and `message` is a Choice, the rest messages."""
        if not isinstance(items, list):
            return items
        return [
            Choice.model_validate(x) if isinstance(x, dict) and "finish_reason" in x and "message" in x else x
            for x in items
        ]

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-completions messages (choices become assistant messages)."""
        return [choice_to_message(x) if isinstance(x, Choice) else x for x in self.messages_and_choices]

    def choices(self) -> list[Choice]:
        return [x for x in self.messages_and_choices if isinstance(x, Choice)]


class Trajectory(History):
    """A rollout: its main conversation (this History) with its reward.

    `additional_histories` are other conversations of the same rollout (sub-agents, summaries, ...): they are
    trained with the same reward (`artrl.capture` fills them from calls that do not continue the main one).
    """

    reward: float = 0.0
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    additional_histories: list[History] = Field(default_factory=list)

    _tokens: list[contextvars.Token] = PrivateAttr(default_factory=list)
    _started: float = PrivateAttr(default_factory=time.monotonic)  # (when it was made: `finish`)

    def log(self, message: str) -> None:
        self.logs.append(message)

    def policy_versions(self) -> list[int]:
        """The training step of the weights that sampled each of its calls, in call order (the main
        conversation's, then the additional histories'): the gateway stamps every choice (`policy_step`).
        Choices from another server, or recorded before the stamp existed, are not counted."""
        steps = (
            c.model_extra.get("policy_step")
            for history in (self, *self.additional_histories)
            for c in history.choices()
            if c.model_extra
        )
        return [s for s in steps if isinstance(s, int)]

    @contextlib.asynccontextmanager
    async def track_duration(self, name: str) -> AsyncIterator[None]:
        """`async with traj.track_duration("llm_completion"):` adds the block's seconds to the metric
        `llm_completion_duration` (summed over the blocks of that name), as ART's Trajectory does."""
        start = time.monotonic()
        try:
            yield
        finally:
            key = f"{name}_duration"
            self.metrics[key] = self.metrics.get(key, 0.0) + (time.monotonic() - start)

    def finish(self) -> Trajectory:
        """Set the metric `duration` to the seconds since this trajectory was made, and return it (ART's
        `return traj.finish()` at the end of a rollout)."""
        self.metrics["duration"] = time.monotonic() - self._started
        return self

    def __enter__(self) -> Trajectory:
        """`with art.Trajectory() as t:` (ART's idiom): `t` is `art.current_trajectory()` inside the block."""
        self._tokens.append(RECORDING.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        RECORDING.reset(self._tokens.pop())

    async def __aenter__(self) -> Trajectory:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)


# the trajectory being recorded in this context (artrl.current_trajectory; rollouts/recording.py)
RECORDING: contextvars.ContextVar[Trajectory | None] = contextvars.ContextVar(
    "artrl_trajectory", default=None
)


def _exception_text(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class TrajectoryGroup(BaseModel):
    """Rollouts of one scenario, compared with each other (GRPO's group).

    `TrajectoryGroup(trajectories)` takes `Trajectory` objects (an exception among them is recorded in
    `exceptions`, as ``"Type: message"``). Given *awaitables* instead (ART's idiom,
    ``TrajectoryGroup(rollout(model, s) for _ in range(8))``), it returns a `PendingGroup`: pass it to
    `artrl.gather_trajectory_groups`, which runs its rollouts with the others (progress bar, exception
    budget), or await it on its own.
    """

    model_config = ConfigDict(extra="forbid")

    trajectories: list[Trajectory]
    exceptions: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)

    def __new__(cls, trajectories: Iterable[Any] | None = None, **data: Any) -> Any:
        if trajectories is None or (isinstance(trajectories, list | tuple) and not trajectories):
            return super().__new__(cls)
        items = _items(trajectories)
        if any(inspect.isawaitable(x) for x in items):
            unknown = set(data) - {"exceptions", "metadata"}
            if unknown:
                _close_coroutines(items)
                raise TypeError(
                    f"TrajectoryGroup got unexpected keyword argument(s): {', '.join(sorted(unknown))}"
                )
            pending = PendingGroup(
                items, exceptions=data.get("exceptions", ()), metadata=data.get("metadata", {})
            )
            pending.group_class = cls
            return pending
        self = super().__new__(cls)
        self.__dict__["__artrl_items__"] = items  # read by __init__ (a generator is spent by now)
        return self

    def __init__(self, trajectories: Iterable[Any] | None = None, **data: Any) -> None:
        items = self.__dict__.pop("__artrl_items__", None)
        if trajectories is not None:
            items = _items(trajectories) if items is None else items
            data["trajectories"] = [x for x in items if not isinstance(x, BaseException)]
            failed = [_exception_text(x) for x in items if isinstance(x, BaseException)]
            if failed:
                data["exceptions"] = [*_exception_texts(data.get("exceptions", ())), *failed]
        if "exceptions" in data:
            data["exceptions"] = _exception_texts(data["exceptions"])
        super().__init__(**data)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self):  # type: ignore[override]
        return iter(self.trajectories)


def _items(trajectories: Any) -> list[Any]:
    """The items of a group as given: Trajectory objects or exceptions, or awaitables only."""
    if isinstance(trajectories, str | bytes | dict) or not isinstance(trajectories, Iterable):
        raise TypeError(
            f"TrajectoryGroup takes an iterable of artrl.Trajectory (or of awaitables of them: "
            f"TrajectoryGroup(rollout(model, s) for _ in range(8))), not {type(trajectories).__name__}"
        )
    items = list(trajectories)
    awaitables = [inspect.isawaitable(x) for x in items]
    for i, x in enumerate(items):
        if any(awaitables) and not awaitables[i]:
            _close_coroutines(items)
            raise TypeError(
                f"TrajectoryGroup item {i} ({type(x).__name__}) is not awaitable, unlike the others: give it either rollouts "
                "to run (awaitables, e.g. coroutines) or their results (artrl.Trajectory), not both"
            )
        if not any(awaitables) and not isinstance(x, Trajectory | BaseException | dict):
            raise TypeError(
                f"TrajectoryGroup item {i} is of type {type(x).__name__}: give artrl.Trajectory objects, or "
                "awaitables that return them (pass rollout(...), the coroutine, or the Trajectory it returns)"
            )
    return items


def _exception_texts(exceptions: Iterable[Any]) -> list[Any]:
    return [_exception_text(e) if isinstance(e, BaseException) else e for e in exceptions]


def _close_coroutines(items: list[Any]) -> None:
    """Close coroutines that will never run, so that Python does not warn that they were never awaited."""
    for x in items:
        if inspect.iscoroutine(x) and inspect.getcoroutinestate(x) == inspect.CORO_CREATED:
            x.close()


class PendingGroup:
    """A group whose rollouts have not run yet: what `TrajectoryGroup(awaitables)` returns.

    `artrl.gather_trajectory_groups([...])` runs its rollouts alongside the other groups' (one progress bar,
    one exception budget) and returns the `TrajectoryGroup`, trajectories in the order given. Awaited on its
    own it does the same for this one group (the first failing rollout raises)."""

    def __init__(
        self, rollouts: list[Any], *, exceptions: Iterable[Any] = (), metadata: dict[str, Any]
    ) -> None:
        self.rollouts = rollouts
        self._taken = False
        self.group_class: type[TrajectoryGroup] = TrajectoryGroup  # what the rollouts become (a subclass too)
        self.exceptions = _exception_texts(exceptions)
        self.metadata = dict(metadata)

    def __len__(self) -> int:
        return len(self.rollouts)

    def take(self) -> list[Any]:
        """The rollouts, handed over to whoever runs them (once: the group then holds none)."""
        if not self.rollouts and self._taken:
            raise RuntimeError("this TrajectoryGroup's rollouts were already run: make a new one per gather")
        rollouts, self.rollouts, self._taken = self.rollouts, [], True
        return rollouts

    def __await__(self):
        return self._gathered().__await__()

    async def _gathered(self) -> TrajectoryGroup:
        """Every rollout at once; the first failure cancels the others and is raised (as with
        gather_trajectory_groups' default budget, without its progress bar)."""
        rollouts = self.take()

        async def run(aw: Any) -> Any:
            return await aw

        try:
            async with asyncio.TaskGroup() as tasks:
                running = [tasks.create_task(run(aw)) for aw in rollouts]
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None
        finally:
            _close_coroutines(rollouts)
        results = [task.result() for task in running]
        for i, value in enumerate(results):
            if not isinstance(value, Trajectory):
                raise TypeError(f"rollout {i} returned a {type(value).__name__}, not an artrl.Trajectory")
        return self.group_class(results, exceptions=self.exceptions, metadata=self.metadata)

    def __repr__(self) -> str:
        return f"PendingGroup({len(self.rollouts)} rollouts)"

    def __del__(self) -> None:  # never run: close its coroutines (Python would warn they were never awaited)
        _close_coroutines(self.rollouts)
