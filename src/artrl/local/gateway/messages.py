"""Checking and normalising chat messages (their canonical form for recognising a conversation is
`artrl.canonical`, shared with capture).

Normalised messages are plain dicts that chat templates understand: string `content`, OpenAI-shaped
`tool_calls` with string `arguments`, `tool_call_id` on tool results.
"""

from __future__ import annotations

import json
from typing import Any

from artrl.local.gateway.protocol import RequestError

_ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any, where: str, *, allow_none: bool = False) -> str | None:
    if content is None and allow_none:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"{where}.content[{j}] must be {{'type': 'text', 'text': str}}; only text parts are supported",
                    param=f"{where}.content",
                    code="invalid_value",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(
        f"{where}.content must be a string or a list of text parts, got {type(content).__name__}",
        param=f"{where}.content",
        code="invalid_value",
    )


def _arguments(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise RequestError(f"{where}.function.arguments must be a JSON string", param=where, code="invalid_value")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not calls:
        raise RequestError(f"{where}.tool_calls must be a non-empty list", param=where, code="invalid_value")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(call.get("id"), str)
        ):
            raise RequestError(
                f"{at} must have a string 'id' and a 'function' with a string 'name'",
                param=at,
                code="invalid_value",
            )
        if call.get("type", "function") != "function":
            raise RequestError(f"{at}.type must be 'function'", param=at, code="invalid_value")
        out.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments", "{}"), at)},
            }
        )
    return out


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Check every message; return template-ready dicts. Raises RequestError on the first problem."""
    out: list[dict[str, Any]] = []
    open_calls: set[str] = set()  # tool_call ids of the latest assistant turn not yet answered
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object", param=where, code="invalid_value")
        role = m.get("role")
        if role not in _ROLES:
            raise RequestError(
                f"{where}.role {role!r} is not one of {', '.join(_ROLES)}",
                param=f"{where}.role",
                code="invalid_value",
            )
        if role in ("system", "developer"):
            out.append({"role": "system", "content": _text(m.get("content"), where)})
        elif role == "user":
            if "content" not in m:
                raise RequestError(f"{where} (user) needs 'content'", param=where, code="invalid_value")
            out.append({"role": "user", "content": _text(m["content"], where)})
        elif role == "assistant":
            msg: dict[str, Any] = {
                "role": "assistant",
                "content": _text(m.get("content"), where, allow_none=True),
            }
            if m.get("tool_calls"):  # None and [] both mean "no tool calls"
                msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
            elif msg["content"] is None:
                raise RequestError(
                    f"{where} (assistant) needs 'content' or 'tool_calls'", param=where, code="invalid_value"
                )
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise RequestError(
                        f"{where}.reasoning_content must be a string", param=where, code="invalid_value"
                    )
                msg["reasoning_content"] = reasoning
            open_calls = {c["id"] for c in msg.get("tool_calls", [])}
            out.append(msg)
        else:  # tool
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise RequestError(
                    f"{where} (tool) needs a string 'tool_call_id'", param=where, code="invalid_value"
                )
            if call_id not in open_calls:
                raise RequestError(
                    f"{where} answers tool_call_id {call_id!r}, which no preceding assistant message called "
                    "(or which was already answered)",
                    param=f"{where}.tool_call_id",
                    code="invalid_value",
                )
            open_calls.discard(call_id)
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(m.get("content"), where)})
    return out
