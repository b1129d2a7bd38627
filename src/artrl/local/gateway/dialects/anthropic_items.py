"""Anthropic Messages' content blocks and streaming events, built from a chat message or the serving layer's
pieces (see anthropic.py)."""

from __future__ import annotations

import json
from typing import Any

from artrl.local.gateway.serving import Delta

_STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_fields(choice: dict[str, Any]) -> dict[str, Any]:
    """stop_reason and stop_sequence of a finished chat choice (a request's stop string: 'stop_sequence')."""
    if choice.get("stop_reason") is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": choice["stop_reason"]}
    return {"stop_reason": _STOP_REASON.get(choice["finish_reason"], "end_turn"), "stop_sequence": None}


def sse_event(kind: str, **fields: Any) -> bytes:
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


def message_body(
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
        **(stop_fields(choice) if choice is not None else {"stop_reason": None, "stop_sequence": None}),
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
                    out.append(sse_event("content_block_start", index=self.index, content_block=block))
                change = (
                    {"type": "text_delta", "text": piece.text}
                    if kind == "text"
                    else {
                        "type": "thinking_delta",
                        "thinking": piece.text,
                    }
                )
                out.append(sse_event("content_block_delta", index=self.index, delta=change))
            else:
                assert piece.call is not None
                out += self.close()
                self.index += 1
                use = _tool_use(piece.call.as_openai())
                out.append(
                    sse_event("content_block_start", index=self.index, content_block={**use, "input": {}})
                )
                partial = json.dumps(use["input"], ensure_ascii=False)
                out.append(
                    sse_event(
                        "content_block_delta",
                        index=self.index,
                        delta={"type": "input_json_delta", "partial_json": partial},
                    )
                )
                out.append(sse_event("content_block_stop", index=self.index))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(
                sse_event(
                    "content_block_delta",
                    index=self.index,
                    delta={"type": "signature_delta", "signature": ""},
                )
            )
        out.append(sse_event("content_block_stop", index=self.index))
        self.open = None
        return out
