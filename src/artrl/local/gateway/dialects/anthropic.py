"""`POST /v1/messages`: Anthropic's Messages API, served through the chat path (see the package docstring).

Content blocks become chat messages (`tool_use` blocks an assistant's tool calls, each `tool_result` block
a tool message, `thinking` blocks its reasoning), tools with an `input_schema` become function tools, and
the chat completion comes back as `text`, `thinking` and `tool_use` blocks with a `stop_reason`. A
conversation sent back continues the calls the gateway made, token-exactly, as on chat completions.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from artrl.local.gateway.dialects.anthropic_items import (
    BlockEvents,
    content_blocks,
    message_body,
    sse_event,
    stop_fields,
)
from artrl.local.gateway.dialects.chat import chat_choice
from artrl.local.gateway.dialects.dialect import Record, failure_text, json_body, text_of, typed
from artrl.local.gateway.protocol import RequestError
from artrl.local.gateway.serving import ChatServing, ChoiceResult, Delta, PreparedRequest
from artrl.random_ids import random_hex

# accepted and without effect here (bookkeeping of Anthropic's hosted service)
_IGNORED = frozenset(
    {"metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics", "user_profile_id"}
    | {"workspace_id"}
)
_PASSED = {  # Messages field -> chat field
    "model": "model",
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop_sequences": "stop",
    "stream": "stream",
    # artrl's and vLLM's extensions, as on chat completions
    "seed": "seed",
    "ignore_eos": "ignore_eos",
    "chat_template_kwargs": "chat_template_kwargs",
}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise RequestError(f"{where}: content must be a string or a list of content blocks", param="messages")
    return content


def _text(blocks: Any, where: str) -> str:
    parts = []
    for block in _blocks(blocks, where):
        if block.get("type") != "text":
            raise RequestError(f"{where}: block type {block.get('type')!r} is not supported here (text only)")
        parts.append(text_of(block.get("text"), f"{where} text"))
    return "".join(parts)


def chat_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    """Anthropic `system` + `messages` -> chat messages."""
    out: list[dict[str, Any]] = [{"role": "system", "content": _text(system, "system")}] if system else []
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise RequestError(f"{where}: role must be 'user' or 'assistant', not {role!r}", param="messages")
        blocks = _blocks(message.get("content"), where)
        if role == "assistant":
            if i == len(messages) - 1:
                raise RequestError(
                    f"{where}: a final assistant message (a prefill for the model to continue) is not supported; "
                    "end with a user message",
                    param="messages",
                )
            out.append(_assistant(blocks, where))
            continue
        text = []
        for block in blocks:
            kind = block.get("type")
            if kind == "tool_result":
                content = block.get("content", "")
                result = content if isinstance(content, str) else _text(content, f"{where} tool_result")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
            elif kind == "text":
                text.append(text_of(block.get("text"), f"{where} text"))
            else:
                raise RequestError(f"{where}: block type {kind!r} is not supported (text, tool_result)")
        if text:
            out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            message["content"] += text_of(block.get("text"), f"{where} text")
        elif kind == "tool_use":
            if not isinstance(block.get("input", {}), dict):
                raise RequestError(f"{where}: a tool_use block's input is an object", param="messages")
            text_of(block.get("id"), f"{where} tool_use id")
            text_of(block.get("name"), f"{where} tool_use name")
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            call = {
                "id": block.get("id"),
                "type": "function",
                "function": {"name": block.get("name"), "arguments": arguments},
            }
            message.setdefault("tool_calls", []).append(call)
        elif kind == "thinking":
            thought = text_of(block.get("thinking"), f"{where} thinking")
            message["reasoning_content"] = message.get("reasoning_content", "") + thought
        elif kind != "redacted_thinking":
            raise RequestError(f"{where}: block type {kind!r} is not supported (text, tool_use, thinking)")
    return message


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """Anthropic tool_choice -> (chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise RequestError(
            "tool_choice must be {'type': 'auto' | 'any' | 'tool' | 'none'}", param="tool_choice"
        )
    kind = choice["type"]
    chat = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {
        "type": "function",
        "function": {"name": choice.get("name")},
    }
    return chat, (False if choice.get("disable_parallel_tool_use") else None)


class MessagesDialect:
    expands = False

    def chat_request(self, raw: bytes) -> tuple[bytes, dict[str, Any]]:
        body = json_body(raw)
        unknown = (
            set(body) - set(_PASSED) - _IGNORED - {"system", "messages", "tools", "tool_choice", "thinking"}
        )
        unknown -= {"top_k"}
        if unknown:
            raise RequestError(f"unsupported parameter(s): {', '.join(sorted(unknown))}", param=min(unknown))
        if body.get("top_k") not in (None, 0, -1):
            raise RequestError("top_k is not supported: sampling uses the whole distribution (top_p works)")
        for name, kinds, what in (
            ("system", (str, list), "a string or a list of text blocks"),
            ("tools", list, "a list of tools"),
            ("tool_choice", dict, "an object"),
            ("thinking", dict, "an object"),
            ("chat_template_kwargs", dict, "an object"),
            ("stop_sequences", list, "a list of strings"),
        ):
            typed(body, name, kinds, what)
        if not isinstance(body.get("max_tokens"), int):
            raise RequestError(
                "max_tokens is required (an integer), as Anthropic's API requires it", param="max_tokens"
            )
        chat: dict[str, Any] = {_PASSED[k]: v for k, v in body.items() if k in _PASSED and v is not None}
        chat["messages"] = chat_messages(body.get("system"), body.get("messages"))
        tools = []
        for i, tool in enumerate(body.get("tools") or []):
            if not isinstance(tool, dict) or "input_schema" not in tool:
                raise RequestError(
                    f"tools[{i}]: only custom tools (name, description, input_schema)", param="tools"
                )
            function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
            if tool.get("description"):
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
        if tools:
            chat["tools"] = tools
        choice, parallel = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
        thinking = body.get("thinking")
        if thinking is not None and thinking.get("type") not in ("enabled", "disabled"):
            raise RequestError(
                f"thinking type {thinking.get('type')!r} is not supported: 'enabled' or 'disabled' (the template's "
                "enable_thinking; budget_tokens is not enforced: max_tokens bounds the whole turn)",
                param="thinking",
            )
        if thinking is not None:
            # the family's own switch (Qwen3, GLM, Gemma 4 read enable_thinking; others refuse it by name)
            kwargs = {
                **chat.get("chat_template_kwargs", {}),
                "enable_thinking": thinking["type"] == "enabled",
            }
            chat["chat_template_kwargs"] = kwargs
        return json.dumps(chat).encode(), {"model": body.get("model"), "id": f"msg_{random_hex()}"}

    def reply(
        self, prepared: PreparedRequest, completion: dict[str, Any], context: dict[str, Any]
    ) -> dict[str, Any]:
        choice = completion["choices"][0]
        use = completion["usage"]
        return message_body(
            context, content_blocks(choice["message"]), choice, use["prompt_tokens"], use["completion_tokens"]
        )

    async def stream(
        self, serving: ChatServing, prepared: PreparedRequest, record: Record, context: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        prompt_tokens = len(prepared.prompt.ids)
        start = message_body(context, [], None, prompt_tokens, 0)
        yield sse_event("message_start", message=start)
        blocks = BlockEvents()
        try:
            async for event in serving.events(prepared, streaming=True):
                if isinstance(event, Delta):
                    for out in blocks.pieces(event):
                        yield out
                elif isinstance(event, ChoiceResult):
                    for out in blocks.close():
                        yield out
                    choice = chat_choice(serving, prepared, event)
                    record([choice])
                    stop = stop_fields(choice)
                    tokens = {
                        k: choice[k]
                        for k in ("prompt_token_ids", "token_ids", "token_logprobs", "prompt_source")
                    }
                    yield sse_event(
                        "message_delta", delta=stop, usage={"output_tokens": len(event.tokens)}, **tokens
                    )
                    yield sse_event("message_stop")
        except Exception as exc:  # headers are sent: the failure goes in the stream
            yield sse_event(
                "error", error={"type": "api_error", "message": failure_text(exc, "generation failed")}
            )
