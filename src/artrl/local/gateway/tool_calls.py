"""Hermes-style tool calls in generated text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

A block becomes a tool call only if it is complete, holds a JSON object with a string `name` of a tool the
request offered and object `arguments`; anything else stays in the message content, verbatim.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from artrl.local.chat_template import TOOL_CALL_END, TOOL_CALL_START

_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as in the OpenAI API

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _parse_block(body: str, allowed: set[str]) -> ParsedToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in allowed:
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(
        f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(arguments, ensure_ascii=False)
    )


def parse_tool_calls(text: str, allowed_names: set[str]) -> tuple[str | None, list[ParsedToolCall]]:
    """Split generated text into (content or None, tool calls)."""
    calls: list[ParsedToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = _parse_block(match.group(1), allowed_names)
        if call is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def forced_prefix(tool_choice: object) -> str:
    """Text placed after the generation prompt so the model must call a tool (tool_choice required/named).

    It becomes part of the prompt ids (forced, never trained), and the model samples the rest of the call.
    It stops before the space that follows `"arguments":` in a rendered call: byte-level BPE tokenizers
    merge that space into the next token (` {"`), so a prefix ending in a bare space would put the model
    after a token split it never sees in rendered calls (and it then writes malformed arguments).
    """
    if tool_choice == "required":
        return TOOL_CALL_START + "\n"
    name = getattr(getattr(tool_choice, "function", None), "name", None)
    if name is not None:
        return TOOL_CALL_START + "\n" + '{"name": ' + json.dumps(name) + ', "arguments":'
    return ""
