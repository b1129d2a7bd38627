"""An executor with one worker thread that ends when it has been idle for a while (and starts again with the
next task): the OpenMP team a thread keeps once it has run torch ops goes with it. On a CPU, libgomp
throttles the spin-waiting of every team while it manages more threads than there are cores, so an idle
team slows a busy engine next to it (see EngineConfig.engine_thread_idle_s, which sets the wait here too).
Tasks run one at a time, in the order they were submitted."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class IdleEndingExecutor(Executor):
    def __init__(self, idle_s: float, name: str) -> None:
        self._idle_s = idle_s
        self._name = name
        self._tasks: queue.SimpleQueue[tuple[Future, Callable[[], Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards starting the thread and its decision to end
        self._thread: threading.Thread | None = None
        self._shut = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._shut:
            raise RuntimeError(f"{self._name}: cannot run a task after shutdown")
        future: Future = Future()
        self._tasks.put((future, lambda: fn(*args, **kwargs)))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shut = True
        with self._lock:
            thread = self._thread
        if wait and thread is not None:
            thread.join()

    def _work(self) -> None:
        while True:
            try:
                future, task = self._tasks.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:  # (a task queued meanwhile keeps this thread: its submitter saw it alive)
                    if self._tasks.empty():
                        self._thread = None
                        return
                continue
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(task())
                except BaseException as exc:  # delivered to the caller
                    future.set_exception(exc)
