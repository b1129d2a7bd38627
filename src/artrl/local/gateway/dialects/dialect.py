"""What every dialect shares: the `Dialect` protocol the call path drives (calls.py), and the helpers the
dialects use to read a request and write an answer (see the package docstring)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from artrl.local.engine.contract import EngineError
from artrl.local.gateway.protocol import RequestError
from artrl.random_ids import random_hex

if TYPE_CHECKING:
    from artrl.local.gateway.serving import ChatServing, ChoiceResult, PreparedRequest

log = logging.getLogger(__name__)

Record = Callable[[list[dict[str, Any]]], None]
"""Records a finished call's chat-format choices in its capture (a no-op outside one)."""


def json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a RequestError (400) that says what is wrong with it."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"the body is not JSON (or nested too deeply): {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


def typed(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    """body[name] when absent, null or of `kinds`; otherwise a RequestError naming the field."""
    value = body.get(name)
    if value is not None and not isinstance(value, kinds):
        raise RequestError(f"{name} must be {what}, not {type(value).__name__}", param=name)
    return value


def text_of(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string, not {type(value).__name__}", param=where)
    return value


class Dialect(Protocol):
    """A request shape the gateway answers: plain chat (chat.py), the Responses API (responses.py),
    Anthropic Messages (anthropic.py)."""

    # its chat request may be much larger than the body that came (a Responses call's previous_response_id
    # brings back a stored conversation): never prepared on the event loop (preparation.py's run_now)
    expands: bool

    def chat_request(self, raw: bytes) -> tuple[bytes, Any]:
        """The chat-completions request body (JSON) this request amounts to, and what the dialect keeps of the
        request for its answer (passed back to `reply`/`stream`); RequestError when it is invalid."""
        ...

    def reply(self, prepared: PreparedRequest, completion: dict[str, Any], context: Any) -> dict[str, Any]:
        """The non-streaming answer, from the chat completion the gateway made."""
        ...

    def stream(
        self, serving: ChatServing, prepared: PreparedRequest, record: Record, context: Any
    ) -> AsyncIterator[bytes]:
        """The streaming answer (server-sent events) from the serving layer's events; calls `record` with
        the chat-format choices before the last event goes out."""
        ...


def usage(prepared: PreparedRequest, results: list[ChoiceResult]) -> dict[str, int]:
    """A chat completion's token counts."""
    completion = sum(len(r.tokens) for r in results)
    prompt = len(prepared.prompt.ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# where an engine's message quotes a server's log (engine/vllm/server.py): from here to its last line break
_LOG_TAIL = re.compile(r"Last lines of .*\n", re.S)


def failure_text(exc: BaseException, what: str) -> str:
    """What a client is told of a failure on the server's side: `what` failed, and an error id that the
    server's log shows with the full text (and traceback). An engine's own reason (a replica that exited, a
    request the engine refused) is the client's business and stays, without the server log it may quote;
    any other exception's text (paths, internals) goes to the log only."""
    error_id = f"err_{random_hex(16)}"
    if isinstance(exc, EngineError):
        log.error("%s (error id %s): %s", what, error_id, exc)
        reason = " ".join(_LOG_TAIL.sub("(its log: in the server's log) ", str(exc)).split())[:1000]
        return f"{what}: {reason} (error id {error_id})"
    log.error("%s (error id %s): %s: %s", what, error_id, type(exc).__name__, exc, exc_info=exc)
    return f"{what} (error id {error_id}: the server's log has the details)"


def stream_error(exc: Exception, code: str) -> bytes:
    """A failure after the headers went out, as the stream's own server-sent event."""
    body = RequestError(failure_text(exc, "generation failed"), code=code, status=500).body()
    return f"data: {json.dumps(body)}\n\n".encode()
