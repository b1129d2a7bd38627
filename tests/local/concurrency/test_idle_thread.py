"""The vLLM engine's trainer executor: one thread, tasks in order, results and exceptions delivered, and the
thread ends when idle (its OpenMP team with it) and starts again with the next task."""

from __future__ import annotations

import threading
import time

import pytest

from artrl.local.concurrency.idle_thread import IdleEndingExecutor


def test_tasks_run_in_order_on_one_thread_that_ends_when_idle_and_restarts():
    pool = IdleEndingExecutor(0.05, "worker")
    seen: list[tuple[int, str]] = []
    futures = [
        pool.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i) for i in range(20)
    ]
    assert [f.result(5) for f in futures] == list(range(20))
    assert [i for i, _ in seen] == list(range(20)) and {name for _, name in seen} == {"worker"}
    first = pool.submit(threading.current_thread).result(5)  # (pool._thread may be None already: 0.05 s idle)
    deadline = time.monotonic() + 5
    while pool._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._thread is None and first is not None
    first.join(5)
    assert not first.is_alive()
    assert pool.submit(lambda: 7).result(5) == 7
    assert pool.submit(threading.current_thread).result(5) is not first  # a new thread
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    # tasks racing the thread's decision to end are never left behind
    for _ in range(30):
        time.sleep(0.05)
        assert pool.submit(lambda: 3).result(5) == 3
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: 1)
