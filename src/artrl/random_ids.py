"""Random identifiers (completion, call and capture ids) without a system call each.

`uuid.uuid4()` reads the operating system's random source: a system call that releases the interpreter lock,
and a thread of the gateway or of the agent then waits for the engine thread to hand the lock back (up to
the 5 ms switch interval) before it goes on. These ids need to be unique, not unpredictable: a generator
seeded once from the OS (again in a forked child) makes them without leaving the interpreter.
"""

from __future__ import annotations

import os
import random

_source = random.Random(os.urandom(32))


def _reseed() -> None:
    _source.seed(os.urandom(32))


os.register_at_fork(after_in_child=_reseed)  # (a forked child must not repeat its parent's ids)


def random_hex(digits: int = 32) -> str:
    """`digits` random hexadecimal digits (32: as many bits as a uuid4)."""
    return f"{_source.getrandbits(4 * digits):0{digits}x}"
