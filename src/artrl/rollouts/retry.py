"""Retrying a flaky call (a model request, a tool, a judge) with exponential backoff, sync or async."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar, overload

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

OnRetry = Callable[..., None]
"""Called before each wait: (the attempt that failed, counting from 1, its exception, the delay in seconds);
a callback of two parameters is called as ART calls its own, (the exception, the attempt)."""

# Never retried, whatever `exceptions` says: they mean "stop", not "try again".
_NEVER_RETRIED = (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)


def backoff_delay(
    attempt: int,
    *,
    initial_delay: float = 0.5,
    max_delay: float = 30.0,
    backoff: float = 2.0,
    jitter: float = 0.1,
    rng: random.Random | None = None,
) -> float:
    """The wait after failed attempt number `attempt` (from 1): ``initial_delay * backoff**(attempt-1)``,
    at most `max_delay`, then scaled by a random factor in ``[1 - jitter, 1 + jitter]``."""
    delay = min(max_delay, initial_delay * backoff ** (attempt - 1))
    if jitter:
        delay *= 1 + (rng or random).uniform(-jitter, jitter)
    return max(0.0, delay)


@overload
def retry(fn: F, /) -> F: ...
@overload
def retry(
    fn: None = None,
    /,
    *,
    max_attempts: int = 3,
    initial_delay: float = 0.5,
    max_delay: float = 30.0,
    backoff: float = 2.0,
    exceptions: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
    jitter: float = 0.1,
    on_retry: OnRetry | None = None,
    delay: float | None = None,
    backoff_factor: float | None = None,
) -> Callable[[F], F]: ...
def retry(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    max_attempts: int = 3,
    initial_delay: float = 0.5,
    max_delay: float = 30.0,
    backoff: float = 2.0,
    exceptions: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
    jitter: float = 0.1,
    on_retry: OnRetry | None = None,
    delay: float | None = None,
    backoff_factor: float | None = None,
) -> Any:
    """Decorate a function (``async def`` or plain) to call it again when it raises.

    ``@artrl.retry`` or ``@artrl.retry(max_attempts=5, exceptions=(httpx.HTTPError,))``. The function is
    called at most `max_attempts` times; after failed attempt k it waits
    ``min(max_delay, initial_delay * backoff**(k-1))`` seconds, times a random factor in
    ``[1 - jitter, 1 + jitter]`` (`asyncio.sleep` for coroutine functions, `time.sleep` otherwise). Only
    exceptions that are instances of `exceptions` are retried: any other propagates at once, as do
    cancellation, KeyboardInterrupt and SystemExit. When every attempt fails, the last exception is
    re-raised. `on_retry(attempt, exception, delay)` is called before each wait (each retry is also logged
    at WARNING on the ``artrl.rollouts.retry`` logger); one of two parameters as ART's, `on_retry(exception,
    attempt)`. ART's names `delay` and `backoff_factor` are `initial_delay` and `backoff`.
    """
    initial_delay = initial_delay if delay is None else delay
    backoff = backoff if backoff_factor is None else backoff_factor
    art_order = on_retry is not None and _positional_parameters(on_retry) == 2
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    if initial_delay < 0 or max_delay < 0:
        raise ValueError(f"delays must be >= 0, got initial_delay={initial_delay}, max_delay={max_delay}")
    if backoff < 1:
        raise ValueError(f"backoff must be >= 1, got {backoff}")
    if not 0 <= jitter <= 1:
        raise ValueError(f"jitter must be in [0, 1], got {jitter}")
    retried = exceptions if isinstance(exceptions, tuple) else (exceptions,)
    if not retried or not all(isinstance(e, type) and issubclass(e, BaseException) for e in retried):
        raise TypeError(f"exceptions must be an exception class or a tuple of them, got {exceptions!r}")

    def delay_after(attempt: int) -> float:
        return backoff_delay(
            attempt, initial_delay=initial_delay, max_delay=max_delay, backoff=backoff, jitter=jitter
        )

    def should_retry(exc: BaseException, attempt: int) -> bool:
        return attempt < max_attempts and isinstance(exc, retried) and not isinstance(exc, _NEVER_RETRIED)

    def announce(name: str, attempt: int, exc: BaseException, delay: float) -> None:
        log.warning(
            "%s failed (attempt %d of %d: %s: %s); retrying in %.2fs",
            name,
            attempt,
            max_attempts,
            type(exc).__name__,
            exc,
            delay,
        )
        if on_retry is not None:
            on_retry(exc, attempt) if art_order else on_retry(attempt, exc, delay)

    def decorate(func: F) -> F:
        if not callable(func):
            raise TypeError(f"retry decorates a function, got {type(func).__name__}")
        if inspect.isasyncgenfunction(func) or inspect.isgeneratorfunction(func):
            raise TypeError("retry cannot decorate a generator function")
        name = getattr(func, "__qualname__", repr(func))

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                attempt = 1
                while True:
                    try:
                        return await func(*args, **kwargs)
                    except BaseException as exc:
                        if not should_retry(exc, attempt):
                            raise
                        delay = delay_after(attempt)
                        announce(name, attempt, exc, delay)
                    await asyncio.sleep(delay)
                    attempt += 1

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            attempt = 1
            while True:
                try:
                    return func(*args, **kwargs)
                except BaseException as exc:
                    if not should_retry(exc, attempt):
                        raise
                    delay = delay_after(attempt)
                    announce(name, attempt, exc, delay)
                time.sleep(delay)
                attempt += 1

        return sync_wrapper  # type: ignore[return-value]

    if fn is not None:
        return decorate(fn)  # type: ignore[arg-type]
    return decorate


def _positional_parameters(fn: Callable[..., Any]) -> int | None:
    """How many positional parameters `fn` takes (None: unknown, or any number)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
