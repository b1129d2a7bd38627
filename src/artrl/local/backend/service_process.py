"""The local service in a child process of its own: `LocalBackend(in_process=False)`, seen from the user's side.

The child (`artrl.local.backend.service_child`) runs the in-process mode (`ModelsHere`): engines, gateways and trainers, one
copy of the weights, as in one process. This process keeps the agents, their openai SDK calls and the user's
code, so that on a small machine the SDK's Python work runs beside the engine instead of taking turns with it
on one interpreter lock (benchmarks/TRIED.md). Between the two, two pipes of pickled
frames (`multiprocessing.connection.Connection` over `os.pipe`, as the trainer ranks use; no
`multiprocessing` start method, so a user's unguarded script is never re-run):

- calls: `("call", id, method, args)` → `("result", id, ok, value)`, the backend's methods (register, train,
  train_sft, log, export, delete_checkpoints, close) with the model sent as its settings;
- requests of `model.openai_client()`: the in-process transport's ASGI exchange (local/gateway/in_process.py) with the
  gateway across the pipe: `("http", id, model, scope, body)` → `("whole", id, status, headers, body)` for an
  answer in one piece, or `("start", ...)`, `("body", id, chunk, more)`; `("end", id, error)` when the app
  stopped without a complete answer; `("gone", id)` when the client went away. No HTTP on either side.

Clients built from `model.inference_base_url` reach the child's gateway over HTTP as usual. A child that
dies fails every call and request in flight at once with `ServiceProcessError`, which says so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import pickle
import subprocess
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from artrl.local.concurrency.piped_process import start_piped
from artrl.local.concurrency.shielded import to_the_end
from artrl.local.gateway.in_process import link_transport

if TYPE_CHECKING:
    from artrl.config import EngineConfig, GatewayConfig, TrainerConfig
    from artrl.model import TrainableModel

log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 120.0  # the child's close: engines, vLLM servers and trainer ranks stopped


class ServiceProcessError(RuntimeError):
    """The artrl service process is gone (it exited or was killed); what was in flight is lost with it."""


def model_settings(model: TrainableModel) -> dict[str, Any]:
    """What the child needs to know of a model (its handle holds this process's backend and clients)."""
    return model.model_dump()


class ServiceProcess:
    """One child process serving and training every model of one `LocalBackend(in_process=False)`."""

    def __init__(
        self, path: str, engine: EngineConfig, gateway: GatewayConfig, trainer: TrainerConfig
    ) -> None:
        self.gateway_config = gateway
        self._settings = {
            "path": path,
            "engine": engine,
            "gateway": gateway,
            "trainer": trainer,
        }  # (ModelsHere's)
        self._proc: subprocess.Popen | None = None
        self._out: Connection | None = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the tables below and `_dead`
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._exchanges: dict[int, Any] = {}
        self._ids = itertools.count()
        self._dead: str | None = None
        self._servers: dict[tuple[str, str], tuple[str, int]] = {}
        self.start()  # (its imports overlap whatever this process does before register)

    # -- the process

    def start(self) -> None:
        """Start the child and hand it the backend's settings (a few ms: it imports its modules meanwhile)."""
        package_root = str(Path(__file__).resolve().parents[3])  # (the folder that holds `artrl`)
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        self._proc, self._out, inbox = start_piped(
            "artrl.local.backend.service_child",
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": path},
            start_new_session=True,  # Ctrl-C stops the user's script, which then closes the child
        )
        threading.Thread(target=self._read, args=(inbox,), name="artrl-service-reader", daemon=True).start()
        self._send(("init", self._settings))

    def _send(self, frame: tuple) -> None:
        """One frame to the child (any thread). ServiceProcessError when it is gone; a frame that does not
        pickle raises its pickling error and sends nothing."""
        data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if self._dead is not None or self._out is None:
                raise ServiceProcessError(self._dead or "the artrl service process is not running")
            try:
                self._out.send_bytes(data)
            except OSError as exc:
                raise ServiceProcessError(f"the artrl service process is gone ({exc})") from None

    def _read(self, inbox: Connection) -> None:
        """The reader thread: answers and response messages to whoever waits for them. A frame it cannot
        read or deliver ends it as the child's exit does: every call and request in flight fails at once
        (the frames after it could be anyone's), and the child is stopped."""
        failure = None
        while True:
            try:
                data = inbox.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                self._dispatch(pickle.loads(data))
            except BaseException as exc:
                failure = f"{type(exc).__name__}: {exc}"
                log.error("a frame from the artrl service process could not be read", exc_info=True)
                break
        inbox.close()
        self._died(failure)

    def _dispatch(self, frame: tuple) -> None:
        kind, key = frame[0], frame[1]
        if kind == "result":
            with self._lock:
                future = self._calls.pop(key, None)
            if future is not None and not future.done():
                ok, value = frame[2], frame[3]
                with contextlib.suppress(concurrent.futures.InvalidStateError):  # (cancelled meanwhile)
                    future.set_result(value) if ok else future.set_exception(_remote_error(*value))
            return
        if kind not in ("whole", "start", "body", "end"):
            raise ValueError(f"a frame of unknown kind {kind!r}")
        with self._lock:
            exchange = self._exchanges.get(key)
            if kind == "end" or (kind == "whole") or (kind == "body" and not frame[3]):
                self._exchanges.pop(key, None)
        if exchange is None:
            return
        messages = []
        if kind in ("whole", "start"):
            messages.append({"type": "http.response.start", "status": frame[2], "headers": frame[3]})
        if kind == "whole":
            messages.append({"type": "http.response.body", "body": frame[4]})
        elif kind == "body":
            messages.append({"type": "http.response.body", "body": frame[2], "more_body": frame[3]})
        try:  # (the frame was read whole: a client that cannot take it fails alone)
            for message in messages:
                exchange.deliver(message)
            if kind == "end":
                exchange.ended(frame[2])
        except Exception:
            log.exception("a response could not be handed to its client")
            self.drop_exchange(key)
            with contextlib.suppress(ServiceProcessError, OSError):  # (the child stops generating it)
                self._send(("gone", key))
            with contextlib.suppress(Exception):
                exchange.abandon("the artrl gateway's answer could not be handed to this client")

    def _died(self, failure: str | None = None) -> None:
        """The child's pipe closed, or `failure` broke it: fail everything in flight, and everything asked
        from now on."""
        if failure is not None:
            message = (
                f"this process could not read what the artrl service process sent ({failure}): it is stopped, "
                "and whatever was in flight is lost; close this backend and register the models with a new one"
            )
            with self._send_lock:  # (its pipe closed: the child's reader ends it, its models closed)
                self._dead = message
                if self._out is not None:
                    self._out.close()
                    self._out = None
        else:
            code = None
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self._proc.wait(timeout=5)
            message = (
                f"the artrl service process exited (exit code {code}; its log is above, on this process's "
                "stderr)"
            )
        with self._lock, self._send_lock:
            self._dead = message
            calls, self._calls = list(self._calls.values()), {}
            exchanges, self._exchanges = list(self._exchanges.values()), {}
        for exchange in exchanges:  # (first: a call's caller, woken below, may look at its requests)
            with contextlib.suppress(Exception):  # (one caller's failure must not keep the others waiting)
                exchange.abandon(message)
        for future in calls:
            if not future.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_exception(ServiceProcessError(message))

    async def call(self, method: str, *args: Any) -> Any:
        """`method(*args)` of the child's backend; its result, or the exception it raised."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        cid = next(self._ids)
        with self._lock:
            self._calls[cid] = future
        try:
            self._send(("call", cid, method, pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)))
        except BaseException:
            with self._lock:
                self._calls.pop(cid, None)
            raise
        return await asyncio.wrap_future(future)

    # -- the backend's methods, for LocalBackend(in_process=False)

    async def register(self, model: TrainableModel) -> tuple[str, str]:
        base_url, api_key, server = await self.call("register", model_settings(model))
        self._servers[(model.project, model.name)] = server
        return base_url, api_key

    def registered(self, model: TrainableModel) -> bool:
        return (model.project, model.name) in self._servers

    def service(self, model: TrainableModel) -> Any:
        raise RuntimeError("this backend's services run in a child process (LocalBackend(in_process=False))")

    def client_transport(self, model: TrainableModel, sync: bool = False, httpx: Any = None) -> Any:
        """An httpx transport to the model's gateway in the child, over the pipe (None: not registered, or
        GatewayConfig(in_process_clients=False))."""
        key = (model.project, model.name)
        if key not in self._servers or not self.gateway_config.in_process_clients:
            return None
        return link_transport(_PipeLink(self, key), *self._servers[key], sync, httpx)

    # (the child finishes a training step whole even if this call is cancelled)
    async def train(self, model: TrainableModel, groups: list[Any], config: Any) -> Any:
        return await to_the_end(self.call("train", model_settings(model), groups, config))

    async def train_sft(self, model: TrainableModel, trajectories: list[Any], config: Any) -> Any:
        return await to_the_end(self.call("train_sft", model_settings(model), trajectories, config))

    async def export(self, model: TrainableModel, directory: str) -> None:
        return await self.call("export", model_settings(model), directory)

    async def log(self, model: TrainableModel, *args: Any) -> dict[str, float]:
        return await self.call("log", model_settings(model), *args)

    async def delete_checkpoints(self, model: TrainableModel, retention: Any) -> list[int]:
        return await self.call("delete_checkpoints", model_settings(model), retention)

    async def close(self) -> None:
        """The child's backend closed (its engines, servers, trainers), then the child ended."""
        if self._proc is None:
            return
        try:
            if self._dead is None:
                await asyncio.wait_for(self.call("close"), CLOSE_TIMEOUT_S)
        except ServiceProcessError:
            pass  # (already gone)
        finally:
            await asyncio.to_thread(self._end)

    def _end(self) -> None:
        proc = self._proc
        with contextlib.suppress(ServiceProcessError, OSError):
            self._send(("exit", 0))
        with self._send_lock:
            if self._out is not None:
                self._out.close()
                self._out = None
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.warning("the artrl service process did not exit within 30 s of closing: killed")
            proc.kill()
            proc.wait(timeout=30)

    # -- requests of the in-process transports

    def add_exchange(self, exchange: Any) -> int | None:
        with self._lock:
            if self._dead is not None:
                return None
            xid = next(self._ids)
            self._exchanges[xid] = exchange
            return xid

    def drop_exchange(self, xid: int) -> None:
        with self._lock:
            self._exchanges.pop(xid, None)


