"""Chat completions: messages → prompt ids → engine → OpenAI-shaped choices with exact token ids.

One event generator serves both modes: streaming sends its events as SSE chunks, non-streaming folds the
same events into one response. Every choice carries `prompt_token_ids`, `token_ids`, `token_logprobs` and
`prompt_source` ("continuation" or "rendered") as extra fields, and is remembered for continuation.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from artrl.local.chat_template import TOOL_CALL_START
from artrl.local.engine import Engine, SequenceStream
from artrl.local.gateway.messages import normalize_messages
from artrl.local.gateway.prompts import Prompt, PromptBuilder
from artrl.local.gateway.protocol import ChatRequest, RequestError
from artrl.local.gateway.tool_calls import forced_prefix, parse_tool_calls
from artrl.local.sampling import SamplingParams, TokenChoice


@dataclass
class Delta:
    index: int
    text: str
    tokens: list[TokenChoice]


@dataclass
class ChoiceResult:
    index: int
    message: dict[str, Any]
    finish_reason: str
    prompt: Prompt
    tokens: list[TokenChoice] = field(default_factory=list)
    streamed_text: str = ""


@dataclass
class PreparedRequest:
    request: ChatRequest
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt: Prompt
    params: SamplingParams
    forced: str
    stops: list[str]
    tool_names: set[str]
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def _held_back(text: str, markers: list[str]) -> int:
    """Length of the longest suffix of text that could still grow into one of markers."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:size]):
                longest = max(longest, size)
                break
    return longest


class ChatServing:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        builder: PromptBuilder,
        model_names: list[str],
        default_max_tokens: int,
        max_n: int,
        stop_token_ids: frozenset[int],
    ) -> None:
        self.engine, self.tokenizer, self.builder = engine, tokenizer, builder
        self.model_names = model_names
        self.default_max_tokens, self.max_n = default_max_tokens, max_n
        self.stop_token_ids = stop_token_ids

    # ------------------------------------------------------------------ request → prepared
    def prepare(self, request: ChatRequest) -> PreparedRequest:
        if request.model not in self.model_names:
            raise RequestError(
                f"model {request.model!r} is not served here; available: {self.model_names}",
                param="model",
                code="model_not_found",
                status=404,
            )
        if request.n > self.max_n:
            raise RequestError(
                f"n={request.n} exceeds the limit of {self.max_n}", param="n", code="invalid_value"
            )
        messages = normalize_messages(request.messages)
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        tool_names = {t["function"]["name"] for t in tools or []}
        use_tools = bool(tools) and request.tool_choice != "none"
        forced = forced_prefix(request.tool_choice) if use_tools else ""
        prompt = self.builder.build(messages, tools, forced)
        room = self.engine.max_context - len(prompt.ids)
        if room <= 0:
            raise RequestError(
                f"the prompt is {len(prompt.ids)} tokens; this model's context is "
                f"{self.engine.max_context}. Shorten the messages.",
                param="messages",
                code="context_length_exceeded",
            )
        asked = request.max_completion_tokens or request.max_tokens
        if asked is not None and asked > room:
            raise RequestError(
                f"max_tokens={asked} + the prompt's {len(prompt.ids)} tokens exceed the context of "
                f"{self.engine.max_context}; ask for at most {room}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        params = SamplingParams(
            max_tokens=asked or min(self.default_max_tokens, room),
            temperature=1.0 if request.temperature is None else float(request.temperature),
            top_p=1.0 if request.top_p is None else float(request.top_p),
            seed=request.seed,
            top_logprobs=(request.top_logprobs or 0) if request.logprobs else 0,
            stop_token_ids=self.stop_token_ids,
        )
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        if any(not s for s in stops):
            raise RequestError("stop strings must be non-empty", param="stop", code="invalid_value")
        return PreparedRequest(
            request, messages, tools, prompt, params, forced, stops, tool_names if use_tools else set()
        )

    # ------------------------------------------------------------------ events
    async def events(self, prepared: PreparedRequest, streaming: bool) -> AsyncIterator[Delta | ChoiceResult]:
        streams = self.engine.generate(prepared.prompt.ids, prepared.params, prepared.request.n)
        queue: asyncio.Queue[Delta | ChoiceResult | BaseException | None] = asyncio.Queue()

        async def pump(index: int, stream: SequenceStream) -> None:
            try:
                async for event in self._choice_events(index, stream, prepared, streaming):
                    await queue.put(event)
            except BaseException as exc:  # delivered to the consumer, which re-raises it
                await queue.put(exc)
            finally:
                stream.abort()
                await queue.put(None)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for stream in streams:
                stream.abort()
            for task in tasks:
                task.cancel()

    async def _choice_events(
        self, index: int, stream: SequenceStream, prepared: PreparedRequest, streaming: bool
    ) -> AsyncIterator[Delta | ChoiceResult]:
        tokens: list[TokenChoice] = []
        unsent: list[TokenChoice] = []
        emitted = 0
        stop_hit = False
        incremental = streaming or bool(prepared.stops)
        markers = prepared.stops + ([TOOL_CALL_START] if prepared.tool_names else [])
        text = prepared.forced
        async for token in stream:
            tokens.append(token)
            unsent.append(token)
            if not incremental:
                continue
            text = prepared.forced + self._decode(tokens)
            for stop in prepared.stops:
                at = text.find(stop, max(0, emitted - len(stop)))
                if at >= 0:
                    text, stop_hit = text[:at], True
            if streaming:
                safe = len(text) - _held_back(text, markers) if not stop_hit else len(text)
                if prepared.tool_names:  # a tool call may follow: hold back it and the whitespace before it
                    visible = text[: text.index(TOOL_CALL_START)] if TOOL_CALL_START in text else text[:safe]
                    safe = min(safe, len(visible.rstrip()))
                while safe > emitted and text[safe - 1] == "\ufffd":
                    safe -= 1  # an incomplete UTF-8 sequence: wait for its next byte
                if safe > emitted or (unsent and prepared.request.logprobs):
                    yield Delta(index, text[emitted : max(safe, emitted)], unsent)
                    emitted, unsent = max(safe, emitted), []
            if stop_hit:
                stream.abort()
                break
        if not incremental:
            text = prepared.forced + self._decode(tokens)
        content, calls = parse_tool_calls(text, prepared.tool_names) if prepared.tool_names else (text, [])
        finish = "stop" if stop_hit else (stream.finish_reason or "stop")
        if calls and finish == "stop":
            finish = "tool_calls"
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        ids = [t.token_id for t in tokens]
        self.builder.remember(prepared.messages, prepared.tools, message, prepared.prompt.ids, ids)
        yield ChoiceResult(index, message, finish, prepared.prompt, tokens, text[:emitted])

    def _decode(self, tokens: list[TokenChoice]) -> str:
        return self.tokenizer.decode(
            [t.token_id for t in tokens], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    # ------------------------------------------------------------------ OpenAI shapes
    def logprob_entries(self, tokens: list[TokenChoice]) -> list[dict[str, Any]]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [
            {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs]}
            for t in tokens
        ]

    def token_fields(self, result: ChoiceResult) -> dict[str, Any]:
        return {
            "prompt_token_ids": result.prompt.ids,
            "token_ids": [t.token_id for t in result.tokens],
            "token_logprobs": [t.logprob for t in result.tokens],
            "prompt_source": result.prompt.source,
        }
