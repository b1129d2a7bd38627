"""Training rows of many conversations given as plain messages, rendered on several cores.

`train_sft` turns each conversation into rows turn by turn through the chat template (`rows.rendered_rows`):
pure Python, ~2 ms a conversation, on one core (4096 conversations: ~7 s before the first optimizer step).
From PARALLEL_FROM trajectories on, `RowRenderer` shares them out in chunks between a thread of this process
and worker processes (`render_worker.py`), started on first use and kept until the backend closes (a start
costs ~2 s of imports). The rows are those a single thread renders, in the same order: every chunk goes
through the same function. A worker that fails or stops answering is stopped; its chunk is rendered here.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import pickle
import select
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

from artrl.config import SFTConfig
from artrl.local.chat_format import ChatFormat
from artrl.local.rows import Row, trajectory_rows
from artrl.trajectory import Trajectory

log = logging.getLogger(__name__)

PARALLEL_FROM = 256  # trajectories; fewer are rendered on the caller's thread (a worker would not pay off)
MAX_WORKERS = 4
CHUNK_TIMEOUT_S = 600.0  # one chunk's answer (~0.2 s of work; the first one includes the worker's start)


def default_workers() -> int:
    """One worker per CPU beyond the first, at most MAX_WORKERS (none on one CPU)."""
    return max(0, min(MAX_WORKERS, (os.cpu_count() or 1) - 1))


class WorkerFailed(RuntimeError):
    """A render worker died, sent something unreadable or did not answer in time."""


class _Worker:
    def __init__(self) -> None:
        source = str(Path(__file__).resolve().parents[2])  # (the folder holding the artrl package)
        path = os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.process = subprocess.Popen(
            self.command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.format_key: str | None = None  # the chat format the worker holds

    def command(self) -> list[str]:
        return [sys.executable, "-m", "artrl.local.render_worker"]

    def render(
        self, key: str, blob: bytes, trajectories: list[Trajectory], start: int, kwargs: dict[str, Any]
    ) -> list[list[Row]]:
        assert self.process.stdin is not None and self.process.stdout is not None
        request = (key, None if key == self.format_key else blob, trajectories, start, kwargs)
        try:
            pickle.dump(request, self.process.stdin)
            self.process.stdin.flush()
            self.format_key = key
            ready, _, _ = select.select([self.process.stdout], [], [], CHUNK_TIMEOUT_S)
            if not ready:
                raise TimeoutError(f"no answer in {CHUNK_TIMEOUT_S:.0f} s")
            status, value = pickle.load(self.process.stdout)
        except (OSError, EOFError, pickle.UnpicklingError, TimeoutError) as exc:
            self.stop()
            raise WorkerFailed(f"render worker {self.process.pid}: {type(exc).__name__}: {exc}") from exc
        if status == "error":
            raise value
        return value

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive:
            self.process.kill()
        self.process.wait()


class RowRenderer:
    """`rows(...)`: `trajectory_rows` of each trajectory (rendered turns allowed), on several cores."""

    def __init__(self) -> None:
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()  # one call at a time uses the workers

    def rows(
        self, trajectories: list[Trajectory], chat_format: ChatFormat, kwargs: dict[str, Any], workers: int
    ) -> list[list[Row]]:
        """Blocking: call it from a thread of its own (with a chat format no other thread uses) where
        `parallel(len(trajectories), workers)`, else on any thread."""
        if not self.parallel(len(trajectories), workers):
            return [trajectory_rows(t, i, chat_format, True, kwargs) for i, t in enumerate(trajectories)]
        with self._lock:
            return self._shared_out(trajectories, chat_format, kwargs, self._started(workers))

    @staticmethod
    def parallel(count: int, workers: int) -> bool:
        return workers > 0 and count >= PARALLEL_FROM

    def _started(self, count: int) -> list[_Worker]:
        self._workers = [w for w in self._workers if w.alive]
        while len(self._workers) < count:
            self._workers.append(_Worker())
        return self._workers[:count]

    def _shared_out(
        self, trajectories: list[Trajectory], fmt: ChatFormat, kwargs: dict[str, Any], workers: list[_Worker]
    ) -> list[list[Row]]:
        blob = pickle.dumps(fmt)
        key = hashlib.sha256(blob).hexdigest()
        n = len(trajectories)
        size = max(16, min(128, n // (8 * (len(workers) + 1))))
        chunks = deque(range(0, n, size))  # chunk starts: workers take from the front, this thread the back
        done: dict[int, list[list[Row]]] = {}
        errors: list[BaseException] = []
        lock = threading.Lock()

        def take(front: bool) -> int | None:
            with lock:
                if errors or not chunks:
                    return None
                return chunks.popleft() if front else chunks.pop()

        def feed(worker: _Worker) -> None:
            while (start := take(front=True)) is not None:
                try:
                    done[start] = worker.render(key, blob, trajectories[start : start + size], start, kwargs)
                except WorkerFailed as exc:
                    log.warning("%s; its trajectories are rendered in the training process", exc)
                    with lock:
                        chunks.appendleft(start)
                    return
                except BaseException as exc:
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=feed, args=(w,), daemon=True) for w in workers]
        for thread in threads:
            thread.start()
        try:
            for _ in range(2):  # (the second pass: chunks handed back by a worker that failed meanwhile)
                while (start := take(front=False)) is not None:
                    part = trajectories[start : start + size]
                    done[start] = [
                        trajectory_rows(t, start + i, fmt, True, kwargs) for i, t in enumerate(part)
                    ]
                _join(threads, workers)
        except BaseException as exc:
            errors.append(exc)
            _join(threads, workers)
        if errors:
            raise errors[0]
        return [rows for start in sorted(done) for rows in done[start]]

    def close(self) -> None:
        """Stop the workers (each ends at the end of its input)."""
        workers, self._workers = self._workers, []
        for worker in workers:
            if worker.process.stdin is not None:
                worker.process.stdin.close()
        for worker in workers:
            try:
                worker.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.stop()


async def sft_rows(
    renderer: RowRenderer, chat_format: ChatFormat, trajectories: list[Trajectory], config: SFTConfig
) -> list[list[Row]]:
    """Each trajectory's rows for `train_sft`; a large call on several cores and off the event loop (with
    its own copy of the tokenizer), a small one right here."""
    from artrl.local.service import to_thread_to_the_end

    workers = default_workers() if config.render_workers is None else config.render_workers
    kwargs = config.chat_template_kwargs
    if not RowRenderer.parallel(len(trajectories), workers):
        return renderer.rows(trajectories, chat_format, kwargs, 0)
    fmt = await asyncio.to_thread(chat_format.clone)
    return await to_thread_to_the_end(renderer.rows, trajectories, fmt, kwargs, workers)


def _join(threads: list[threading.Thread], workers: list[_Worker]) -> None:
    """Wait for the feeding threads; a worker that keeps one waiting past the timeout is stopped (its chunk
    then goes back to the queue)."""
    for thread, worker in zip(threads, workers, strict=True):
        thread.join(CHUNK_TIMEOUT_S)
        if thread.is_alive():
            worker.stop()
            thread.join()
