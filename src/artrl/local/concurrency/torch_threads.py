"""torch's intra-op thread count, which the embedded engine changes on its own thread for generation
(`EngineConfig.generation_threads`). `torch.set_num_threads` also sets the count that threads started later
take at their first torch operation, so every thread that trains sets the default back itself."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


@functools.cache
def default_threads() -> int:
    """torch's thread count as this process started: read by the first engine's constructor, before any
    engine thread changed it."""
    return torch.get_num_threads()


def with_default_threads(fn: Callable[[], T]) -> Callable[[], T]:
    """fn, run with torch's default thread count on whatever thread calls it."""

    def run() -> T:
        torch.set_num_threads(default_threads())
        return fn()

    return run
