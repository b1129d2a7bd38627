"""Chat completions: messages → prompt ids → engine → OpenAI-shaped choices with exact token ids.

One event generator serves both modes: streaming sends its events as SSE chunks, non-streaming folds the
same events into one response. The model's text is decoded with the chat format's marker tokens kept and
parsed by the format (`artrl.local.chat_format`) into content, reasoning_content and tool calls. Every
choice carries `prompt_token_ids`, `token_ids`, `token_logprobs` and `prompt_source` ("continuation" or
"rendered") as extra fields, and is remembered for continuation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from artrl.local.chat_format import ChatFormat, Piece
from artrl.local.chat_format.decoding import IncrementalDecoder, decode_all
from artrl.local.engine.contract import Engine, SamplingParams, SequenceStream, TokenChoice
from artrl.local.gateway.messages import normalize_messages
from artrl.local.gateway.names import ServedNames
from artrl.local.gateway.prompts import Prompt, PromptBuilder
from artrl.local.gateway.protocol import ChatRequest, NamedToolChoice, RequestError
from artrl.local.gateway.stop_strings import StopStrings
from artrl.random_ids import random_hex


@dataclass
class Delta:
    index: int
    pieces: list[Piece]
    tokens: list[TokenChoice]


@dataclass
class ChoiceResult:
    index: int
    message: dict[str, Any]
    finish_reason: str
    prompt: Prompt
    tokens: list[TokenChoice] = field(default_factory=list)
    policy_step: int | None = None  # the step the gateway served when the request arrived (PreparedRequest)
    stop_string: str | None = None  # the request's stop string that ended it (finish_reason "stop")


@dataclass
class PreparedRequest:
    request: ChatRequest
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    prompt: Prompt
    params: SamplingParams
    forced: str
    stops: list[str]
    tool_names: set[str]
    one_call: bool  # parallel_tool_calls=false: the turn ends after its first tool call
    # the step served when the request arrived: the policy that sampled it (the embedded engine may finish a
    # sequence on newer weights: then the tokens are fresher than this says, never older); None: unknown
    policy_step: int | None = None
    id: str = field(default_factory=lambda: f"chatcmpl-{random_hex()}")
    created: int = field(default_factory=lambda: int(time.time()))


class ChatServing:
    def __init__(
        self,
        engine: Engine,
        chat_format: ChatFormat,
        builder: PromptBuilder,
        names: ServedNames,
        default_max_tokens: int,
        max_n: int,
    ) -> None:
        self.engine, self.format, self.builder = engine, chat_format, builder
        self.tokenizer = chat_format.tokenizer
        self.names = names  # the model's name and `name@step` (the step it serves now)
        self.default_max_tokens, self.max_n = default_max_tokens, max_n
        self.generating = 0  # requests whose generation runs now (read and changed on the event loop only)

    # ------------------------------------------------------------------ request → prepared
    def prepare(self, request: ChatRequest) -> PreparedRequest:
        """Check the request and build its prompt: rendering and tokenising, the costly part of a request
        before generation. The gateway runs it on its preparation thread (with the builder's own copy of the
        tokenizer), so the event loop keeps serving every other client meanwhile."""
        policy_step = self.names.step  # (before anything else: a publish may move it meanwhile)
        pinned = self.names.check(request.model)
        if request.n > self.max_n:
            raise RequestError(
                f"n={request.n} exceeds the limit of {self.max_n}", param="n", code="invalid_value"
            )
        messages = normalize_messages(request.messages)
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        kwargs = dict(request.chat_template_kwargs or {})
        try:
            self.builder.format.check_kwargs(kwargs)
        except ValueError as exc:
            raise RequestError(str(exc), param="chat_template_kwargs", code="unsupported_parameter") from None
        tool_names = {t["function"]["name"] for t in tools or []}
        use_tools = bool(tools) and request.tool_choice != "none"

        def forced(rendered: list[dict], text: str) -> str:
            return self._forced(request, rendered, tools, kwargs, text)

        prompt = self.builder.build(messages, tools, kwargs, forced if use_tools else None)
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
            stop_token_ids=frozenset() if request.ignore_eos else self.format.stop_ids,
            pinned=pinned,
        )
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        if any(not s for s in stops):
            raise RequestError("stop strings must be non-empty", param="stop", code="invalid_value")
        return PreparedRequest(
            request,
            messages,
            tools,
            kwargs,
            prompt,
            params,
            prompt.opening,
            stops,
            tool_names if use_tools else set(),
            one_call=use_tools and request.parallel_tool_calls is False,
            policy_step=policy_step,
        )

    def _forced(
        self,
        request: ChatRequest,
        messages: list[dict],
        tools: list[dict] | None,
        kwargs: dict[str, Any],
        prompt: str,
    ) -> str:
        choice = request.tool_choice
        if choice != "required" and not isinstance(choice, NamedToolChoice):
            return ""
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        forced = self.builder.format.tool_call_prefix(messages, tools, kwargs, name, prompt)
        if forced is None:
            raise RequestError(
                f"tool_choice={'required' if name is None else 'a named function'} is not supported for this "
                f"model's chat format ({self.format.family.name}): its template does not write a tool call "
                "after the generation prompt; use tool_choice 'auto'",
                param="tool_choice",
                code="unsupported_parameter",
            )
        return forced

    # ------------------------------------------------------------------ events
    async def events(self, prepared: PreparedRequest, streaming: bool) -> AsyncIterator[Delta | ChoiceResult]:
        self.generating += 1
        try:
            async for event in self._events(prepared, streaming):
                yield event
        finally:
            self.generating -= 1

    async def _events(
        self, prepared: PreparedRequest, streaming: bool
    ) -> AsyncIterator[Delta | ChoiceResult]:
        streams = self.engine.generate(prepared.prompt.ids, prepared.params, prepared.request.n)
        if len(streams) == 1 and not streaming:
            # (one stream read here, without a task and a queue; a streamed answer keeps its task, which reads
            # the tokens as they come, however slowly the client reads, and so stops the engine at a stop)
            try:
                async with contextlib.aclosing(
                    self._choice_events(0, streams[0], prepared, streaming)
                ) as events:
                    async for event in events:
                        yield event
            finally:
                streams[0].abort()
            return
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
        fmt = self.format
        parser = fmt.output_parser(prepared.prompt.text, prepared.tools, prepared.tool_names)
        stops = StopStrings(prepared.stops)
        decoder = IncrementalDecoder(self.tokenizer, fmt.skip_ids)
        tokens: list[TokenChoice] = []
        unsent: list[TokenChoice] = []
        pieces = parser.feed(prepared.forced)
        incremental = streaming or bool(prepared.stops) or prepared.one_call
        ended_by: str | None = None  # "stop" (a stop string) or "tool_calls" (parallel_tool_calls=false)
        async for token in stream:
            tokens.append(token)
            unsent.append(token)
            if not incremental:
                continue
            pieces += parser.feed(stops.feed(decoder.push(token.token_id)))
            if stops.hit:
                ended_by = "stop"
            elif prepared.one_call and parser.calls:
                ended_by = "tool_calls"
            if streaming and (pieces or (unsent and prepared.request.logprobs)):
                yield Delta(index, pieces, unsent)
                pieces, unsent = [], []
            if ended_by is not None:
                stream.abort()
                break
        if incremental:
            pieces += parser.feed(stops.finish(decoder.flush()))
        else:
            pieces += parser.feed(decode_all(self.tokenizer, [t.token_id for t in tokens], fmt.skip_ids))
        pieces += parser.finish()
        if streaming and (pieces or unsent):
            yield Delta(index, pieces, unsent)
        finish = ended_by or stream.finish_reason or "stop"
        if parser.calls and finish == "stop":
            finish = "tool_calls"
        message: dict[str, Any] = {"role": "assistant", "content": parser.content or None}
        if parser.reasoning:
            message["reasoning_content"] = parser.reasoning
        if parser.calls:
            message["tool_calls"] = [c.as_openai() for c in parser.calls]
        elif message["content"] is None:
            message["content"] = ""  # a message the gateway accepts back: content or tool calls
        ids = [t.token_id for t in tokens]
        self.builder.remember(
            prepared.messages, prepared.tools, prepared.template_kwargs, message, prepared.prompt.ids, ids
        )
        yield ChoiceResult(
            index, message, finish, prepared.prompt, tokens, prepared.policy_step, stops.matched
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
            "policy_step": result.policy_step,
        }
