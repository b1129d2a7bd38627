"""The artrl service process (`python -m artrl.local.backend.service_child READ_FD WRITE_FD`): an ordinary
`ModelsHere` (the in-process mode) that `LocalBackend(in_process=False)` drives over two pipes (the frames: local/backend/service_process.py).

It ends when the user's process asks it to, or when that process is gone (its pipe closes): every model's
engine, gateway and trainer is closed first, as `LocalBackend.close` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import pickle
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

from artrl.local.backend.models_here import ModelsHere
from artrl.local.gateway.in_process import AppLink, AppSide
from artrl.model import TrainableModel

log = logging.getLogger(__name__)
METHODS = ("register", "train", "train_sft", "log", "export", "delete_checkpoints", "close")


class _Child:
    def __init__(self, outbox: Connection) -> None:
        self._outbox, self._lock = outbox, threading.Lock()
        self.backend: ModelsHere | None = None
        self.models: dict[tuple[str, str], TrainableModel] = {}
        self.incoming: dict[int, tuple[_Incoming, AppLink]] = {}  # requests the gateway is answering

    def send(self, frame: tuple) -> None:
        """One frame to the user's process (any thread); raises only when `frame` does not pickle."""
        data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock, contextlib.suppress(OSError):  # (that process is gone: nobody to tell)
            self._outbox.send_bytes(data)

    async def serve(self, inbox: Connection) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, settings = pickle.loads(await loop.run_in_executor(None, inbox.recv_bytes))
        except (EOFError, OSError):
            return
        self.backend = ModelsHere(**settings)
        # the engine, gateway and trainer modules (torch, transformers: seconds) imported before the first
        # register asks for them (the import lock makes that one wait for this import, not start another)
        threading.Thread(
            target=importlib.import_module, args=("artrl.local.service.service",), daemon=True
        ).start()
        stop = asyncio.Event()
        reader = threading.Thread(target=self._read, args=(inbox, loop, stop), name="artrl-service-reader")
        reader.daemon = True
        reader.start()
        try:
            await stop.wait()
        finally:
            await self.backend.close()

    def _read(self, inbox: Connection, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        """The frames of the user's process, until it asks this one to exit or is gone. One that cannot be
        read or handled ends this process as its exit does (the frames after it could be anyone's): every
        model closed, then the pipes, which fails everything in flight there."""
        while True:
            try:
                data = inbox.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                frame = pickle.loads(data)
                if frame[0] == "exit":
                    break
                self._handle(frame, loop)
            except BaseException:
                log.error(
                    "a frame from the user's process could not be read: the artrl service process ends",
                    exc_info=True,
                )
                break
        inbox.close()
        loop.call_soon_threadsafe(stop.set)

    def _handle(self, frame: tuple, loop: asyncio.AbstractEventLoop) -> None:
        kind = frame[0]
        if kind == "call":
            asyncio.run_coroutine_threadsafe(self._call(*frame[1:]), loop)
        elif kind == "http":
            self._http(*frame[1:])
        elif kind == "gone":
            entry = self.incoming.get(frame[1])  # (None: its answer ended meanwhile, on the loop)
            if entry is not None:
                entry[1].disconnect(entry[0])
        else:
            raise ValueError(f"a frame of unknown kind {kind!r}")

    async def _call(self, cid: int, method: str, blob: bytes) -> None:
        try:
            try:
                args = pickle.loads(blob)
            except Exception as exc:
                raise RuntimeError(
                    f"the arguments of {method}() could not be read in the artrl service process: {exc}. "
                    "Objects of classes defined in the script you run (__main__) cannot be sent to it: define "
                    "them in a module of their own, or use LocalBackend(in_process=True)"
                ) from None
            value = await self._run(method, args)
            self.send(("result", cid, True, value))
        except BaseException as exc:  # (a result that does not pickle lands here too)
            text = "".join(traceback.format_exception(exc))
            try:
                pickled: bytes | None = pickle.dumps(exc)
            except Exception:
                pickled = None
            self.send(("result", cid, False, (pickled, text)))

    async def _run(self, method: str, args: tuple) -> Any:
        backend = self.backend
        assert backend is not None
        if method not in METHODS:
            raise ValueError(f"the artrl service process has no method {method!r}")
        if method == "close":
            return await backend.close()
        model = TrainableModel.model_validate(args[0])
        if method == "register":
            base_url, api_key = await backend.register(model)
            self.models[(model.project, model.name)] = model
            server = backend.service(model).server
            return base_url, api_key, (server.host, server.port)
        return await getattr(backend, method)(model, *args[1:])

    def _http(self, xid: int, key: tuple[str, str], scope: dict[str, Any], body: bytes) -> None:
        model = self.models.get(key)
        backend = self.backend
        if model is None or backend is None or not backend.registered(model):
            self.send(("end", xid, f"model {key[1]!r} is not served by this artrl service process"))
            return
        link = backend.service(model).server.link
        incoming = _Incoming(self, xid, body)
        self.incoming[xid] = (incoming, link)
        failure = link.start(incoming, scope)
        if failure is not None:
            incoming.abandon(failure)


class _Incoming(AppSide):
    """One request from the user's process, run by the gateway app on its loop; its answer goes back as
    frames (one `whole` frame when it comes in one piece)."""

    def __init__(self, child: _Child, xid: int, body: bytes) -> None:
        super().__init__(body)
        self.child, self.xid = child, xid
        self.head: tuple[int, list] | None = None  # the response's start, held until its first body part

    def deliver(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
            self.head = (message["status"], headers)
        elif message["type"] == "http.response.body":
            body, more = bytes(message.get("body", b"")), message.get("more_body", False)
            self.complete = not more
            if self.head is not None and not more:
                self.child.send(("whole", self.xid, *self.head, body))
            else:
                if self.head is not None:
                    self.child.send(("start", self.xid, *self.head))
                self.child.send(("body", self.xid, body, more))
            self.head = None

    def ended(self, error: str | None, cancelled: bool = False) -> None:
        self.child.incoming.pop(self.xid, None)
        if cancelled or error is not None or not self.complete:
            self.child.send(("end", self.xid, "cancelled" if cancelled else error))

    def abandon(self, message: str) -> None:
        if not self.complete:
            self.ended(message)


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s [artrl service] %(name)s: %(message)s")
    inbox = Connection(int(argv[1]), writable=False)
    outbox = Connection(int(argv[2]), readable=False)
    asyncio.run(_Child(outbox).serve(inbox))


if __name__ == "__main__":
    main(sys.argv)
