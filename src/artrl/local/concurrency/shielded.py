"""Work that a cancelled caller still waits for: a training step, its checkpoint and its record are done whole
(stdlib only, so the user's process of `LocalBackend(in_process=False)` needs no torch for it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


async def to_the_end(work: Awaitable[T]) -> T:
    """`await work`, except that a cancelled caller still waits for `work` to end before it is cancelled:
    what the caller holds (the backend's train lock) stays held, and `work` (a training step, then its
    checkpoint and record) is done whole."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:  # (retrieved: no "never retrieved" log)
            log.warning("a cancelled training call failed afterwards: %s", task.exception())
        raise


async def to_thread_to_the_end(fn: Callable[..., T], *args: Any) -> T:
    """`asyncio.to_thread(fn, *args)` run to its end even when the caller is cancelled (see to_the_end)."""
    return await to_the_end(asyncio.to_thread(fn, *args))
