"""Parsing what a model writes into an OpenAI assistant message: content, reasoning_content, tool_calls.

The regions of a family's output (reasoning, content, each tool call) are found by transformers' streaming
`ResponseParser`, driven by the family's response template from `trl`. Two changes keep one bad call from
spoiling a response: the tool-call region is cut out as raw text (its open and close markers captured), and
each call is then parsed on its own by transformers' `parse_response` with the real template. A call that does
not parse, names a tool the request did not offer, or whose arguments are not an object, goes back into the
content verbatim. Content keeps its text as written, except the whitespace that separates it from a tool
call; reasoning is trimmed (templates wrap it in newlines). Streaming and non-streaming give the same text.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Literal

from artrl.random_ids import random_hex

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_OPEN = "artrl_open"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as in the OpenAI API

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Piece:
    """One step of a parsed response: text for a field, or a whole tool call."""

    kind: Literal["content", "reasoning", "tool_call"]
    text: str = ""
    call: ToolCall | None = None


def raw_call_template(template: dict[str, Any]) -> dict[str, Any]:
    """The template with its tool-call region kept as raw text: the open marker captured, the close marker in
    the body."""
    raw = copy.deepcopy(template)
    field = raw["fields"].get("tool_calls")
    if field is None:
        return raw
    if "open" in field:
        import regex

        field["open_pattern"] = regex.escape(field.pop("open"))
    field["open_pattern"] = f"(?P<{_OPEN}>{field['open_pattern']})"
    # the close marker stays in the body (a zero-width close right after it), so the raw text of a call is
    # its open capture + its body, also when the output ends inside the call
    field["close_pattern"] = f"(?<={field['close_pattern']})"
    field["content"] = "text"
    field.pop("content_args", None)
    field["transform"] = {_OPEN: "{" + _OPEN + "}"}
    return raw


class _Text:
    """One field's text, streamed. Trailing whitespace is held back until more text follows: it is dropped
    before a tool call (the template's separator) and, with `trim`, at both ends (reasoning, which templates
    wrap in newlines). The text of a stop token at the end (a region the template closes only with its own
    marker, such as reasoning cut short) is held back and dropped the same way."""

    def __init__(self, trim: bool, stops: tuple[str, ...]) -> None:
        self.trim, self.stops = trim, stops
        self.started = False
        self.held = ""
        self.text = ""

    def _keep(self, text: str) -> int:
        keep = len(text.rstrip())
        while True:
            stop = next((s for s in self.stops if text[:keep].endswith(s)), None)
            if stop is None:
                return keep
            keep = len(text[: keep - len(stop)].rstrip())

    def feed(self, text: str) -> str:
        if not self.started and self.trim:
            text = text.lstrip()
        if not text:
            return ""
        self.started = True
        text = self.held + text
        keep = self._keep(text)
        out, self.held = text[:keep], text[keep:]
        self.text += out
        return out

    def drop_held(self) -> None:
        self.held = ""

    def flush(self) -> str:
        out = "" if self.trim else self.held
        for stop in self.stops:
            out = out.split(stop)[0]
        self.held = ""
        self.text += out
        return out


class OutputParser:
    """Feed decoded text (special marker tokens kept), get Pieces; `finish()` at the end of the sequence."""

    def __init__(
        self,
        template: dict[str, Any] | None,
        raw_template: Any,  # a compiled ResponseTemplate (or its dict), None: no call syntax
        prompt_text: str,
        tools: list[dict[str, Any]] | None,
        allowed_names: set[str],
        stop_texts: tuple[str, ...] = (),
    ) -> None:
        from transformers.utils.chat_parsing.response_parser import ResponseParser

        self._template = template
        close = (template or {}).get("fields", {}).get("tool_calls", {}).get("close_pattern")
        self._closed = None
        if close:
            import regex

            self._closed = regex.compile(f"(?:{close})\\Z")  # a call counts only once its close marker is out
        self._tools = tools
        self._allowed = allowed_names
        self._parser = ResponseParser(raw_template, prefix=prompt_text) if raw_template is not None else None
        self._content, self._reasoning = _Text(False, stop_texts), _Text(True, stop_texts)
        self._call_body = ""
        self.calls: list[ToolCall] = []
        self._pending = self._route(self._parser.initial_events) if self._parser else []

    @property
    def content(self) -> str:
        return self._content.text

    @property
    def reasoning(self) -> str:
        return self._reasoning.text

    def feed(self, text: str) -> list[Piece]:
        pending, self._pending = self._pending, []
        if self._parser is None:
            return [*pending, *self._text("content", text)]
        return [*pending, *self._route(self._parser.feed(text))]

    def finish(self) -> list[Piece]:
        pieces, self._pending = self._pending, []
        if self._parser is not None:
            pieces += self._route(self._parser.finalize()[1])
        tail = self._content.flush()
        return [*pieces, Piece("content", tail)] if tail else pieces

    # ------------------------------------------------------------------ events → pieces
    def _text(self, kind: Literal["content", "reasoning"], text: str) -> list[Piece]:
        out = (self._content if kind == "content" else self._reasoning).feed(text)
        return [Piece(kind, out)] if out else []

    def _route(self, events: list[dict[str, Any]]) -> list[Piece]:
        pieces: list[Piece] = []
        for event in events:
            field = event["field"]
            if field == "tool_calls":
                if event["type"] == "region_open":
                    self._call_body = ""
                elif event["type"] == "region_chunk":
                    self._call_body += event["text"]
                else:
                    pieces += self._close_call(event["value"])
            elif event["type"] == "region_open" and field in _REASONING_FIELDS:
                self._content.drop_held()  # the whitespace before a reasoning block is the template's
            elif event["type"] == "region_chunk":
                kind = (
                    "reasoning" if field in _REASONING_FIELDS else "content" if field == "content" else None
                )
                if kind is not None:
                    pieces += self._text(kind, event["text"])
        return pieces

    def _close_call(self, captured: dict[str, Any]) -> list[Piece]:
        raw = captured.get(_OPEN, "") + self._call_body
        call = self._parse_call(raw)
        if call is None:
            return self._text("content", raw)
        self.calls.append(call)
        self._content.drop_held()
        return [Piece("tool_call", call=call)]

    def _parse_call(self, raw: str) -> ToolCall | None:
        if not self._allowed or self._template is None or (self._closed and not self._closed.search(raw)):
            return None
        from transformers.utils.chat_parsing.response_parser import parse_response

        try:
            parsed = parse_response(raw, self._template, prefix="", tools=self._tools)
        except Exception:  # whatever the model wrote, a call that does not parse is content, not an error
            return None
        calls = parsed.get("tool_calls") or []
        function = calls[0].get("function") if len(calls) == 1 and isinstance(calls[0], dict) else None
        if not isinstance(function, dict):
            return None
        name, arguments = function.get("name"), function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(name, str) or name not in self._allowed or not isinstance(arguments, dict):
            return None
        return ToolCall(f"call_{random_hex(24)}", name, json.dumps(arguments, ensure_ascii=False))
