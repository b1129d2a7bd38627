"""Where a gateway's requests are rendered and tokenised: one thread (the prompt builder's tokenizer copy is
not for two threads at once), off the event loop. Not first come first served: each request is due at its
arrival plus its expected preparation time (its body's size at PREPARED_BYTES_PER_S), earliest due first,
so a small request does not wait behind big ones sent just before it, and none waits for ever (every later
arrival is due later). The bytes of the bodies waiting or in preparation are bounded: beyond, a 429.

A small request that finds the thread idle (nothing due, nothing in preparation) is prepared at once on the
caller's thread instead (`run_now`): two thread hand-offs a call saved, and on the event loop a stall of
about a millisecond (INLINE_BYTES bounds it), while the thread still takes every big request and every
request that would otherwise run beside another's preparation."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from artrl.local.gateway.protocol import RequestError

PREPARED_BYTES_PER_S = 8 << 20  # about what one thread renders and tokenises (an order of magnitude)
IDLE_EXIT_S = 30.0  # the thread ends when idle this long (the next request starts another)
INLINE_BYTES = 16 << 10  # run_now's bound: about 2 ms of rendering and tokenising at PREPARED_BYTES_PER_S


class Preparation:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0  # bytes of the bodies waiting or in preparation
        self._due: list[tuple[float, int, int, Callable[[], Any], Future]] = []  # a heap
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False  # a request is being prepared (on the thread, or by run_now)
        self._closed = False

    def run_now(self, size: int, work: Callable[[], Any]) -> tuple[bool, Any]:
        """(True, `work()`) run on the calling thread when the body is small and nothing else is waiting
        or being prepared (never two preparations at once: the builder's tokenizer is not for two threads);
        (False, None) otherwise: then `submit` it. `work`'s exception propagates."""
        if size > INLINE_BYTES:
            return False, None
        with self._changed:
            if self._closed or self._busy or self._due:
                return False, None
            self._busy = True
        try:
            return True, work()
        finally:
            with self._changed:
                self._busy = False
                self._changed.notify()

    def submit(self, size: int, work: Callable[[], Any]) -> Future:
        """`work()` run on the preparation thread, in due order: its future. RequestError (429) when the
        bodies held would pass `max_bytes`."""
        with self._changed:
            if self._closed:
                raise RequestError("the gateway is shutting down", code="unavailable", status=503)
            if self.held + size > self.max_bytes:
                raise RequestError(
                    f"the gateway is preparing {self.held} bytes of requests (GatewayConfig.max_preparing_bytes "
                    f"= {self.max_bytes}); retry shortly",
                    code="too_many_requests",
                    status=429,
                )
            self.held += size
            future: Future = Future()
            due = time.monotonic() + size / PREPARED_BYTES_PER_S
            heapq.heappush(self._due, (due, next(self._order), size, work, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="artrl-prepare", daemon=True)
                self._thread.start()
            self._changed.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: (self._due and not self._busy) or self._closed, IDLE_EXIT_S)
                if self._closed or not self._due:  # (closed, or idle: the next submit starts a thread)
                    self._thread = None
                    return
                if self._busy:  # (run_now's preparation outlasted the wait: wait again)
                    continue
                _, _, size, work, future = heapq.heappop(self._due)
                self._busy = True
            result: Any = None
            failure: BaseException | None = None
            wanted = future.set_running_or_notify_cancel()
            if wanted:
                try:
                    result = work()
                except BaseException as exc:  # (the caller's: a RequestError, or a defect it reports)
                    failure = exc
            with self._changed:  # (idle again before its caller wakes)
                self.held -= size
                self._busy = False
            if wanted and failure is None:
                future.set_result(result)
            elif wanted:
                future.set_exception(failure)

    def close(self) -> None:
        """The requests still waiting cancelled, the thread ended once its current request is done."""
        with self._changed:
            self._closed = True
            for _, _, size, _, future in self._due:
                future.cancel()
                self.held -= size
            self._due.clear()
            self._changed.notify()
