"""HTTP routes of the gateway: each POST route hands its call to calls.py in its dialect (dialects/), plain
chat completions included; the rest are models, health and capture blocks. Nothing else happens here.

Every client error is a 4xx with an OpenAI-style body; an unexpected failure is a 500 that says what failed
in general terms with an error id (the server's log has the id with the full text), and the server keeps
answering either way. What every request passes first (Host, key, JSON) is guard.py's.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from artrl.capturing.block import CAPTURE_HEADER  # the one name of the header clients send
from artrl.config import GatewayConfig
from artrl.local.gateway.calls import Calls, error_response
from artrl.local.gateway.captures import CaptureStore
from artrl.local.gateway.dialects import ChatDialect, Dialect, MessagesDialect, ResponsesDialect
from artrl.local.gateway.dialects.dialect import failure_text
from artrl.local.gateway.guard import Guard, Rules, TrustedHosts
from artrl.local.gateway.protocol import RequestError
from artrl.local.gateway.serving import ChatServing


def create_app(serving: ChatServing, config: GatewayConfig) -> FastAPI:
    app = FastAPI(title="artrl gateway", docs_url=None, redoc_url=None)
    store = CaptureStore(config)
    calls = Calls(serving, store, config)
    app.state.preparing = calls.preparation  # the prompt-building thread, closed with the server
    rules = Rules(
        TrustedHosts(config.host, config.allowed_hosts),
        error_response,
        config.api_key,
        keyed_paths=("/v1/", "/capture/"),
        json_posts=True,
    )
    app.add_middleware(Guard, rules=rules)
    _add_error_handlers(app)

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

    _add_calls(app, calls, "chat/completions", ChatDialect())
    _add_calls(app, calls, "responses", ResponsesDialect(config))
    _add_calls(app, calls, "messages", MessagesDialect())

    @app.post("/v1/captures")
    async def open_capture() -> dict[str, Any]:
        return {"id": store.open(), "object": "capture"}

    @app.delete("/v1/captures/{capture_id}")
    async def close_capture(capture_id: str) -> dict[str, Any]:
        return {"id": capture_id, "object": "capture", "records": store.close(capture_id)}

    return app


def _add_calls(app: FastAPI, calls: Calls, path: str, dialect: Dialect) -> None:
    """POST /v1/{path} (in a capture when its header names one) and its capture twin, answered in `dialect`."""

    async def plain(request: Request):
        return await calls.answer(request, request.headers.get(CAPTURE_HEADER), dialect)

    async def captured(capture_id: str, request: Request):
        return await calls.answer(request, capture_id, dialect)

    name = path.replace("/", "_")
    app.post(f"/v1/{path}", name=name)(plain)
    app.post(f"/capture/{{capture_id}}/v1/{path}", name=f"capture_{name}")(captured)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style body: a RequestError with its own status, Starlette's (404, 405) with
    theirs, a request FastAPI cannot validate as a 400, anything unexpected as a 500 with an error id (its
    text and traceback go to the log under that id, not to the client)."""

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, f"invalid request: {exc.errors()[:1]}", "invalid_value")

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, failure_text(exc, "internal error"), "internal_error")
