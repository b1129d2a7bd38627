"""Where a gateway's requests are rendered and tokenised: one thread (the prompt builder's tokenizer copy is
not for two threads at once), off the event loop. Not first come first served: each request is due at its
arrival plus its expected preparation time (its body's size at PREPARED_BYTES_PER_S), earliest due first,
so a small request does not wait behind big ones sent just before it, and none waits for ever (every later
arrival is due later). The bytes of the bodies waiting or in preparation are bounded: beyond, a 429."""

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


class Preparation:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0  # bytes of the bodies waiting or in preparation
        self._due: list[tuple[float, int, int, Callable[[], Any], Future]] = []  # a heap
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

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
                self._changed.wait_for(lambda: self._due or self._closed, IDLE_EXIT_S)
                if self._closed or not self._due:  # (closed, or idle: the next submit starts a thread)
                    self._thread = None
                    return
                _, _, size, work, future = heapq.heappop(self._due)
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(work())
                    except BaseException as exc:  # (the caller's: a RequestError, or a defect it reports)
                        future.set_exception(exc)
            finally:
                with self._changed:
                    self.held -= size

    def close(self) -> None:
        """The requests still waiting cancelled, the thread ended once its current request is done."""
        with self._changed:
            self._closed = True
            for _, _, size, _, future in self._due:
                future.cancel()
                self.held -= size
            self._due.clear()
            self._changed.notify()
