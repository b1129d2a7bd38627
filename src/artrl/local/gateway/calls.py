"""One call to the gateway, in whichever dialect it came (dialects/): refused while the gateway is busy (429),
its body read within its bound (413), checked, rendered and tokenised off the event loop, then answered as a
stream or as the fold of one, and recorded in its capture. A client that gives up on a non-streaming call
stops its generation (499) and leaves no record: it never saw the answer, and may retry.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from artrl.config import GatewayConfig
from artrl.local.engine.contract import EngineError
from artrl.local.gateway.captures import CaptureStore
from artrl.local.gateway.dialects import Dialect
from artrl.local.gateway.dialects.chat import complete
from artrl.local.gateway.dialects.dialect import failure_text
from artrl.local.gateway.preparation import Preparation
from artrl.local.gateway.protocol import RequestError, check_depth, parse_request
from artrl.local.gateway.serving import ChatServing, PreparedRequest


class JSONAnswer(JSONResponse):
    """A JSON response written by orjson (a chat completion carries its prompt's ids: json's encoder took
    ~5% of the gateway's time a call); what orjson refuses (an integer beyond 64 bits a client sent in a
    tool schema or in metadata the answer echoes) is written by json as before. (A NaN or infinite float,
    which json refused with a 500, is written as null.)"""

    def render(self, content: Any) -> bytes:
        try:
            return orjson.dumps(content)
        except TypeError:  # (orjson.JSONEncodeError)
            return super().render(content)


def error_response(
    status: int, message: str, code: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """An error as the gateway answers every one: an OpenAI-style body with its status (and headers: a
    405's Allow)."""
    body = RequestError(message, code=code, status=status).body()
    return JSONAnswer(body, status_code=status, headers=headers)


class Calls:
    """Answers the calls of one gateway: every POST route hands its request here with its dialect."""

    def __init__(self, serving: ChatServing, store: CaptureStore, config: GatewayConfig) -> None:
        self.serving, self.store = serving, store
        self.max_request_bytes, self.max_inflight = config.max_request_bytes, config.max_inflight_requests
        self.max_depth, self.body_read_timeout_s = config.max_json_depth, config.body_read_timeout_s
        # rendering and tokenising a prompt (seconds for a huge one) happen there, never on the event loop
        # that answers every other client
        self.preparation = Preparation(config.max_preparing_bytes)
        self.preparing_now = 0  # requests being read and prepared; the serving layer counts those generating

    async def answer(self, request: Request, capture_id: str | None, dialect: Dialect) -> Response:
        busy = self.preparing_now + self.serving.generating
        if busy >= self.max_inflight:
            raise RequestError(
                f"the gateway is busy: {busy} requests in flight (GatewayConfig.max_inflight_requests); "
                "retry shortly",
                code="too_many_requests",
                status=429,
            )
        self.preparing_now += 1
        try:
            raw = await bounded_body(request, self.max_request_bytes, self.body_read_timeout_s)
            if capture_id is not None:
                self.store.check(capture_id)
            work = functools.partial(self._prepare, raw, dialect)
            done, answer = (False, None) if dialect.expands else self.preparation.run_now(len(raw), work)
            if not done:
                answer = await asyncio.wrap_future(self.preparation.submit(len(raw), work))
            prepared, context = answer
        finally:
            self.preparing_now -= 1

        def record(choices: list[dict[str, Any]]) -> None:
            if capture_id is not None:
                self.store.add(capture_id, _record(prepared, choices))

        if prepared.request.stream:
            events = dialect.stream(self.serving, prepared, record, context)
            return StreamingResponse(events, media_type="text/event-stream")
        work = asyncio.ensure_future(complete(self.serving, prepared))
        gone = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client gave up (and may retry): stop generating
                work.cancel()
                # its end awaited, whatever it was, but not `suppress(BaseException)`: that also
                # swallowed this handler's own cancellation (the server shutting down, say)
                await asyncio.wait({work})
                if not work.cancelled():
                    work.exception()  # retrieved: no "exception was never retrieved" warning
                return Response(status_code=499)
            body = work.result()
            left = gone.done()
        except EngineError as exc:
            return error_response(500, failure_text(exc, "the engine failed"), "engine_error")
        finally:
            work.cancel()
            gone.cancel()
        if capture_id is not None and not left:
            record(body["choices"])  # not a call whose client gave up (and may retry): it never saw it
        return JSONAnswer(dialect.reply(prepared, body, context))

    def _prepare(self, raw: bytes, dialect: Dialect) -> tuple[PreparedRequest, Any]:
        """The request checked, rendered and tokenised (translated to chat first by its dialect), and what
        its dialect keeps for the answer. Its depth first: parsing, checking, marking and rendering all
        recurse, and a 3 KB body nested 400 deep would exhaust the interpreter's stack (a 500)."""
        check_depth(raw, self.max_depth)
        body, context = dialect.chat_request(raw)
        return self.serving.prepare(parse_request(body, self.max_depth)), context


async def client_gone(request: Request) -> None:
    """Returns once the client went away (its ASGI receive says so, after the body): a non-streaming call
    waits on it beside its generation, where polling `is_disconnected` cost a cancel scope every 0.25 s."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def bounded_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body, refused (413) as soon as it is known to exceed `limit` bytes: from its declared
    length before reading any of it, or while it streams in, never after holding all of it; refused (408)
    when it has not arrived whole within `timeout_s` (a stalled upload)."""

    def too_large(size: str) -> RequestError:
        return RequestError(
            f"request body of {size} bytes exceeds {limit}", status=413, code="request_too_large"
        )

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(f"more than {limit}")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(
            f"the request body did not arrive within {timeout_s:g} s ({size} bytes came)",
            status=408,
            code="request_timeout",
        ) from None
    return b"".join(chunks)


def _record(prepared: PreparedRequest, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """What a capture keeps of a call: the checked messages (only the keys the gateway reads), tools, choices."""
    return {"id": prepared.id, "messages": prepared.messages, "tools": prepared.tools, "choices": choices}
