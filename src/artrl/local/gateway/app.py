"""HTTP routes of the gateway. Routes parse, call the serving layer, and shape the response; nothing else.

Every client error is a 4xx with an OpenAI-style body; an unexpected failure is a 500 with a message, and
the server keeps answering either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from artrl.capturing.block import CAPTURE_HEADER
from artrl.config import GatewayConfig  # the one name of the header clients send
from artrl.local.engine.contract import EngineError
from artrl.local.gateway.captures import CaptureStore
from artrl.local.gateway.dialects import Dialect, chat_choice, stream_error, usage
from artrl.local.gateway.messages_api import MessagesDialect
from artrl.local.gateway.protocol import RequestError, parse_request
from artrl.local.gateway.responses_api import ResponsesDialect
from artrl.local.gateway.serving import ChatServing, ChoiceResult, Delta, PreparedRequest

log = logging.getLogger(__name__)


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(RequestError(message, code=code, status=status).body(), status_code=status)


def create_app(serving: ChatServing, config: GatewayConfig) -> FastAPI:
    app = FastAPI(title="artrl gateway", docs_url=None, redoc_url=None)
    store = CaptureStore(config)
    api_key, max_request_bytes, max_inflight = (
        config.api_key,
        config.max_request_bytes,
        config.max_inflight_requests,
    )
    # rendering and tokenising a prompt (seconds for a huge one) happen here, one request at a time, never
    # on the event loop that answers every other client
    preparing = app.state.preparing = ThreadPoolExecutor(1, thread_name_prefix="artrl-prepare")

    app.add_middleware(_Guard, api_key=api_key)

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, f"invalid request: {exc.errors()[:1]}", "invalid_value")

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected gateway error")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": serving.names.entries()}

    @app.get("/capture/{capture_id}/v1/models")
    async def capture_models(capture_id: str) -> dict[str, Any]:
        store.check(capture_id)
        return await models()

    preparing_now = 0  # requests being read and prepared; the serving layer counts those generating

    async def chat(request: Request, capture_id: str | None, dialect: Dialect | None = None):
        nonlocal preparing_now
        busy = preparing_now + serving.generating
        if busy >= max_inflight:
            raise RequestError(
                f"the gateway is busy: {busy} requests in flight (GatewayConfig.max_inflight_requests); "
                "retry shortly",
                code="too_many_requests",
                status=429,
            )
        return await _chat(request, capture_id, dialect)

    async def _chat(request: Request, capture_id: str | None, dialect: Dialect | None):
        nonlocal preparing_now
        preparing_now += 1
        try:
            raw = await _bounded_body(request, max_request_bytes)
            if capture_id is not None:
                store.check(capture_id)
            loop = asyncio.get_running_loop()
            prepared, context = await loop.run_in_executor(preparing, lambda: _prepare(serving, raw, dialect))
        finally:
            preparing_now -= 1

        def record(choices: list[dict[str, Any]]) -> None:
            if capture_id is not None:
                store.add(capture_id, _record(prepared, choices))

        if prepared.request.stream:
            events = (
                _sse(serving, prepared, record)
                if dialect is None
                else dialect.stream(serving, prepared, record, context)
            )
            return StreamingResponse(events, media_type="text/event-stream")
        work = asyncio.ensure_future(_complete(serving, prepared))
        try:
            while not (await asyncio.wait({work}, timeout=0.25))[0]:
                if await request.is_disconnected():  # the client gave up (and may retry): stop generating
                    work.cancel()
                    with contextlib.suppress(BaseException):
                        await work
                    return Response(status_code=499)
            body = work.result()
        except EngineError as exc:
            return _error(500, f"the engine failed: {exc}", "engine_error")
        finally:
            work.cancel()
        if capture_id is not None and not await request.is_disconnected():
            record(body["choices"])  # not a call whose client gave up (and may retry): it never saw it
        return JSONResponse(body if dialect is None else dialect.reply(prepared, body, context))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat(request, request.headers.get(CAPTURE_HEADER))

    @app.post("/capture/{capture_id}/v1/chat/completions")
    async def capture_chat_completions(capture_id: str, request: Request):
        return await chat(request, capture_id)

    def add_dialect(name: str, dialect: Dialect) -> None:
        """POST /v1/{name} and its capture twin, answered through the chat path (see dialects.py)."""

        async def plain(request: Request):
            return await chat(request, request.headers.get(CAPTURE_HEADER), dialect)

        async def captured(capture_id: str, request: Request):
            return await chat(request, capture_id, dialect)

        app.post(f"/v1/{name}")(plain)
        app.post(f"/capture/{{capture_id}}/v1/{name}")(captured)

    add_dialect("responses", ResponsesDialect(config))
    add_dialect("messages", MessagesDialect())

    @app.post("/v1/captures")
    async def open_capture() -> dict[str, Any]:
        return {"id": store.open(), "object": "capture"}

    @app.delete("/v1/captures/{capture_id}")
    async def close_capture(capture_id: str) -> dict[str, Any]:
        return {"id": capture_id, "object": "capture", "records": store.close(capture_id)}

    return app


class _Guard:
    """Pure ASGI middleware (a Starlette `BaseHTTPMiddleware` would hide client disconnects from the routes):

    - the API key, when one is set, on /v1/ and /capture/ routes (as a bearer token or, as Anthropic's
      clients send it, `x-api-key`), checked before the body is read;
    - a body must be JSON and say so: a web page's form or text/plain POST, which browsers send cross-site
      without asking first, never reaches the gateway (415)."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> JSONResponse | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        if self.api_key is not None and path.startswith(("/v1/", "/capture/")):
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
                given = headers.get("x-api-key", "")
            if not given or not hmac.compare_digest(given.encode(), self.api_key.encode()):
                return _error(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    "invalid_api_key",
                )
        if scope["method"] in ("POST", "PUT", "PATCH"):
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
            if (kind or has_body or path.endswith("/chat/completions")) and kind != "application/json":
                return _error(
                    415,
                    f"Content-Type must be application/json (got {kind or 'none'})",
                    "unsupported_media_type",
                )
        return None


