"""At most N calls of an async function at once, per key: ART's `limit_concurrency` decorator."""

from __future__ import annotations

import asyncio
import functools
import inspect
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def limit_concurrency(
    n: int, derive_key: Callable[..., Any] | None = None
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Decorate an async function so that at most `n` of its calls run at once; the others wait their turn.

    `derive_key(*args, **kwargs)` (called with the call's arguments) splits the limit: each key has its own
    `n` (ART·E: ``derive_key=lambda model, scenario, **kwargs: model.name``, n rollouts per model). Without
    it every call shares one limit. Limits belong to the running event loop, so a script that calls
    `asyncio.run` twice starts afresh.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"limit_concurrency needs n >= 1 (an int), got {n!r}")
    limits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, asyncio.Semaphore]] = (
        weakref.WeakKeyDictionary()
    )

    def decorate(func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        if not inspect.iscoroutinefunction(func):
            raise TypeError(f"limit_concurrency decorates async functions; {func!r} is not one")

        @functools.wraps(func)
        async def limited(*args: P.args, **kwargs: P.kwargs) -> R:
            key = derive_key(*args, **kwargs) if derive_key is not None else None
            semaphores = limits.setdefault(asyncio.get_running_loop(), {})
            semaphore = semaphores.get(key)
            if semaphore is None:
                semaphore = semaphores[key] = asyncio.Semaphore(n)
            async with semaphore:
                return await func(*args, **kwargs)

        return limited

    return decorate
