"""A serving gateway keeps what its process held at start out of Python's full collections (gc.freeze), and
the process's last gateway to stop hands it back (startup_heap.py)."""

from __future__ import annotations

import gc
import subprocess
import sys

from starlette.applications import Starlette

from artrl.config import GatewayConfig
from artrl.local.gateway import startup_heap
from artrl.local.gateway.server import GatewayServer


def started(**config) -> GatewayServer:
    server = GatewayServer(Starlette(), GatewayConfig(**config))
    server.start(30)
    return server


def test_gateways_freeze_the_startup_heap_until_the_last_one_stops():
    before = startup_heap._holders  # (another test's gateway may serve in this process)
    first, second = started(), started()
    try:
        assert startup_heap._holders == before + 2 and gc.get_freeze_count() > 0
        off = started(freeze_startup_heap=False)
        off.stop()
        assert startup_heap._holders == before + 2
    finally:
        first.stop()
        first.stop()  # (stopped twice: released once)
    assert startup_heap._holders == before + 1 and gc.get_freeze_count() > 0
    second.stop()
    assert startup_heap._holders == before
    if before == 0:
        assert gc.get_freeze_count() == 0  # (handed back to the collector)


def test_a_process_that_ends_with_a_gateway_serving_unfreezes_before_its_shutdown():
    """A program that never stops its gateway (a script that ends without closing its backend): the frozen
    objects go back to the collector at exit, before the interpreter tears its modules down (left frozen, a
    ported ART example crashed there about every other run)."""
    code = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"  # (runs after artrl's)
        "from starlette.applications import Starlette\n"
        "from artrl.config import GatewayConfig\n"
        "from artrl.local.gateway.server import GatewayServer\n"
        "GatewayServer(Starlette(), GatewayConfig()).start(30)\n"
        "print('serving, frozen:', gc.get_freeze_count() > 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "serving, frozen: True" in done.stdout and "frozen at exit: 0" in done.stdout, done.stdout
