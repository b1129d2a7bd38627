"""The canonical form of a chat message: what makes two messages "the same" for artrl, wherever it asks.

The gateway recognises a conversation it served by it (token-exact continuation), and a capture links its
records into conversations by it. Compared: the role (developer = system), the text content (None = "";
text parts joined), the tool calls (id, name, parsed arguments: JSON spacing and key order do not matter)
and a tool result's tool_call_id. Ignored: everything else, reasoning included (clients may or may not send
it back).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return content if isinstance(content, str) else ""


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def canonical_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        return {"unknown": repr(message)}
    role = "system" if message.get("role") == "developer" else message.get("role")
    calls = [
        [
            c.get("id"),
            (c.get("function") or {}).get("name"),
            _arguments((c.get("function") or {}).get("arguments")),
        ]
        for c in message.get("tool_calls") or []
        if isinstance(c, dict)
    ]
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content")), "tool_calls": calls}
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    return out


def message_key(message: Any) -> str:
    """The canonical form as a string (for dictionaries and prefix comparisons)."""
    return json.dumps(canonical_message(message), sort_keys=True, ensure_ascii=False)


def conversation_key(messages: list[Any], tools: list[dict[str, Any]] | None) -> str:
    """Identifies (messages, tools) across requests: a sha256 of their canonical form."""
    blob = json.dumps(
        [[canonical_message(m) for m in messages], tools or []], sort_keys=True, ensure_ascii=False
    )
    return hashlib.sha256(blob.encode()).hexdigest()
