"""An httpx transport that hands a client's requests to the gateway in the same process, without a socket.

`model.openai_client()` on a local backend uses it: the real `openai` SDK builds and parses every call as
usual, but the request goes to the gateway's ASGI app on the gateway's own event loop (its thread) instead of
through TCP, a connection pool and an HTTP parser on both sides, which on a small machine cost as much CPU
as the requests themselves and share one interpreter lock with the engine. The gateway cannot tell the
difference: same routes, same middleware, same disconnect handling (a cancelled or timed-out call is a
client that went away). Clients built from `model.inference_base_url` keep using HTTP.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

from artrl.sdk_http import openai_httpx

_END = object()  # the response body is complete
IN_PROCESS = "artrl.in_process"  # the scope extension of the requests these transports carry


class Exchanges:
    """The requests in flight through the in-process transports of one gateway: refused once it stops, and
    any the stopping gateway dropped are failed (their callers would otherwise wait for their timeouts)."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet[AppSide] = weakref.WeakSet()
        self._closed = False
        self._lock = threading.Lock()

    def add(self, exchange: AppSide) -> bool:
        with self._lock:
            if not self._closed:
                self._live.add(exchange)
            return not self._closed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            live = list(self._live)
        for exchange in live:
            exchange.abandon("the artrl gateway stopped before answering")


def link_transport(
    link: Any, host: str, port: int, sync: bool = False, httpx: ModuleType | None = None
) -> Any:
    """A transport whose requests `link` carries to the gateway: `link.submit(exchange, scope, request)`
    starts one (raising the httpx ConnectError it is given when it cannot), `link.disconnect(exchange)` tells
    the app its client went away; the answer comes back through `exchange.deliver` and `exchange.ended`.
    `httpx`: the package of the client it is for (`artrl.sdk_http.httpx_package`; None: openai's)."""
    httpx = httpx or openai_httpx()
    transport = _sync_classes(httpx)[0] if sync else _classes(httpx)[0]
    return transport(httpx, link, (host, port))


@functools.cache
def _classes(httpx: ModuleType) -> tuple[type, type]:
    """The transport and body stream as subclasses of that httpx's own base classes (it checks them)."""
    transport = type("GatewayTransport", (_Transport, httpx.AsyncBaseTransport), {})
    body = type("GatewayBody", (_Body, httpx.AsyncByteStream), {})
    return transport, body


@functools.cache
def _sync_classes(httpx: ModuleType) -> tuple[type, type]:
    transport = type("SyncGatewayTransport", (_SyncTransport, httpx.BaseTransport), {})
    body = type("SyncGatewayBody", (_SyncBody, httpx.SyncByteStream), {})
    return transport, body


