"""The Responses API's items: input items as chat messages, and the output items and streaming events built
from a chat message or the serving layer's pieces (see responses.py)."""

from __future__ import annotations

import json
from typing import Any

from artrl.local.gateway.dialects.dialect import text_of
from artrl.local.gateway.protocol import RequestError
from artrl.local.gateway.serving import Delta
from artrl.random_ids import random_hex


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(
                    f"{where}: content part {kind!r} is not supported (text only)", param="input"
                )
            parts.append(text_of(part.get("text"), f"{where} text"))
        return "".join(parts)
    raise RequestError(f"{where}: content must be a string or a list of text parts", param="input")


def input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages (consecutive assistant items make one assistant message)."""
    messages: list[dict[str, Any]] = []

    def assistant() -> dict[str, Any]:
        if not messages or messages[-1]["role"] != "assistant" or messages[-1].get("_closed"):
            messages.append({"role": "assistant", "content": ""})
        return messages[-1]

    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RequestError(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(
                    f"input[{i}]: role {role!r} is not one of user, system, developer, assistant"
                )
            text = _text(item.get("content"), f"input[{i}]")
            if role == "assistant":
                message = assistant()
                message["content"] = (message.get("content") or "") + text
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments", "")}
            if not all(isinstance(x, str) for x in (call["id"], item.get("name"), item.get("arguments", ""))):
                raise RequestError(
                    f"input[{i}]: a function_call needs call_id, name and arguments (strings)", param="input"
                )
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["_closed"] = True
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"input[{i}].output")
            call_id = text_of(item.get("call_id"), f"input[{i}].call_id")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
                raise RequestError(
                    f"input[{i}]: a reasoning item's content is a list of parts", param="input"
                )
            text = "".join(text_of(p.get("text"), f"input[{i}] reasoning text") for p in parts)
            if text:
                assistant()["reasoning_content"] = text
        else:
            raise RequestError(f"input[{i}]: item type {kind!r} is not supported", param="input")
    for message in messages:
        message.pop("_closed", None)
    return messages


def output_items(message: dict[str, Any], status: str = "completed") -> list[dict[str, Any]]:
    """A chat assistant message -> Responses output items: reasoning, text, then each function call."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(_message_item(message["content"], status))
    for call in message.get("tool_calls") or []:
        items.append(_call_item(call, "completed"))
    return items


def _reasoning_item(text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": f"rs_{random_hex()}", "summary": [], "content": content}


def _message_item(text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if text else []
    return {
        "type": "message",
        "id": f"msg_{random_hex()}",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "function_call",
        "id": f"fc_{random_hex()}",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": status,
    }


class ResponseEvents:
    """The Responses streaming events of one response, built as the serving layer's pieces arrive."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item being written
        self.text = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def pieces(self, delta: Delta) -> list[bytes]:
        out: list[bytes] = []
        for piece in delta.pieces:
            if piece.kind in ("reasoning", "content"):
                kind = "reasoning" if piece.kind == "reasoning" else "message"
                if self.open is None or self.open["type"] != kind:
                    out += self.close()
                    out += self._open(kind)
                self.text += piece.text
                name = (
                    "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                )
                extra = {} if kind == "reasoning" else {"logprobs": []}
                out.append(self.event(name, delta=piece.text, **self._where(), **extra))
            else:
                assert piece.call is not None
                out += self.close()
                item = _call_item(piece.call.as_openai(), "in_progress")
                self.output.append(item)
                index = len(self.output) - 1
                out.append(
                    self.event(
                        "response.output_item.added", item={**item, "arguments": ""}, output_index=index
                    )
                )
                where = {"item_id": item["id"], "output_index": index}
                out.append(
                    self.event("response.function_call_arguments.delta", delta=item["arguments"], **where)
                )
                out.append(
                    self.event("response.function_call_arguments.done", arguments=item["arguments"], **where)
                )
                item["status"] = "completed"
                out.append(self.event("response.output_item.done", item=item, output_index=index))
        return out

    def _open(self, kind: str) -> list[bytes]:
        item = _reasoning_item("") if kind == "reasoning" else _message_item("", "in_progress")
        item["content"] = []
        self.open, self.text = item, ""
        self.output.append(item)
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _text_part("")
        return [
            self.event("response.output_item.added", item=item, output_index=len(self.output) - 1),
            self.event("response.content_part.added", part=part, **self._where()),
        ]

    def close(self, status: str = "completed") -> list[bytes]:
        """Close the item being written (a message cut at max_output_tokens: status 'incomplete')."""
        if self.open is None:
            return []
        item, where = self.open, self._where()
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            done = [self.event("response.reasoning_text.done", text=self.text, **where)]
        else:
            part = _text_part(self.text)
            done = [self.event("response.output_text.done", text=self.text, logprobs=[], **where)]
            item["status"] = status
        item["content"] = [part]
        done.append(self.event("response.content_part.done", part=part, **where))
        done.append(self.event("response.output_item.done", item=item, output_index=where["output_index"]))
        self.open = None
        return done


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
