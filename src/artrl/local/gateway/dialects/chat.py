"""`POST /v1/chat/completions`: the chat path's own dialect. The request passes through as it came, the
answer is the chat completion, and its stream the OpenAI `chat.completion.chunk` events. `chat_choice` and
the non-streaming fold (`complete`) are every dialect's: the others answer from the chat completion too.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from artrl.local.engine.contract import EngineError
from artrl.local.gateway.dialects.dialect import Record, stream_error, usage
from artrl.local.gateway.serving import ChatServing, ChoiceResult, Delta, PreparedRequest


def chat_choice(serving: ChatServing, prepared: PreparedRequest, result: ChoiceResult) -> dict[str, Any]:
    """A whole choice as a non-streaming response carries it (and as a capture records it)."""
    want_logprobs = bool(prepared.request.logprobs)
    return {
        "index": result.index,
        "message": result.message,
        "finish_reason": result.finish_reason,
        "logprobs": {"content": serving.logprob_entries(result.tokens)} if want_logprobs else None,
        **serving.token_fields(result),
        # the stop string that ended it (vLLM's field): only when one did
        **({"stop_reason": result.stop_string} if result.stop_string is not None else {}),
    }


async def complete(serving: ChatServing, prepared: PreparedRequest) -> dict[str, Any]:
    """The chat completion of a non-streaming call, in any dialect: the fold of the streaming events."""
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


class ChatDialect:
    """Plain chat completions, through the same call path as the other dialects."""

    expands = False

    def chat_request(self, raw: bytes) -> tuple[bytes, None]:
        return raw, None

    def reply(self, prepared: PreparedRequest, completion: dict[str, Any], context: None) -> dict[str, Any]:
        return completion

    async def stream(
        self, serving: ChatServing, prepared: PreparedRequest, record: Record, context: None
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
                        logprobs = (
                            {"content": serving.logprob_entries(event.tokens)} if want_logprobs else None
                        )
                        choice = {"index": event.index, "delta": {**head, **part}, "finish_reason": None}
                        yield chunk([{**choice, "logprobs": logprobs}])
                        event.tokens = []
                    continue
                delta: dict[str, Any] = {} if event.index in started else {"role": "assistant"}
                started.add(event.index)
                results.append(event)
                if len(results) == prepared.request.n:  # before the last chunk goes out: a client that stops
                    # reading at finish_reason and leaves its capture block must still find the call recorded
                    record(
                        [chat_choice(serving, prepared, r) for r in sorted(results, key=lambda r: r.index)]
                    )
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
            yield stream_error(exc, "internal_error")
        yield b"data: [DONE]\n\n"


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
