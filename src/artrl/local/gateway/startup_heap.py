"""The heap a process holds when its gateway starts, kept out of Python's full collections while it serves.

A process that serves a model holds hundreds of thousands of objects it built before and keeps (the modules
of transformers and torch, the tokenizer, the model's Python objects: ~550,000 in the process of
bench_gateway_cpu.py). Python's cyclic collector walks every one of them at each full (generation 2)
collection, which the gateway's own allocations trigger every few dozen calls: 0.6 ms of CPU a call on the
vLLM path, measured there (against 0.04 ms with the heap frozen). `gc.freeze()` moves them to a permanent
generation the collector skips, as vLLM's own server does once it has started. Frozen objects are still freed
by reference counting; only cyclic garbage among them waits, until the process's last gateway stops and
`gc.unfreeze()` hands them back to the collector, or the interpreter exits (a program that never closes its
backend: with its objects still frozen at shutdown, CPython 3.11 crashed a ported ART example about every
other run). GatewayConfig.freeze_startup_heap turns this off.
"""

from __future__ import annotations

import atexit
import gc
import threading

_lock = threading.Lock()
_holders = 0  # gateways of this process that hold the heap frozen
_frozen_by_others = False  # objects were frozen before the first hold (by the program): never unfrozen here


def hold() -> None:
    """A gateway starts serving: what the process holds now is frozen, its garbage collected first (cheap
    once the rest is frozen: frozen objects are not walked)."""
    global _holders, _frozen_by_others
    with _lock:
        if _holders == 0:
            _frozen_by_others = gc.get_freeze_count() > 0
        _holders += 1
        gc.collect()  # (so that no garbage alive now is frozen with the rest)
        gc.freeze()  # (another gateway: its model's objects join the frozen ones)


def release() -> None:
    """A gateway stopped: the last one hands the frozen objects back to the collector (unless the program had
    frozen some itself: `gc.unfreeze` cannot tell whose they are)."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and not _frozen_by_others:
            gc.unfreeze()


def _at_exit() -> None:
    """The interpreter ends with a gateway still serving (never stopped): the frozen objects go back to the
    collector before the interpreter tears its modules down (with them still frozen, it crashed at exit)."""
    global _holders
    with _lock:
        if _holders and not _frozen_by_others:
            _holders = 0
            gc.unfreeze()


atexit.register(_at_exit)  # (a no-op unless a gateway still holds the heap)
