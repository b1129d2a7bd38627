"""A thread, and an executor with one worker thread, that end when it has been idle for a while (and starts again with the
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


class IdleEndingThread:
    """A thread that ends itself when idle and is started again on demand. Starting it and its decision to end
    happen under one lock, so work queued while it decides is never left without a thread: either the thread
    sees the work (and stays), or the producer, waking it after queueing, sees no thread and starts one."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._target = target
        self._name = name
        self._lock = threading.Lock()
        self.current: threading.Thread | None = None

    def wake(self) -> threading.Thread:
        """The running thread, started if there is none (call after queueing the work)."""
        with self._lock:
            if self.current is None:
                self.current = threading.Thread(target=self._target, name=self._name, daemon=True)
                self.current.start()
            return self.current

    def end_unless(self, busy: Callable[[], bool]) -> bool:
        """From the thread itself: True (then it must return) unless `busy()` finds work that arrived."""
        with self._lock:
            if busy():
                return False
            self.current = None
            return True


class IdleEndingExecutor(Executor):
    def __init__(self, idle_s: float, name: str) -> None:
        self._idle_s = idle_s
        self._name = name
        self._tasks: queue.SimpleQueue[tuple[Future, Callable[[], Any]]] = queue.SimpleQueue()
        self._worker = IdleEndingThread(self._work, name)
        self._shut = False

    @property
    def _thread(self) -> threading.Thread | None:
        return self._worker.current

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        if self._shut:
            raise RuntimeError(f"{self._name}: cannot run a task after shutdown")
        future: Future = Future()
        self._tasks.put((future, lambda: fn(*args, **kwargs)))
        self._worker.wake()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shut = True
        thread = self._worker.current
        if wait and thread is not None:
            thread.join()

    def _work(self) -> None:
        while True:
            try:
                future, task = self._tasks.get(timeout=self._idle_s)
            except queue.Empty:
                if self._worker.end_unless(lambda: not self._tasks.empty()):
                    return
                continue
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(task())
                except BaseException as exc:  # delivered to the caller
                    future.set_exception(exc)
