"""HTTP routes of the gateway: each POST route hands its call to calls.py in its dialect (dialects/), plain
chat completions included; the rest are models, health and capture blocks. Nothing else happens here.

Every client error is a 4xx with an OpenAI-style body; an unexpected failure is a 500 that says what failed
in general terms with an error id (the server's log has the id with the full text), and the server keeps
answering either way. What every request passes first (Host, key, JSON) is guard.py's.

A Starlette app, not FastAPI's: the routes validate nothing by signature (the dialects parse and check their
bodies), and FastAPI's layers around each request (dependency solving, its telemetry, body-limit and exit
stack middlewares) cost about a tenth of the gateway's time a call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from artrl.capturing.block import CAPTURE_HEADER  # the one name of the header clients send
from artrl.config import GatewayConfig
from artrl.local.gateway.calls import Calls, JSONAnswer, error_response
from artrl.local.gateway.captures import CaptureStore
from artrl.local.gateway.dialects import ChatDialect, Dialect, MessagesDialect, ResponsesDialect
from artrl.local.gateway.dialects.dialect import failure_text
from artrl.local.gateway.guard import Guard, Rules, TrustedHosts
from artrl.local.gateway.protocol import RequestError
from artrl.local.gateway.serving import ChatServing


def create_app(serving: ChatServing, config: GatewayConfig) -> Starlette:
    store = CaptureStore(config)
    calls = Calls(serving, store, config)

    async def health(_: Request) -> Response:
        return JSONAnswer({"status": "ok"})

    def model_list() -> dict[str, Any]:
        return {"object": "list", "data": serving.names.entries()}

    async def models(_: Request) -> Response:
        return JSONAnswer(model_list())

    async def capture_models(request: Request) -> Response:
        store.check(request.path_params["capture_id"])
        return JSONAnswer(model_list())

    async def open_capture(_: Request) -> Response:
        return JSONAnswer({"id": store.open(), "object": "capture"})

    async def close_capture(request: Request) -> Response:
        capture_id = request.path_params["capture_id"]
        return JSONAnswer({"id": capture_id, "object": "capture", "records": store.close(capture_id)})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/capture/{capture_id}/v1/models", capture_models, methods=["GET"]),
        *_calls(calls, "chat/completions", ChatDialect()),
        *_calls(calls, "responses", ResponsesDialect(config)),
        *_calls(calls, "messages", MessagesDialect()),
        Route("/v1/captures", open_capture, methods=["POST"]),
        Route("/v1/captures/{capture_id}", close_capture, methods=["DELETE"]),
    ]
    app = Starlette(routes=routes, exception_handlers=_error_handlers())
    app.state.preparing = calls.preparation  # the prompt-building thread, closed with the server
    rules = Rules(
        TrustedHosts(config.host, config.allowed_hosts),
        error_response,
        config.api_key,
        keyed_paths=("/v1/", "/capture/"),
        json_posts=True,
    )
    app.add_middleware(Guard, rules=rules)
    return app


def _calls(calls: Calls, path: str, dialect: Dialect) -> list[Route]:
    """POST /v1/{path} (in a capture when its header names one) and its capture twin, answered in `dialect`."""

    async def plain(request: Request) -> Response:
        return await calls.answer(request, request.headers.get(CAPTURE_HEADER), dialect)

    async def captured(request: Request) -> Response:
        return await calls.answer(request, request.path_params["capture_id"], dialect)

    name = path.replace("/", "_")
    return [
        Route(f"/v1/{path}", plain, methods=["POST"], name=name),
        Route(f"/capture/{{capture_id}}/v1/{path}", captured, methods=["POST"], name=f"capture_{name}"),
    ]


def _error_handlers() -> dict[Any, Callable[[Request, Exception], Awaitable[Response]]]:
    """Every error as an OpenAI-style body: a RequestError with its own status, Starlette's (404, 405) with
    theirs, anything unexpected as a 500 with an error id (its text and traceback go to the log under that
    id, not to the client)."""

    async def on_request_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestError)
        return JSONAnswer(exc.body(), status_code=exc.status)

    async def on_http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, failure_text(exc, "internal error"), "internal_error")

    return {RequestError: on_request_error, HTTPException: on_http_error, Exception: on_unexpected}
