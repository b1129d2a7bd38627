"""What the gateway needs from an engine, whichever generates the tokens (embedded PyTorch, or vLLM).

An engine takes exact prompt token ids and returns, per sampled sequence, a stream of sampled token ids
with their logprobs. It knows nothing about chat templates, tools or HTTP.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

T = TypeVar("T")

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_logprobs: int = 0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    # the request names a step (`name@step`): it ends with an error rather than go on with other weights
    pinned: bool = False


@dataclass(frozen=True)
class TokenChoice:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


class EngineError(RuntimeError):
    """The engine failed while producing a sequence (the message says why)."""


@dataclass(frozen=True)
class _End:
    reason: FinishReason
    error: str | None = None


class SequenceStream:
    """The tokens of one sampled sequence, pushed by an engine thread (or a task on the consumer's loop), read
    by the event loop.

    Pushed items wait in a deque; the consumer's loop is woken once for whatever arrived since it last looked
    (one wake-up per decode step, not per token: each wake-up is a self-pipe write and a task switch that
    take the interpreter lock from the engine thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_timeout_s: float | None = None) -> None:
        self._loop = loop
        self._idle_timeout_s = idle_timeout_s  # no token and no end for this long: an error, never a hang
        self._items: collections.deque[TokenChoice | _End] = collections.deque()
        self._ready = asyncio.Event()  # (set and cleared on the loop only)
        self._wake_scheduled = False
        # set by the consumer, read by the engine thread at every step: a plain attribute (one store and one
        # load, atomic under the interpreter lock; a threading.Event per sequence cost a Condition and a lock)
        self.aborted = False
        self.finish_reason: FinishReason | None = None

    # --- engine side (any thread) ---
    def push(self, choice: TokenChoice) -> None:
        self._deliver(choice)

    def end(self, reason: FinishReason, error: str | None = None) -> None:
        self._deliver(_End(reason, error))

    def _deliver(self, item: TokenChoice | _End) -> None:
        self._items.append(item)
        if self._wake_scheduled:  # a wake-up on its way will find this item too
            return
        if asyncio._get_running_loop() is self._loop:  # pushed on the consumer's loop (vLLM's stream reader)
            self._ready.set()  # (no self-pipe write: the loop runs the consumer once this task yields)
            return
        self._wake_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            self.aborted = True

    def _wake(self) -> None:  # (on the loop)
        self._wake_scheduled = False  # before the consumer drains: a later push schedules another wake-up
        self._ready.set()

    # --- consumer side (event loop) ---
    def abort(self) -> None:
        """Stop generating this sequence (the consumer has what it needs, or went away)."""
        self.aborted = True

    async def __aiter__(self) -> AsyncIterator[TokenChoice]:
        while True:
            while self._items:
                item = self._items.popleft()
                if isinstance(item, _End):
                    self.finish_reason = item.reason
                    if item.reason == "error":
                        raise EngineError(item.error or "engine failure")
                    return
                yield item
            self._ready.clear()
            if self._items:  # pushed between the drain and the clear (its wake-up may have run already)
                continue
            try:
                async with asyncio.timeout(self._idle_timeout_s):
                    await self._ready.wait()
            except TimeoutError:
                self.aborted = True
                self.finish_reason = "error"
                raise EngineError(
                    f"the engine sent nothing for {self._idle_timeout_s:g} s (EngineConfig.stream_idle_timeout_s)"
                ) from None


class Engine(Protocol):
    """The contract between the gateway (and the trainer's wiring) and whatever generates tokens. An engine
    owns its behaviour around training, so nothing outside it asks which engine it is."""

    @property
    def max_context(self) -> int: ...

    def generate(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[SequenceStream]:
        """Start n sampled continuations of prompt_ids; must be called from the event loop."""
        ...

    async def run_exclusive(self, fn: Callable[[], T], *, changes_weights: bool = True) -> T:
        """Run fn (a training step, a save) where nothing else touches the trainer's weights.
        changes_weights=False (a save, an export): what the engine derived from the weights stays valid."""
        ...

    def training(self) -> AbstractAsyncContextManager[None]:
        """The context a training step runs in (an engine sharing a GPU with the trainer steps aside)."""
        ...

    async def publish(self, step: int, checkpoint: str, adapter: bool) -> None:
        """The trainer wrote `checkpoint` (an adapter, or full weights): generate with it from now on."""
        ...

    async def close(self) -> None: ...
