"""A Python child process spoken to over two pipes of pickles (`multiprocessing.connection.Connection` on
`os.pipe`): the trainer ranks and the service process. A plain `python -m`, never a `multiprocessing` start
method, which would re-run a user's unguarded script."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any


def start_piped(module: str, **popen: Any) -> tuple[subprocess.Popen, Connection, Connection]:
    """`python -m module READ_FD WRITE_FD` (`popen`: more Popen arguments); returns the process, the
    connection to write to it and the one to read from it. The child's ends are closed here."""
    to_child, child_reads = os.pipe()[::-1]  # (write end, read end)
    parent_reads, child_writes = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", module, str(child_reads), str(child_writes)],
            pass_fds=(child_reads, child_writes),
            **popen,
        )
    except BaseException:
        for fd in (to_child, child_reads, parent_reads, child_writes):
            os.close(fd)
        raise
    os.close(child_reads)
    os.close(child_writes)
    return process, Connection(to_child, readable=False), Connection(parent_reads, writable=False)
