"""The step files the dashboard parsed last: each click on a trajectory would otherwise parse its whole step
file (every group's trajectories, and the step's gzipped rows) again, to show one of them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

STEP_FILES_KEPT = 8  # parsed step files held (a step's trajectories and its rows: one click needs both)


class ParsedFiles:
    """The last `kept` files parsed, keyed by (path, mtime_ns, size): a file rewritten since (a running
    training appends a step's groups) is parsed again. What it returns is shared: read it, never change it."""

    def __init__(self, kept: int = STEP_FILES_KEPT) -> None:
        self._kept = kept
        self._parsed: OrderedDict[tuple[Path, int, int], Any] = OrderedDict()
        self._lock = threading.Lock()  # the API's requests run on worker threads

    def get(self, path: Path, parse: Callable[[Path], Any]) -> Any:
        try:
            stat = path.stat()
        except OSError:  # not there (yet): `parse` says what that means, nothing is kept
            return parse(path)
        key = (path, stat.st_mtime_ns, stat.st_size)
        with self._lock:
            if key in self._parsed:
                self._parsed.move_to_end(key)
                return self._parsed[key]
        parsed = parse(path)  # (outside the lock: a slow parse holds up no other file's reader)
        with self._lock:
            # an older version of the file is never asked for again
            for old in [k for k in self._parsed if k[0] == path]:
                del self._parsed[old]
            self._parsed[key] = parsed
            while len(self._parsed) > self._kept:
                self._parsed.popitem(last=False)
        return parsed


STEP_FILES = ParsedFiles()
