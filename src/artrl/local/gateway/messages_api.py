"""`POST /v1/messages`: Anthropic's Messages API, served through the chat path (see dialects.py).

Content blocks become chat messages (`tool_use` blocks an assistant's tool calls, each `tool_result` block
a tool message, `thinking` blocks its reasoning), tools with an `input_schema` become function tools, and
the chat completion comes back as `text`, `thinking` and `tool_use` blocks with a `stop_reason`. A
conversation sent back continues the calls the gateway made, token-exactly, as on chat completions.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from artrl.local.engine import EngineError
from artrl.local.gateway.dialects import Record, chat_choice
from artrl.local.gateway.protocol import RequestError
from artrl.local.gateway.serving import ChatServing, ChoiceResult, Delta, PreparedRequest

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
_STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


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
        parts.append(str(block.get("text", "")))
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
                text.append(str(block.get("text", "")))
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
            message["content"] += str(block.get("text", ""))
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            call = {
                "id": block.get("id"),
                "type": "function",
                "function": {"name": block.get("name"), "arguments": arguments},
            }
            message.setdefault("tool_calls", []).append(call)
        elif kind == "thinking":
            message["reasoning_content"] = message.get("reasoning_content", "") + str(
                block.get("thinking", "")
            )
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
    def chat_request(self, raw: bytes) -> tuple[bytes, dict[str, Any]]:
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise RequestError(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        unknown = (
            set(body) - set(_PASSED) - _IGNORED - {"system", "messages", "tools", "tool_choice", "thinking"}
        )
        unknown -= {"top_k"}
        if unknown:
            raise RequestError(f"unsupported parameter(s): {', '.join(sorted(unknown))}", param=min(unknown))
        if body.get("top_k") not in (None, 0, -1):
            raise RequestError("top_k is not supported: sampling uses the whole distribution (top_p works)")
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
        if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
            # the family's own switch (Qwen3, GLM, Gemma 4 read enable_thinking; others refuse it by name)
            kwargs = {
                **chat.get("chat_template_kwargs", {}),
                "enable_thinking": thinking["type"] == "enabled",
            }
            chat["chat_template_kwargs"] = kwargs
        return json.dumps(chat).encode(), {"model": body.get("model"), "id": f"msg_{uuid.uuid4().hex}"}

    def reply(
        self, prepared: PreparedRequest, completion: dict[str, Any], context: dict[str, Any]
    ) -> dict[str, Any]:
        choice = completion["choices"][0]
        use = completion["usage"]
        return _message(
            context, content_blocks(choice["message"]), choice, use["prompt_tokens"], use["completion_tokens"]
        )

    async def stream(
        self, serving: ChatServing, prepared: PreparedRequest, record: Record, context: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        prompt_tokens = len(prepared.prompt.ids)
        start = _message(context, [], None, prompt_tokens, 0)
        yield _event("message_start", message=start)
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
                    stop = {
                        "stop_reason": _STOP_REASON.get(event.finish_reason, "end_turn"),
                        "stop_sequence": None,
                    }
                    tokens = {
                        k: choice[k]
                        for k in ("prompt_token_ids", "token_ids", "token_logprobs", "prompt_source")
                    }
                    yield _event(
                        "message_delta", delta=stop, usage={"output_tokens": len(event.tokens)}, **tokens
                    )
                    yield _event("message_stop")
        except Exception as exc:  # headers are sent: the failure goes in the stream
            kind = "api_error" if isinstance(exc, EngineError) else "internal_error"
            yield _event(
                "error", error={"type": kind, "message": f"generation failed: {type(exc).__name__}: {exc}"}
            )


def _event(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n".encode()


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat assistant message -> Anthropic content blocks: thinking, text, then each tool_use."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append(_tool_use(call))
    return blocks


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        arguments = {}
    if not isinstance(arguments, dict):
        arguments = {"value": arguments}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments}


def _message(
    context: dict[str, Any],
    content: list[dict[str, Any]],
    choice: dict[str, Any] | None,
    prompt: int,
    sampled: int,
) -> dict[str, Any]:
    message = {
        "id": context["id"],
        "type": "message",
        "role": "assistant",
        "model": context["model"],
        "content": content,
        "stop_reason": None if choice is None else _STOP_REASON.get(choice["finish_reason"], "end_turn"),
        "stop_sequence": None,
        "usage": {
            "input_tokens": prompt,
            "output_tokens": sampled,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }
    if choice is not None:  # the token-exact record, as on a chat choice
        for key in ("prompt_token_ids", "token_ids", "token_logprobs", "prompt_source", "policy_step"):
            message[key] = choice.get(key)
    return message


class BlockEvents:
    """The content-block events of one streamed message, built as the serving layer's pieces arrive."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text" or "thinking": the block being written

    def pieces(self, delta: Delta) -> list[bytes]:
        out: list[bytes] = []
        for piece in delta.pieces:
            if piece.kind in ("reasoning", "content"):
                kind = "thinking" if piece.kind == "reasoning" else "text"
                if self.open != kind:
                    out += self.close()
                    self.index, self.open = self.index + 1, kind
                    block = (
                        {"type": kind, kind: ""}
                        if kind == "text"
                        else {"type": kind, kind: "", "signature": ""}
                    )
                    out.append(_event("content_block_start", index=self.index, content_block=block))
                change = (
                    {"type": "text_delta", "text": piece.text}
                    if kind == "text"
                    else {
                        "type": "thinking_delta",
                        "thinking": piece.text,
                    }
                )
                out.append(_event("content_block_delta", index=self.index, delta=change))
            else:
                assert piece.call is not None
                out += self.close()
                self.index += 1
                use = _tool_use(piece.call.as_openai())
                out.append(
                    _event("content_block_start", index=self.index, content_block={**use, "input": {}})
                )
                partial = json.dumps(use["input"], ensure_ascii=False)
                out.append(
                    _event(
                        "content_block_delta",
                        index=self.index,
                        delta={"type": "input_json_delta", "partial_json": partial},
                    )
                )
                out.append(_event("content_block_stop", index=self.index))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(
                _event(
                    "content_block_delta",
                    index=self.index,
                    delta={"type": "signature_delta", "signature": ""},
                )
            )
        out.append(_event("content_block_stop", index=self.index))
        self.open = None
        return out