async def _bounded_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed `limit` bytes: from its declared
    length before reading any of it, or while it streams in, never after holding all of it."""

    def too_large(size: str) -> RequestError:
        return RequestError(
            f"request body of {size} bytes exceeds {limit}", status=413, code="request_too_large"
        )

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def _prepare(serving: ChatServing, raw: bytes, dialect: Dialect | None) -> tuple[PreparedRequest, Any]:
    """The request checked, rendered and tokenised (a dialect's translated to chat first), and what its
    dialect keeps for the answer."""
    body, context = (raw, None) if dialect is None else dialect.chat_request(raw)
    return serving.prepare(parse_request(body)), context


async def _complete(serving: ChatServing, prepared: PreparedRequest) -> dict[str, Any]:
    """Non-streaming = the fold of the streaming events."""
    results: list[ChoiceResult] = []
    async for event in serving.events(prepared, streaming=False):
        if isinstance(event, ChoiceResult):
            results.append(event)
    results.sort(key=lambda r: r.index)
    choices = [chat_choice(serving, prepared, r) for r in results]
    return {
        "id": prepared.id,
        "object": "chat.completion",
        "created": prepared.created,
        "model": prepared.request.model,
        "choices": choices,
        "usage": usage(prepared, results),
    }


def _record(prepared: PreparedRequest, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """What a capture keeps of a call: the checked messages (only the keys the gateway reads), tools, choices."""
    return {"id": prepared.id, "messages": prepared.messages, "tools": prepared.tools, "choices": choices}


def _delta_parts(event: Delta, calls_sent: dict[int, int]) -> list[dict[str, Any]]:
    """The OpenAI `delta` objects for a Delta: runs of reasoning and content text, and whole tool calls (each
    with its index in the choice). Logprobs alone (no text yet) go out with an empty content delta."""
    parts: list[dict[str, Any]] = []
    for piece in event.pieces:
        key = {"content": "content", "reasoning": "reasoning_content"}.get(piece.kind)
        if key is not None:
            if parts and set(parts[-1]) == {key}:
                parts[-1][key] += piece.text
            else:
                parts.append({key: piece.text})
        else:
            assert piece.call is not None
            j = calls_sent.get(event.index, 0)
            calls_sent[event.index] = j + 1
            parts.append({"tool_calls": [{"index": j, **piece.call.as_openai()}]})
    if not parts and event.tokens:
        parts.append({"content": ""})
    return parts


async def _sse(
    serving: ChatServing, prepared: PreparedRequest, record: Callable[[list[dict[str, Any]]], None]
) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = {
            "id": prepared.id,
            "object": "chat.completion.chunk",
            "created": prepared.created,
            "model": prepared.request.model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    want_logprobs = bool(prepared.request.logprobs)
    started: set[int] = set()
    calls_sent: dict[int, int] = {}
    results: list[ChoiceResult] = []
    try:
        async for event in serving.events(prepared, streaming=True):
            if isinstance(event, Delta):
                for part in _delta_parts(event, calls_sent):
                    head = {} if event.index in started else {"role": "assistant"}
                    started.add(event.index)
                    logprobs = {"content": serving.logprob_entries(event.tokens)} if want_logprobs else None
                    choice = {"index": event.index, "delta": {**head, **part}, "finish_reason": None}
                    yield chunk([{**choice, "logprobs": logprobs}])
                    event.tokens = []
                continue
            delta: dict[str, Any] = {} if event.index in started else {"role": "assistant"}
            started.add(event.index)
            results.append(event)
            if len(results) == prepared.request.n:  # before the last chunk goes out: a client that stops
                # reading at finish_reason and leaves its capture block must still find the call recorded
                record([chat_choice(serving, prepared, r) for r in sorted(results, key=lambda r: r.index)])
            yield chunk(
                [
                    {
                        "index": event.index,
                        "delta": delta,
                        "finish_reason": event.finish_reason,
                        "logprobs": None,
                        **serving.token_fields(event),
                    }
                ]
            )
        options = prepared.request.stream_options
        if options is not None and options.include_usage:
            yield chunk([], usage=usage(prepared, results))
    except EngineError as exc:  # headers are sent: report the failure in the stream itself
        yield stream_error(exc, "engine_error")
    except Exception as exc:
        log.exception("stream failed")
        yield stream_error(exc, "internal_error")
    yield b"data: [DONE]\n\n"
