"""A long training call's answer as NDJSON lines: its progress (queued, training with rows done of its
rows, saving) whenever it changes and at least every `HEARTBEAT_S` seconds (so the client, and any proxy
between, sees the connection alive however long the call waits or trains), then its result or its error.
A client that goes away leaves the call running (with a request id, its resend streams it on)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from artrl.local.server.refusals import Refused
from artrl.local.train.progress import TrainProgress

log = logging.getLogger(__name__)

POLL_S, HEARTBEAT_S = 0.25, 5.0


def _line(message: dict[str, Any]) -> bytes:
    return (json.dumps(message) + "\n").encode()


def started(answer: Awaitable[Any]) -> asyncio.Future:
    """The call, running from now on whatever becomes of its stream (its outcome retrieved once it ends)."""
    task = asyncio.ensure_future(answer)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


async def progress_lines(task: asyncio.Future, progress: TrainProgress) -> AsyncIterator[bytes]:
    """The lines of `task` (see `started`): never cancelled by the stream's end."""
    last: dict[str, Any] | None = None
    sent = 0.0
    while not task.done():
        await asyncio.wait([task], timeout=POLL_S)
        now = progress.snapshot()
        if task.done():
            break
        if now != last or time.monotonic() - sent >= HEARTBEAT_S:
            yield _line({"progress": now})
            last, sent = now, time.monotonic()
    try:
        result = task.result()
    except Refused as exc:
        yield _line({"error": {"status": exc.status, "message": str(exc), "code": exc.code}})
        return
    except Exception as exc:
        log.exception("training server: a streamed call failed")
        message = f"internal error ({type(exc).__name__}: {exc}); see the server's log"
        yield _line({"error": {"status": 500, "message": message, "code": "internal_error"}})
        return
    yield _line({"result": result.model_dump(mode="json") if hasattr(result, "model_dump") else result})