class AppSide:
    """The app's half of one request, on the gateway loop: the request body once, then a disconnect when the
    client goes away (`gone`); the response messages go to `deliver`, the end to `ended`. Subclasses say
    where they go: the caller's loop in this process (_Exchange), or a pipe (local/backend/service_child.py)."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.future: concurrent.futures.Future | None = None  # the app's run on the gateway loop
        self.gone = asyncio.Event()  # set, and waited for, on the gateway loop: the client went away
        self.body_sent = self.complete = False

    async def run(self, app: Any, scope: dict[str, Any]) -> None:
        await app(scope, self.receive, self.send)

    async def receive(self) -> dict[str, Any]:
        if not self.body_sent:
            self.body_sent = True
            body, self.body = self.body, b""
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if not self.gone.is_set():  # (the client went away: nobody reads what the app still sends)
            self.deliver(message)

    def finished(self, future: concurrent.futures.Future) -> None:
        """The app returned or failed (on the gateway loop)."""
        error = None if future.cancelled() else future.exception()
        self.ended(None if error is None else f"{type(error).__name__}: {error}", future.cancelled())

    def deliver(self, message: dict[str, Any]) -> None:
        raise NotImplementedError

    def ended(self, error: str | None, cancelled: bool = False) -> None:
        raise NotImplementedError

    def abandon(self, message: str) -> None:
        """The gateway stopped without finishing this request (from the stopping thread)."""
        raise NotImplementedError


class AppLink:
    """Requests to `app` run on `loop` (the gateway's, in another thread of this process): the link of the
    in-process transports, and of requests that came over the service process's pipe."""

    def __init__(self, app: Any, loop: asyncio.AbstractEventLoop, exchanges: Exchanges) -> None:
        self._app, self._loop, self._exchanges = app, loop, exchanges

    def start(self, side: AppSide, scope: dict[str, Any]) -> str | None:
        """Run the app for `side` on the gateway's loop; why it could not (the gateway stopped), or None."""
        if not self._exchanges.add(side):
            return "the artrl gateway is not running (it stopped)"
        work = side.run(self._app, scope)
        try:
            future = asyncio.run_coroutine_threadsafe(work, self._loop)
        except RuntimeError as exc:  # the gateway's loop is closed
            work.close()
            return f"the artrl gateway is not running: {exc}"
        side.future = future
        future.add_done_callback(side.finished)
        return None

    def submit(self, exchange: _Exchange, scope: dict[str, Any], request: Any) -> None:
        """start, for a transport: ConnectError when the gateway is gone."""
        failure = self.start(exchange, scope)
        if failure is not None:
            raise exchange.httpx.ConnectError(failure, request=request)

    def disconnect(self, side: AppSide) -> None:
        """The client of `side` went away: the app's next receive says so."""
        if side.complete or side.future is None or side.future.done():
            return
        with contextlib.suppress(RuntimeError):  # the gateway stopped
            self._loop.call_soon_threadsafe(side.gone.set)


class _Transport:
    def __init__(self, httpx: ModuleType, link: Any, server: tuple) -> None:
        self._httpx, self._link, self._server = httpx, link, server

    def _submit(self, exchange: _Exchange, request: Any) -> None:
        self._link.submit(exchange, _scope(request, self._server), request)

    async def handle_async_request(self, request: Any) -> Any:
        httpx = self._httpx
        timeout = request.extensions.get("timeout", {})
        read_timeout = timeout.get("read")
        body = await request.aread()
        caller = asyncio.get_running_loop()
        started: asyncio.Future[tuple[int, list[tuple[bytes, bytes]]]] = caller.create_future()
        chunks: asyncio.Queue[Any] = asyncio.Queue()
        exchange = _Exchange(httpx, body, caller, self._link, started, chunks)
        self._submit(exchange, request)
        try:
            status, headers = await asyncio.wait_for(started, read_timeout)
        except TimeoutError:
            exchange.disconnect()
            raise httpx.ReadTimeout(f"no response within {read_timeout} s", request=request) from None
        except BaseException:
            exchange.disconnect()
            raise
        body_stream = _classes(httpx)[1](httpx, exchange, read_timeout, request)
        return httpx.Response(status, headers=headers, stream=body_stream, request=request)


def _scope(request: Any, server: tuple) -> dict[str, Any]:
    """The ASGI scope of an httpx request (HTTP/1.1, from loopback, marked as in-process)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": request.url.scheme,
        "path": request.url.path,
        "raw_path": request.url.raw_path.split(b"?")[0],
        "query_string": request.url.query,
        "root_path": "",
        "headers": [(k.lower(), v) for k, v in request.headers.raw],
        "server": server,
        "client": ("127.0.0.1", 0),
        # a client in this process (or the parent's, over the service pipe): its Host is whatever its base URL
        # says, never a web page's (guard.py checks the Host of requests from the network only)
        "extensions": {IN_PROCESS: {}},
    }


class _Exchange(AppSide):
    """One request's two halves: the client's on the caller's loop; the app's on the gateway loop when the
    gateway is in this process (a link to another process calls `deliver` and `ended` itself)."""

    def __init__(self, httpx: ModuleType, body: bytes, caller, link, started, chunks) -> None:
        super().__init__(body)
        self.httpx, self.caller, self.link = httpx, caller, link
        self.started, self.chunks = started, chunks

    def deliver(self, message: dict[str, Any]) -> None:
        """An ASGI response message of the app, handed to the client (from any thread)."""
        kind = message["type"]
        if kind == "http.response.start":
            headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
            self._deliver(_resolve, self.started, (message["status"], headers))
        elif kind == "http.response.body":
            more = message.get("more_body", False)
            self._deliver(self.chunks.put_nowait, message.get("body", b""))
            if not more:
                self.complete = True
                self._deliver(self.chunks.put_nowait, _END)

    def _deliver(self, fn: Any, *args: Any) -> None:
        """fn(*args) on the caller's loop; nothing if that loop is closed (its caller gave up and left)."""
        with contextlib.suppress(RuntimeError):
            self.caller.call_soon_threadsafe(fn, *args)

    def ended(self, error: str | None, cancelled: bool = False) -> None:
        """The app is done (`error`: how it failed): a client still waiting for the rest is failed."""
        if cancelled or error is not None or not self.complete:
            failure = self.httpx.RemoteProtocolError(
                "the artrl gateway closed the request without a complete response"
                + (f": {error}" if error is not None else "")
            )
            self._deliver(_fail, self.started, self.chunks, failure)

    def abandon(self, message: str) -> None:
        if not self.complete:
            self._deliver(_fail, self.started, self.chunks, self.httpx.RemoteProtocolError(message))

    def disconnect(self) -> None:
        """The client went away (cancelled, timed out, or closed the body early)."""
        if not self.complete:
            self.link.disconnect(self)


def _resolve(started: asyncio.Future, value: Any) -> None:
    if not started.done():
        started.set_result(value)


def _fail(started: asyncio.Future, chunks: asyncio.Queue, failure: Exception) -> None:
    if not started.done():
        started.set_exception(failure)
    chunks.put_nowait(failure)


class _Body:
    def __init__(
        self, httpx: ModuleType, exchange: _Exchange, read_timeout: float | None, request: Any
    ) -> None:
        self._httpx, self._exchange, self._timeout, self._request = httpx, exchange, read_timeout, request
        self._done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while not self._done:
            try:
                item = await asyncio.wait_for(self._exchange.chunks.get(), self._timeout)
            except TimeoutError:
                self._exchange.disconnect()
                raise self._httpx.ReadTimeout(
                    f"no data within {self._timeout} s", request=self._request
                ) from None
            except BaseException:
                self._exchange.disconnect()
                raise
            if self._ended(item):
                return
            if item:
                yield item

    def _ended(self, item: Any) -> bool:
        """True at the body's end; a failure the exchange delivered is raised."""
        if item is _END or isinstance(item, Exception):
            self._done = True
            if item is not _END:
                raise item
        return self._done

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._exchange.disconnect()


class _SyncExchange(_Exchange):
    """The same exchange for a blocking caller: its future and queue are thread-safe, so the gateway's
    thread hands over directly."""

    def _deliver(self, fn: Any, *args: Any) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # (a failure racing the answer)
            fn(*args)


class _SyncTransport(_Transport):
    def handle_request(self, request: Any) -> Any:
        httpx = self._httpx
        read_timeout = request.extensions.get("timeout", {}).get("read")
        body = request.read()
        started: concurrent.futures.Future = concurrent.futures.Future()
        chunks: queue.Queue[Any] = queue.Queue()
        exchange = _SyncExchange(httpx, body, None, self._link, started, chunks)
        self._submit(exchange, request)
        try:
            status, headers = started.result(timeout=read_timeout)
        except concurrent.futures.TimeoutError:
            exchange.disconnect()
            raise httpx.ReadTimeout(f"no response within {read_timeout} s", request=request) from None
        except BaseException:
            exchange.disconnect()
            raise
        body_stream = _sync_classes(httpx)[1](httpx, exchange, read_timeout, request)
        return httpx.Response(status, headers=headers, stream=body_stream, request=request)


class _SyncBody(_Body):
    def __iter__(self) -> Iterator[bytes]:
        while not self._done:
            try:
                item = self._exchange.chunks.get(timeout=self._timeout)
            except queue.Empty:
                self._exchange.disconnect()
                raise self._httpx.ReadTimeout(
                    f"no data within {self._timeout} s", request=self._request
                ) from None
            if self._ended(item):
                return
            if item:
                yield item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._exchange.disconnect()