class _PipeLink:
    """The link of local/gateway/in_process.py's transports to one model's gateway in the child."""

    def __init__(self, process: ServiceProcess, key: tuple[str, str]) -> None:
        self._process, self._key = process, key

    def submit(self, exchange: Any, scope: dict[str, Any], request: Any) -> None:
        httpx = exchange.httpx
        xid = self._process.add_exchange(exchange)
        if xid is None:
            raise httpx.ConnectError(
                f"the artrl gateway is not running: {self._process._dead}", request=request
            )
        exchange.xid = xid
        try:
            self._process._send(("http", xid, self._key, scope, exchange.body))
        except ServiceProcessError as exc:
            self._process.drop_exchange(xid)
            raise httpx.ConnectError(str(exc), request=request) from None
        exchange.body = b""  # (sent: not kept for the whole call)

    def disconnect(self, exchange: Any) -> None:
        with contextlib.suppress(ServiceProcessError, AttributeError):
            self._process._send(("gone", exchange.xid))


def _remote_error(pickled: bytes | None, text: str) -> BaseException:
    """The child's exception as raised there (with its traceback as a note), or its text when it does not
    unpickle here."""
    try:
        error = pickle.loads(pickled) if pickled is not None else None
    except Exception:
        error = None
    if not isinstance(error, BaseException):
        return ServiceProcessError(f"in the artrl service process: {text}")
    error.add_note(f"(raised in the artrl service process)\n{text}")
    return error
