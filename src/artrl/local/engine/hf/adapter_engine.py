"""One adapter of an embedded engine that serves several (`HFEngine(adapters=True)`): the `Engine` that a
training server's model (its gateway and its trainer) sees. Its requests sample from its adapter, batched
with the other adapters' requests; its jobs (training steps, saves) run on the engine's thread with its
adapter made the active one, taking turns with the other adapters' jobs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

from artrl.local.engine.contract import SamplingParams, SequenceStream
from artrl.local.engine.hf.engine import HFEngine

T = TypeVar("T")


class AdapterEngine:
    def __init__(
        self,
        engine: HFEngine,
        adapter: str,
        activate: Callable[[], Any],
        remove: Callable[[], Any],
    ) -> None:
        self.engine, self.adapter = engine, adapter
        self._activate, self._remove = activate, remove  # (on the engine's thread)
        self._closed = False

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def generate(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[SequenceStream]:
        if self._closed:
            raise RuntimeError("engine is closed")
        return self.engine.generate(prompt_ids, params, n, adapter=self.adapter)

    async def run_exclusive(self, fn: Callable[[], T], *, changes_weights: bool = True) -> T:
        """fn on the engine's thread, this adapter active (the model's training and saving act on it)."""
        if self._closed:
            raise RuntimeError("engine is closed")

        def job() -> T:
            self._activate()
            return fn()

        future = self.engine.call(job, changes_weights=changes_weights, adapter=self.adapter)
        return await asyncio.wrap_future(future)

    def training(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()  # type: ignore[return-value]

    async def publish(self, step: int, checkpoint: str, adapter: bool) -> None:
        """Nothing to do: the engine generates with the very adapter weights the trainer updated."""

    async def close(self) -> None:
        """This adapter's requests end and the adapter leaves the model; the engine serves the others on."""
        if self._closed:
            return
        self._closed = True
        try:
            future = self.engine.forget_adapter(self.adapter, self._remove)
        except RuntimeError:  # (the engine closed first: nothing left to remove)
            return
        await asyncio.wrap_future(future)
