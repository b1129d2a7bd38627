"""`POST /v1/responses`: OpenAI's Responses API, served through the chat path (see the package docstring).

Input items (messages, `function_call`, `function_call_output`, `reasoning`) become chat messages; function
tools become chat tools; `previous_response_id` continues a response this gateway made (kept in memory, the
last `GatewayConfig.stored_responses`, within `stored_responses_bytes`), so a conversation continues token-exactly either way: sent back
whole, or by id. The answer's output items are the chat completion's reasoning, text and tool calls, with
the same token fields a chat choice carries (`prompt_token_ids`, `token_ids`, ...) on the response.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from artrl.config import GatewayConfig
from artrl.local.engine.contract import EngineError
from artrl.local.gateway.dialects.chat import chat_choice
from artrl.local.gateway.dialects.dialect import Record, json_body, stream_error, typed, usage
from artrl.local.gateway.dialects.responses_items import ResponseEvents, input_messages, output_items
from artrl.local.gateway.protocol import RequestError
from artrl.local.gateway.serving import ChatServing, ChoiceResult, Delta, PreparedRequest
from artrl.random_ids import random_hex

# accepted and without effect here (bookkeeping of OpenAI's hosted service)
_IGNORED = frozenset(
    {"store", "metadata", "user", "include", "service_tier", "prompt_cache_key", "safety_identifier"}
)
_PASSED = {  # Responses field -> chat field
    "model": "model",
    "temperature": "temperature",
    "top_p": "top_p",
    "max_output_tokens": "max_tokens",
    "parallel_tool_calls": "parallel_tool_calls",
    "stream": "stream",
    "top_logprobs": "top_logprobs",
    # artrl's and vLLM's extensions, as on chat completions
    "seed": "seed",
    "stop": "stop",
    "ignore_eos": "ignore_eos",
    "chat_template_kwargs": "chat_template_kwargs",
}


@dataclass
class Asked:
    """What an answer repeats of its request, and the conversation it continues."""

    body: dict[str, Any]
    history: list[dict[str, Any]]  # chat messages without the instructions (what previous_response_id keeps)
    response_id: str = field(default_factory=lambda: f"resp_{random_hex()}")
    created: int = field(default_factory=lambda: int(time.time()))


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(
                f"tools[{i}]: only function tools are served here, not {kind!r}", param="tools"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise RequestError(
                "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                param="tool_choice",
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _check_text(text: dict[str, Any]) -> None:
    """`text`: plain text only (structured outputs are not enforced by the gateway's sampling)."""
    fmt = text.get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise RequestError(f"text.format {kind!r} is not supported: plain text only", param="text.format")
    if text.get("verbosity") is not None:
        raise RequestError("text.verbosity is not supported", param="text.verbosity")


class ResponsesDialect:
    expands = True  # (previous_response_id: a stored conversation, however long)

    def __init__(self, config: GatewayConfig) -> None:
        # response id -> its conversation and that conversation's size as JSON; read on the preparation
        # thread, written on the event loop: under the lock
        self._kept: OrderedDict[str, tuple[list[dict[str, Any]], int]] = OrderedDict()
        self._kept_bytes = 0
        self._limit, self._byte_limit = config.stored_responses, config.stored_responses_bytes
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- request
    def chat_request(self, raw: bytes) -> tuple[bytes, Asked]:
        body = json_body(raw)
        unknown = set(body) - set(_PASSED) - _IGNORED - {"input", "instructions", "tools", "tool_choice"}
        unknown -= {"previous_response_id", "reasoning", "text", "truncation"}
        if unknown:
            raise RequestError(f"unsupported parameter(s): {', '.join(sorted(unknown))}", param=min(unknown))
        given = typed(body, "input", (str, list), "a string or a list of input items")
        instructions = typed(body, "instructions", str, "a string")
        tools = typed(body, "tools", list, "a list of function tools")
        typed(body, "chat_template_kwargs", dict, "an object")
        history = list(self._previous(body.get("previous_response_id")))
        history += input_messages(
            [{"role": "user", "content": given}] if isinstance(given, str) else given or []
        )
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
        chat: dict[str, Any] = {_PASSED[k]: v for k, v in body.items() if k in _PASSED and v is not None}
        chat.update(messages=messages, tools=_tools(tools) or None)
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if body.get("top_logprobs"):
            chat["logprobs"] = True
        _check_text(typed(body, "text", dict, "an object") or {})
        reasoning = typed(body, "reasoning", dict, "an object") or {}
        if reasoning.get("summary") is not None:
            raise RequestError("reasoning.summary is not supported: the model's reasoning is returned whole")
        effort = reasoning.get("effort")
        if effort is not None:  # gpt-oss's template reads it; any other template refuses it by name
            chat["chat_template_kwargs"] = {
                **chat.get("chat_template_kwargs", {}),
                "reasoning_effort": effort,
            }
        if body.get("truncation") not in (None, "disabled"):
            raise RequestError("truncation='auto' is not supported: the gateway never drops earlier input")
        return json.dumps({k: v for k, v in chat.items() if v is not None}).encode(), Asked(body, history)

    def _previous(self, response_id: Any) -> list[dict[str, Any]]:
        if response_id is None:
            return []
        with self._lock:
            kept = self._kept.get(response_id) if isinstance(response_id, str) else None
        if kept is None:
            raise RequestError(
                f"previous response {response_id!r} not found: the gateway keeps its last {self._limit} "
                f"responses, at most {self._byte_limit} bytes, in memory (GatewayConfig.stored_responses, "
                "stored_responses_bytes); send the conversation as input instead",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return kept[0]

    def _keep(self, asked: Asked, message: dict[str, Any]) -> None:
        if self._limit <= 0:
            return
        reply = {
            k: message[k] for k in ("role", "content", "tool_calls", "reasoning_content") if message.get(k)
        }
        conversation = [*asked.history, {"content": "", **reply}]
        size = len(json.dumps(conversation))  # (a long conversation kept by many ids is counted by each)
        with self._lock:
            replaced = self._kept.pop(asked.response_id, None)
            self._kept_bytes += size - (replaced[1] if replaced else 0)
            self._kept[asked.response_id] = (conversation, size)
            while len(self._kept) > self._limit or self._kept_bytes > self._byte_limit:
                self._kept_bytes -= self._kept.popitem(last=False)[1][1]

    # ---------------------------------------------------------------- answers
    def reply(self, prepared: PreparedRequest, completion: dict[str, Any], context: Asked) -> dict[str, Any]:
        choice = completion["choices"][0]
        self._keep(context, choice["message"])
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return self._response(context, output_items(choice["message"], status), choice, completion["usage"])

    def _response(
        self,
        asked: Asked,
        output: list[dict[str, Any]],
        choice: dict[str, Any] | None,
        use: dict[str, int] | None,
    ) -> dict[str, Any]:
        body = asked.body
        incomplete = choice is not None and choice["finish_reason"] == "length"
        status = "in_progress" if choice is None else "incomplete" if incomplete else "completed"
        response = {
            "id": asked.response_id,
            "object": "response",
            "created_at": asked.created,
            "status": status,
            "model": body.get("model"),
            "output": output,
            "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"),
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {},
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        }
        if use is not None:
            response["usage"] = {
                "input_tokens": use["prompt_tokens"],
                "output_tokens": use["completion_tokens"],
                "total_tokens": use["total_tokens"],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            }
        if choice is not None:  # the token-exact record, as on a chat choice
            for key in ("prompt_token_ids", "token_ids", "token_logprobs", "prompt_source", "policy_step"):
                response[key] = choice.get(key)
        return response

    async def stream(
        self, serving: ChatServing, prepared: PreparedRequest, record: Record, context: Asked
    ) -> AsyncIterator[bytes]:
        events = ResponseEvents()
        yield events.event("response.created", response=self._response(context, [], None, None))
        try:
            async for event in serving.events(prepared, streaming=True):
                if isinstance(event, Delta):
                    for out in events.pieces(event):
                        yield out
                elif isinstance(event, ChoiceResult):
                    for out in events.close("incomplete" if event.finish_reason == "length" else "completed"):
                        yield out
                    choice = chat_choice(serving, prepared, event)
                    record([choice])
                    self._keep(context, event.message)
                    final = self._response(context, events.output, choice, usage(prepared, [event]))
                    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                    yield events.event(kind, response=final)
        except EngineError as exc:
            yield stream_error(exc, "engine_error")
        except Exception as exc:  # headers are sent: the failure goes in the stream
            yield stream_error(exc, "internal_error")
