"""The embedded engine: in-process transformers inference with continuous batching.

One engine thread owns the model while generating. Each iteration it (1) admits the requests that arrived
since the last iteration (a batched, left-padded prefill), merges their KV cache into the running batch,
then (2) decodes one token for every running sequence (the steps: `running_batch.py`). A request never waits
for an unrelated long one: it joins the running batch at the next token step. The same model object is what the trainer updates,
and training runs *on this thread* too (`call`): between two token steps, with one OpenMP thread pool and
one allocator arena for everything that computes, so generation and training never contend for the model.

With `adapters=True` the model is a PEFT model holding several LoRA adapters by name (a training server's
models on one base copy): each request names its adapter, rows of different adapters share a batch (PEFT's
mixed-batch forward), and the jobs of different adapters (their training steps) take turns, one between
two token steps, the adapter that waited longest first.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import logging
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from artrl.config import EngineConfig
from artrl.local.concurrency.idle_thread import IdleEndingThread
from artrl.local.concurrency.torch_threads import default_threads
from artrl.local.engine.contract import SequenceStream
from artrl.local.engine.hf.fused_decode import FusedDecode
from artrl.local.engine.hf.prefix_cache import PrefixCache
from artrl.local.engine.hf.running_batch import RunningBatch
from artrl.local.engine.hf.sampling import SamplingParams
from artrl.local.engine.hf.sequences import Request, RunningSequence, fail_sequences
from artrl.local.kernels.merged_lora import MergedLora

log = logging.getLogger(__name__)


def _stop_at_exit(engine_ref: weakref.ref) -> None:
    """At interpreter exit, before daemon threads are frozen: stop the thread of an engine nobody closed
    (ART's scripts never close their backend). A daemon thread frozen inside a torch op (the prefix cache
    kept after the last answer) aborts the process: "terminate called without an active exception"."""
    engine = engine_ref()
    if engine is not None and not engine._closed:
        engine._closed = True
        engine._incoming.put(None)
        thread = engine._worker.current
        if thread is not None:
            thread.join(10)


@dataclass
class _Job:
    fn: Callable[[], Any]
    future: Future
    changes_weights: bool = True  # False: the prefix cache and the fused weights stay valid after it
    adapter: str | None = None  # whose weights it changes (None: the model's)


class HFEngine:
    """Continuous-batching generation over a transformers causal LM (optionally wrapped by PEFT)."""

    def __init__(self, model, *, max_context: int, config: EngineConfig, adapters: bool = False) -> None:
        self._idle_timeout_s = config.stream_idle_timeout_s
        self._thread_idle_s = config.engine_thread_idle_s
        # (generation's torch threads, training's), set on the engine thread whatever a new thread starts with:
        # torch.set_num_threads also sets the count that threads started later take on their first torch op
        default = default_threads()
        self._threads = (config.generation_threads or default, default)
        self.model = model
        self._max_context = max_context
        self._incoming: queue.SimpleQueue[Request | _Job | None] = queue.SimpleQueue()
        self._jobs: list[_Job] = []
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes, config.prefix_cache_min_tokens)
        self._closed = False
        self._device = next(model.parameters()).device
        self.adapters = adapters
        self._turns: dict[str | None, int] = {}  # adapter -> when its last job ran (adapters=True)
        self._versions: dict[str | None, int] = {}  # adapter -> times its weights changed (None: all)
        self._job_count = 0
        auto = config.merge_lora == "auto" and self._device.type == "cpu"
        merge = not adapters and (config.merge_lora == "always" or auto)
        self._lora = MergedLora.of(model) if merge else None  # generation with W + s·B·A (see merged_lora)
        # transformers 5.2x renamed `past_key_values` to `cache` (argument and output field)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wraps forward
        cache_arg = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        self._steps = RunningBatch(  # waiting requests and the running batch: the engine thread's alone
            model,
            max_context=max_context,
            max_batch_size=config.max_batch_size,
            max_prefill_tokens=config.max_prefill_tokens,
            kv_cache_budget_bytes=config.kv_cache_budget_bytes,
            prefix_cache=self.prefix_cache,
            cache_arg=cache_arg,
        )
        # (None: not CPU, another layout)
        self._fused = FusedDecode.of(model, adapters) if config.fused_decode else None
        self._steps.fused = self._fused
        self._steps.adapters = adapters
        self._worker = IdleEndingThread(self._run, "artrl-engine")
        self._worker.wake()
        atexit.register(_stop_at_exit, weakref.ref(self))

    @property
    def max_context(self) -> int:
        return self._max_context

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int, adapter: str | None = None
    ) -> list[SequenceStream]:
        """n continuations of prompt_ids (from `adapter`'s weights, adapters=True)."""
        if self._closed:
            raise RuntimeError("engine is closed")
        if adapter is not None and not self.adapters:
            raise ValueError("this engine serves one model: its requests name no adapter")
        if adapter is not None and adapter not in self.model.peft_config:  # (a bad one would fail the batch)
            raise ValueError(f"the engine's model has no adapter {adapter!r}")
        loop = asyncio.get_running_loop()
        sequences = []
        for i in range(n):
            generator = None
            if params.seed is not None:
                # (sampling.uniforms draws from it; the i-th of n sequences far from seed + i, so requests with
                # nearby seeds share no sequences; the first is seeded as a request for one)
                generator = random.Random((params.seed + i * 0x9E3779B97F4A7C15) % 2**64)
            stream = SequenceStream(loop, self._idle_timeout_s)
            sequence = RunningSequence(stream, params, generator, adapter=adapter)
            sequence.version = self.weights_version(adapter)  # (a pinned request's weights: these)
            sequences.append(sequence)
        self._incoming.put(Request(list(prompt_ids), sequences, adapter))
        self._worker.wake()
        return [s.stream for s in sequences]

    def call(
        self, fn: Callable[[], Any], *, changes_weights: bool = True, adapter: str | None = None
    ) -> Future:
        """Run fn on the engine thread between two token steps (e.g. a training step); returns its future.
        changes_weights=False (a checkpoint write): cached prefixes and fused weights are kept; `adapter`:
        fn changes that adapter's weights only (adapters=True)."""
        if self._closed:
            raise RuntimeError("engine is closed")
        job = _Job(fn, Future(), changes_weights, adapter)
        self._incoming.put(job)
        self._worker.wake()
        return job.future

    async def run_exclusive(self, fn: Callable[[], Any], *, changes_weights: bool = True) -> Any:
        """On the engine's own thread, between two token steps: generation pauses, then uses the result."""
        return await asyncio.wrap_future(self.call(fn, changes_weights=changes_weights))

    def training(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()  # type: ignore[return-value]  # async-compatible in 3.10+

    async def publish(self, step: int, checkpoint: str, adapter: bool) -> None:
        """Nothing to do: the engine generates with the very weights the trainer updated."""

    async def close(self) -> None:
        self._closed = True
        self._incoming.put(None)
        thread = self._worker.wake()
        await asyncio.to_thread(thread.join, 30)

    @property
    def _thread(self) -> threading.Thread | None:
        return self._worker.current

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        idle_since = time.monotonic()
        torch.set_num_threads(self._threads[0])  # (this thread's own OpenMP team: set in each new one)
        while not self._closed:
            try:
                steps = self._steps
                if self._collect_requests(block=not steps.batch.sequences and not self._jobs) or steps.busy:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= self._thread_idle_s and self._worker.end_unless(
                    lambda: not self._incoming.empty() or self._steps.busy or bool(self._jobs)
                ):
                    return
                self._run_jobs()
                if steps.busy:
                    self._merge_lora()
                    self._build_fused()
                with torch.inference_mode():
                    steps.admit()
                    steps.drop_finished()
                    if steps.batch.sequences:
                        steps.decode_step()
                        steps.drop_finished()
            except Exception as exc:  # never let one bad batch kill the engine thread
                log.exception("engine step failed")  # the running batch is lost; queued requests are not
                self._steps.fail_running(f"{type(exc).__name__}: {exc}")
        self._steps.fail_all("engine closed", reason="abort")
        # what was queued behind the close (a call that raced it) fails too: nothing waits forever
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._incoming.get_nowait()
                if isinstance(item, _Job):
                    self._jobs.append(item)
                elif item is not None:
                    fail_sequences(item.sequences, "engine closed", "abort")
        for job in self._jobs:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(RuntimeError("engine closed"))

    def _merge_lora(self) -> None:
        if self._lora is None:
            return
        try:
            self._lora.merge()
        except Exception as exc:  # (out of memory for the copy, say): generate through the adapter instead
            log.warning("generating through the adapter: merging it failed (%s: %s)", type(exc).__name__, exc)
            self._lora.unmerge()
            self._lora = None

    def _build_fused(self) -> None:
        """The fused decode step's weights, after a job or at the first step (from the merged weights)."""
        fused = self._fused
        if fused is None or fused.ready:
            return
        try:
            fused.build()
        except Exception as exc:  # (a module outside the layout, out of memory for the copy)
            log.warning(
                "decode steps and prefills through the transformers forward: the fused forward failed to build (%s: %s)",
                type(exc).__name__,
                exc,
            )
            self._fused = self._steps.fused = None

    def forget_adapter(self, adapter: str, remove: Callable[[], Any]) -> Future:
        """End `adapter`'s requests (waiting and running), drop its cached prefixes, then `remove()` it from
        the model, on the engine thread (adapters=True)."""

        def forget() -> Any:
            for request in self._steps.pending:
                if request.adapter == adapter:
                    fail_sequences(request.sequences, f"the model of adapter {adapter!r} was closed", "abort")
            self._steps.pending = [r for r in self._steps.pending if r.adapter != adapter]
            for sequence in self._steps.batch.sequences:
                if sequence.adapter == adapter:
                    sequence.finish("abort")
            with torch.inference_mode():  # (the batch's cache tensors are inference tensors)
                self._steps.drop_finished()
            self.prefix_cache.clear_adapter(adapter)
            self._turns.pop(adapter, None)
            if self._fused is not None:
                self._fused.stale(adapter)  # (its factors dropped at the next build)
            return remove()

        return self.call(forget, changes_weights=False, adapter=adapter)

    def check_adapter(self, adapter: str) -> None:
        """ValueError when the model's `adapter` cannot run in this engine's forward (on the engine thread: a
        job's; one adapter the fused forward cannot compute would turn it off for every adapter)."""
        if self._fused is None:
            return
        try:
            self._fused.check_adapter(adapter)
        except TypeError as exc:
            raise ValueError(
                f"this engine serves adapters of the decoder's linear layers (q/k/v/o, gate/up/down): {exc}"
            ) from None

    def _next_jobs(self) -> list[_Job]:
        """The jobs to run before the next token step: all of them, or (adapters=True) the one of the adapter
        whose last job ran longest ago (the earliest of its jobs), so that no model's training calls wait
        behind another's queue and generation goes on between them."""
        if not self.adapters or len(self._jobs) <= 1:
            jobs, self._jobs = self._jobs, []
            return jobs
        job = min(self._jobs, key=lambda j: self._turns.get(j.adapter, -1))  # (min: the first of equals)
        self._jobs.remove(job)
        return [job]

    def _run_jobs(self) -> None:
        jobs = self._next_jobs()
        if not jobs:
            return
        for job in jobs:
            self._job_count += 1
            self._turns[job.adapter] = self._job_count
            if not job.changes_weights:
                continue
            if job.adapter is None:
                self.prefix_cache.clear()  # cached keys and values are stale
            else:
                self.prefix_cache.clear_adapter(job.adapter)
            if self._fused is not None:
                self._fused.stale(job.adapter)
        if self._lora is not None:
            self._lora.unmerge()  # jobs see the model as the trainer built it: base weights + adapter
        torch.set_num_threads(self._threads[1])  # training with torch's default
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                try:
                    job.future.set_result(job.fn())
                except BaseException as exc:  # delivered to the caller
                    job.future.set_exception(exc)
        torch.set_num_threads(self._threads[0])
        changed = [job.adapter for job in jobs if job.changes_weights]
        for adapter in changed:
            self._versions[adapter] = self._versions.get(adapter, 0) + 1
        if changed:
            self._end_stale_pinned()

    def weights_version(self, adapter: str | None) -> int:
        """How many times the weights `adapter` samples from changed (a training step, a load)."""
        version = self._versions.get(None, 0)
        return version + (self._versions.get(adapter, 0) if adapter is not None else 0)

    def _end_stale_pinned(self, requests: list[Request] | None = None) -> None:
        """Sequences of requests pinned to a step (`name@step`) whose weights changed since they came end
        with an error: none goes on, or starts, with other weights than its step's."""
        message = (
            "the served weights moved to a newer step while this request, pinned to its step (name@step), "
            "waited or generated: send it again, pinned to the step served now"
        )
        candidates = requests if requests is not None else [*self._steps.pending]
        sequences = [s for r in candidates for s in r.sequences]
        if requests is None:
            sequences += self._steps.batch.sequences
        stale = [s for s in sequences if s.params.pinned and s.version != self.weights_version(s.adapter)]
        if not stale:
            return
        fail_sequences(stale, message)
        self._steps.pending = [r for r in self._steps.pending if not all(s.done for s in r.sequences)]
        with torch.inference_mode():  # (the batch's cache tensors are inference tensors)
            self._steps.drop_finished()

    def _collect_requests(self, block: bool) -> bool:
        """Move what arrived to the pending requests and jobs (waiting a little when block); whether any."""
        try:
            wait = min(0.5, self._thread_idle_s)
            item = self._incoming.get(timeout=wait) if block else self._incoming.get_nowait()
        except queue.Empty:
            return False
        while item is not None:
            if isinstance(item, _Job):
                self._jobs.append(item)
            elif not item.sequences[0].params.pinned:
                self._steps.pending.append(item)
            else:  # (its weights may have changed since it came: a step ran meanwhile)
                self._steps.pending.append(item)
                self._end_stale_pinned([item])
            try:
                item = self._incoming.get_nowait()
            except queue.Empty:
                return True
        self._closed = True
        return True
