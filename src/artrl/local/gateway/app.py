"""HTTP routes of the gateway. Routes parse, call the serving layer, and shape the response; nothing else.

Every client error is a 4xx with an OpenAI-style body; an unexpected failure is a 500 with a message, and
the server keeps answering either way.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from artrl.local.engine import EngineError
from artrl.local.gateway.protocol import RequestError, parse_request
from artrl.local.gateway.serving import ChatServing, ChoiceResult, Delta, PreparedRequest

log = logging.getLogger(__name__)


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(RequestError(message, code=code, status=status).body(), status_code=status)


def create_app(
    serving: ChatServing, *, api_key: str | None = None, max_request_bytes: int = 8 << 20
) -> FastAPI:
    app = FastAPI(title="artrl gateway", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        guarded = api_key is not None and request.url.path.startswith("/v1/")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if guarded and (
            scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), api_key.encode())
        ):
            return _error(
                401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "invalid_api_key"
            )
        return await call_next(request)

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
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "artrl"}
                for name in serving.model_names
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        raw = await request.body()
        if len(raw) > max_request_bytes:
            raise RequestError(
                f"request body of {len(raw)} bytes exceeds {max_request_bytes}",
                status=413,
                code="request_too_large",
            )
        prepared = serving.prepare(parse_request(raw))
        if prepared.request.stream:
            return StreamingResponse(_sse(serving, prepared), media_type="text/event-stream")
        try:
            return JSONResponse(await _complete(serving, prepared))
        except EngineError as exc:
            return _error(500, f"the engine failed: {exc}", "engine_error")

    return app


async def _complete(serving: ChatServing, prepared: PreparedRequest) -> dict[str, Any]:
    """Non-streaming = the fold of the streaming events."""
    results: list[ChoiceResult] = []
    async for event in serving.events(prepared, streaming=False):
        if isinstance(event, ChoiceResult):
            results.append(event)
    results.sort(key=lambda r: r.index)
    choices = [
        {
            "index": r.index,
            "message": r.message,
            "finish_reason": r.finish_reason,
            "logprobs": {"content": serving.logprob_entries(r.tokens)} if prepared.request.logprobs else None,
            **serving.token_fields(r),
        }
        for r in results
    ]
    return {
        "id": prepared.id,
        "object": "chat.completion",
        "created": prepared.created,
        "model": prepared.request.model,
        "choices": choices,
        "usage": _usage(prepared, results),
    }


def _usage(prepared: PreparedRequest, results: list[ChoiceResult]) -> dict[str, int]:
    completion = sum(len(r.tokens) for r in results)
    prompt = len(prepared.prompt.ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _sse(serving: ChatServing, prepared: PreparedRequest) -> AsyncIterator[bytes]:
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
    results: list[ChoiceResult] = []
    try:
        async for event in serving.events(prepared, streaming=True):
            delta: dict[str, Any] = {}
            if event.index not in started:
                started.add(event.index)
                delta["role"] = "assistant"
            if isinstance(event, Delta):
                delta["content"] = event.text
                logprobs = {"content": serving.logprob_entries(event.tokens)} if want_logprobs else None
                yield chunk(
                    [{"index": event.index, "delta": delta, "finish_reason": None, "logprobs": logprobs}]
                )
                continue
            results.append(event)
            content = event.message["content"] or ""
            if content.startswith(event.streamed_text) and len(content) > len(event.streamed_text):
                delta["content"] = content[len(event.streamed_text) :]
            if event.message.get("tool_calls"):
                delta["tool_calls"] = [
                    {"index": j, **call} for j, call in enumerate(event.message["tool_calls"])
                ]
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
            yield chunk([], usage=_usage(prepared, results))
    except Exception as exc:  # headers are sent: report the failure in the stream itself
        code = "engine_error" if isinstance(exc, EngineError) else "internal_error"
        if code == "internal_error":
            log.exception("stream failed")
        body = RequestError(f"generation failed: {type(exc).__name__}: {exc}", code=code, status=500).body()
        yield f"data: {json.dumps(body)}\n\n".encode()
    yield b"data: [DONE]\n\n"
