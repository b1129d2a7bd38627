"""Running the gateway: uvicorn in its own thread and event loop, on a socket bound before start.

A thread of its own keeps the gateway answering even while the caller's event loop is busy or blocked
(for example in a synchronous OpenAI client call made from async code).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from artrl.config import GatewayConfig
from artrl.local.gateway import startup_heap
from artrl.local.gateway.in_process import AppLink, Exchanges, link_transport


class GatewayServer:
    def __init__(self, app, config: GatewayConfig) -> None:
        self._app = app
        self._freeze, self._frozen = config.freeze_startup_heap, False
        self._lock = threading.Lock()  # (two stops release the heap once)
        host, port, keep_alive_s = config.host, config.port, config.keep_alive_s
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=keep_alive_s,
        )
        self._server = uvicorn.Server(config)
        self._exchanges = Exchanges()  # requests from in-process clients (see transport)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="artrl-gateway", daemon=True
        )

    @property
    def keep_alive_s(self) -> float:
        return self._server.config.timeout_keep_alive

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout_s: float) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the gateway server stopped during start-up (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway did not start within {timeout_s} s")
            time.sleep(0.01)
        # requests from this process's transports, and from the service process's pipe (service_child)
        self.link = AppLink(self._app, self._server.servers[0].get_loop(), self._exchanges)
        if self._freeze:  # (startup_heap.py: what the process built so far, out of full collections)
            startup_heap.hold()
            self._frozen = True

    def transport(self, sync: bool = False, httpx: Any = None):
        """An httpx transport to this gateway from the same process, without a socket (see in_process);
        `sync` for a synchronous client, `httpx` the package of the client (None: openai's)."""
        return link_transport(self.link, self.host, self.port, sync, httpx)

    def stop(self, timeout_s: float = 10.0) -> None:
        try:
            self._server.should_exit = True
            self._thread.join(timeout_s)
            self._exchanges.close()  # in-process requests the stopped loop dropped fail now, new ones at once
            self._socket.close()
            preparing = getattr(self._app.state, "preparing", None)  # the gateway's prompt-building thread
            if preparing is not None:
                preparing.close()
        finally:
            with self._lock:
                frozen, self._frozen = self._frozen, False
            if frozen:
                startup_heap.release()
