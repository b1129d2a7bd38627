"""Training rows of many conversations given as plain messages, rendered on several cores.

`train_sft` turns each conversation into rows turn by turn through the chat template (`rows.rendered_rows`):
pure Python, ~2 ms a conversation, on one core (4096 conversations: ~7 s before the first optimizer step).
From PARALLEL_FROM trajectories on, `RowRenderer` shares them out in chunks between a thread of this process
and worker processes (`render_worker.py`), started on first use and kept until the backend closes (a start
costs ~2 s of imports). The rows are those a single thread renders, in the same order: every chunk goes
through the same function. A worker that fails or stops answering is stopped; its chunk is rendered here.
"""

from __future__ import annotations

import contextlib
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
from artrl.local.train.rows import Row, trajectory_rows
from artrl.trajectory import Trajectory

log = logging.getLogger(__name__)

PARALLEL_FROM = 256  # trajectories; fewer are rendered on the caller's thread (a worker would not pay off)
MAX_WORKERS = 4
CHUNK_TIMEOUT_S = 600.0  # one chunk's answer (~0.2 s of work; the first one includes the worker's start)


def default_workers() -> int:
    """One worker per CPU this process may use beyond the first, at most MAX_WORKERS (none on one CPU)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity on this platform)
        cpus = os.cpu_count() or 1
    return max(0, min(MAX_WORKERS, cpus - 1))


class WorkerFailed(RuntimeError):
    """A render worker could not do a chunk: it died, sent something unreadable, did not answer in time, or
    could not load the chat format or the request. The chunk is rendered in this process instead."""


class FormatUnloadable(WorkerFailed):
    """The worker cannot load this chat format (a tokenizer class it cannot import): it stays usable."""


class Unshippable(WorkerFailed):
    """These trajectories do not pickle (objects in their metadata): the worker stays usable."""


class _Worker:
    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.process = subprocess.Popen(
            self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self.format_key: str | None = None  # the chat format the worker holds (after an answer that says so)

    def command(self) -> list[str]:
        # artrl from wherever this process has it: appended, so that an installed package's folder does not
        # come before the standard library
        source = str(Path(__file__).resolve().parents[3])
        code = f"import sys; sys.path.append({source!r}); from artrl.local.train.render_worker import main; main()"
        return [sys.executable, "-c", code]

    def render(
        self, key: str, blob: bytes, trajectories: list[Trajectory], start: int, kwargs: dict[str, Any]
    ) -> list[list[Row]]:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:  # (in memory first: a request that does not pickle never leaves half of itself in the pipe)
            request = pickle.dumps(
                (key, None if key == self.format_key else blob, trajectories, start, kwargs)
            )
        except Exception as exc:
            raise Unshippable(f"these trajectories cannot be sent to a render worker: {exc}") from exc
        try:
            self.process.stdin.write(request)
            self.process.stdin.flush()
            answer = select.poll()
            answer.register(self.process.stdout, select.POLLIN)
            if not answer.poll(CHUNK_TIMEOUT_S * 1000):
                raise TimeoutError(f"no answer in {CHUNK_TIMEOUT_S:.0f} s")
            status, value, detail = pickle.load(self.process.stdout)
        except Exception as exc:  # (a dead or closed pipe, a reply that does not unpickle, the timeout)
            self.stop()
            raise WorkerFailed(f"render worker {self.process.pid}: {type(exc).__name__}: {exc}") from exc
        if status == "no format":
            raise FormatUnloadable(f"render worker {self.process.pid} cannot load the chat format: {detail}")
        self.format_key = key
        if status == "error":
            value.add_note(f"(raised in render worker {self.process.pid}:)\n{detail}")
            raise value
        return value

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


class RowRenderer:
    """`rows(...)`: `trajectory_rows` of each trajectory (rendered turns allowed), on several cores."""

    def __init__(self) -> None:
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()  # one call at a time uses the workers
        self._unloadable: set[str] = set()  # chat formats a worker could not load (rendered here)

    def rows(
        self, trajectories: list[Trajectory], chat_format: ChatFormat, kwargs: dict[str, Any], workers: int
    ) -> list[list[Row]]:
        """Blocking: call it from a thread of its own (with a chat format no other thread uses) where
        `parallel(len(trajectories), workers)`, else on any thread."""
        if self.parallel(len(trajectories), workers):
            try:
                blob = pickle.dumps(chat_format)
            except Exception as exc:  # (a tokenizer that does not pickle)
                log.warning("the chat format cannot be sent to render workers (%s); rendering here", exc)
            else:
                key = hashlib.sha256(blob).hexdigest()
                if key not in self._unloadable:
                    with self._lock:
                        return self._shared_out(trajectories, chat_format, kwargs, key, blob, workers)
        return [trajectory_rows(t, i, chat_format, True, kwargs) for i, t in enumerate(trajectories)]

    @staticmethod
    def parallel(count: int, workers: int) -> bool:
        return workers > 0 and count >= PARALLEL_FROM

    def _started(self, count: int) -> list[_Worker]:
        self._workers = [w for w in self._workers if w.alive]
        while len(self._workers) < count:
            try:
                self._workers.append(_Worker())
            except OSError as exc:
                log.warning("a render worker could not start (%s); rendering with fewer", exc)
                break
        return self._workers[:count]

    def _shared_out(
        self,
        trajectories: list[Trajectory],
        fmt: ChatFormat,
        kwargs: dict[str, Any],
        key: str,
        blob: bytes,
        count: int,
    ) -> list[list[Row]]:
        workers = self._started(count)
        n = len(trajectories)
        size = max(16, min(128, n // (8 * (len(workers) + 1))))
        chunks = deque(range(0, n, size))  # chunk starts: workers take from the front, this thread the back
        done: dict[int, list[list[Row]]] = {}
        errors: list[tuple[int, BaseException]] = []  # (chunk start, what rendering it raised)
        lock = threading.Lock()

        here: list[int] = []  # chunks a worker handed back: this thread renders them

        def take(front: bool) -> int | None:
            with lock:
                if errors:
                    return None
                if not front and here:
                    return here.pop()
                if not chunks:
                    return None
                return chunks.popleft() if front else chunks.pop()

        def feed(worker: _Worker) -> None:
            while (start := take(front=True)) is not None:
                try:
                    done[start] = worker.render(key, blob, trajectories[start : start + size], start, kwargs)
                except WorkerFailed as exc:
                    log.warning("%s; its trajectories are rendered in the training process", exc)
                    with lock:
                        here.append(start)
                    if isinstance(exc, FormatUnloadable):
                        self._unloadable.add(key)
                    if not isinstance(exc, Unshippable):
                        return
                except BaseException as exc:
                    errors.append((start, exc))
                    return

        threads = [threading.Thread(target=feed, args=(w,), daemon=True) for w in workers]
        for thread in threads:
            thread.start()
        try:
            for _ in range(2):  # (the second pass: chunks handed back by a worker that failed meanwhile)
                while (start := take(front=False)) is not None:
                    try:
                        part = trajectories[start : start + size]
                        done[start] = [
                            trajectory_rows(t, start + i, fmt, True, kwargs) for i, t in enumerate(part)
                        ]
                    except Exception as exc:
                        errors.append((start, exc))
                _join(threads, workers)
        except BaseException:  # (KeyboardInterrupt: the feeding threads end with their chunk)
            with lock:
                chunks.clear()
                here.clear()
            _join(threads, workers)
            raise
        if errors:
            raise min(errors, key=lambda e: e[0])[1]  # (the earliest trajectory's, as one thread would raise)
        return [rows for start in sorted(done) for rows in done[start]]

    def close(self) -> None:
        """Stop the workers (each ends at the end of its input), after a render in flight."""
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            if worker.process.stdin is not None:
                with contextlib.suppress(OSError):
                    worker.process.stdin.close()
        for worker in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=5)
            worker.stop()


async def sft_rows(
    renderer: RowRenderer, chat_format: ChatFormat, trajectories: list[Trajectory], config: SFTConfig
) -> list[list[Row]]:
    """Each trajectory's rows for `train_sft`; a large call on several cores and off the event loop, a small
    one right here. `chat_format`: training's own (`LocalService.train_format`), never the gateway's, whose
    tokenizer decodes on the gateway's thread meanwhile (a fast tokenizer is not for two threads at once)."""
    from artrl.local.concurrency.shielded import to_thread_to_the_end

    workers = default_workers() if config.render_workers is None else config.render_workers
    kwargs = config.chat_template_kwargs
    if not RowRenderer.parallel(len(trajectories), workers):
        return renderer.rows(trajectories, chat_format, kwargs, 0)
    # (its thread has the format alone: the caller holds the training lock until that thread ends)
    return await to_thread_to_the_end(renderer.rows, trajectories, chat_format, kwargs, workers)


def _join(threads: list[threading.Thread], workers: list[_Worker]) -> None:
    """Wait for the feeding threads; a worker that keeps one waiting past the timeout is stopped (its chunk
    then goes back to the queue)."""
    for thread, worker in zip(threads, workers, strict=True):
        thread.join(CHUNK_TIMEOUT_S)
        if thread.is_alive():
            worker.stop()
            thread.join()
