"""`ChatFormat`: everything artrl does with one model's chat template.

It renders messages (tool-call arguments as objects, reasoning passed back, `chat_template_kwargs`), encodes
the rendered text so that text from messages can never become a control token (transformers'
`mark_control_tokens` / `sanitize_control_tokens`), knows the tokens that end a turn, the text that forces a
tool call, how a recorded completion continues into the next prompt, and how to parse what the model
writes (`output.OutputParser`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from artrl.local.chat_format.control_marks import ControlMarks
from artrl.local.chat_format.families import Family, detect_family, family_named, response_template
from artrl.local.chat_format.output import OutputParser, raw_call_template
from artrl.local.chat_format.plain_render import PlainRenderer, plain_renderer
from artrl.local.chat_format.segments import SegmentEncoder, segment_encoder
from artrl.local.chat_format.template_inputs import (
    RESERVED_TEMPLATE_VARIABLES,
    template_messages,
    template_variables,
)


class TemplateRenderError(ValueError):
    """The chat template could not render these messages (its own message says why)."""


def _common_prefix(a: str, b: str) -> str:
    n = min(len(a), len(b))
    return a[: next((i for i in range(n) if a[i] != b[i]), n)]


def _has_parameters(tools: list[dict[str, Any]] | None, name: str) -> bool:
    for tool in tools or []:
        function = tool.get("function", {})
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return bool(properties)
    return False


MEMO_SIZE = 256  # entries each of the chat format's memos keeps (all dropped when full)


def _remembered(memo: dict, key: Any, compute: Callable[[], Any]) -> Any:
    """memo[key], computed on first use; a full memo starts over (bounded, and safe across threads)."""
    known = memo.get(key)
    if known is None:
        known = compute()
        if len(memo) >= MEMO_SIZE:
            memo.clear()
        memo[key] = known
    return known


@dataclass
class ChatFormat:
    tokenizer: Any
    family: Family
    detected_by: str  # 'exact' (a real template trl ships), 'markers', 'config' or 'none'
    stop_ids: frozenset[int]
    variables: frozenset[str] = field(default_factory=frozenset)
    # (text, limit) -> _token_boundary's answer: a forced tool call asks the same each call (bounded)
    _boundaries: dict[tuple[str, int], str] = field(default_factory=dict, repr=False, compare=False)
    # (text, start) -> encode's ids: a group's rollouts send the same first prompt, a forced call the same
    # opening (bounded; copies are handed out)
    _encoded: dict[tuple[str, bool], tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)
    # (function or None, tools, kwargs) -> whether one probe render gives a forced call's opening (bounded)
    _one_probe: dict[tuple[Any, ...], bool] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, name: str | None = None, extra_stop_ids: Sequence[int] = ()
    ) -> ChatFormat:
        """The format of `tokenizer`'s chat template (or the family `name`); stop ids = the family's stop
        tokens in this vocabulary + the tokenizer's eos + `extra_stop_ids` (the model's generation_config)."""
        template = tokenizer.chat_template
        if template is None:
            raise ValueError("the tokenizer has no chat template; artrl serves chat models only")
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()))
        family, how = (family_named(name), "config") if name else detect_family(template)
        vocab = tokenizer.get_vocab()
        stops = {vocab[t] for t in family.stop_tokens if t in vocab}
        if tokenizer.eos_token is not None:
            stops.add(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))
        stops.update(extra_stop_ids)
        return cls(tokenizer, family, how, frozenset(stops), template_variables(template))

    def __getstate__(self) -> dict[str, Any]:
        """What a pickled copy holds (row_renderer.py sends the format to its render workers): the fields with
        their memos empty; what is derived from the tokenizer (the cached properties) the copy derives again.
        The same format pickles to the same bytes, whatever it remembers (the workers keep it by its hash)."""
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        return state | {"_boundaries": {}, "_encoded": {}, "_one_probe": {}}

    def clone(self) -> ChatFormat:
        """The same format over its own copy of the tokenizer, for use on another thread (a fast tokenizer
        must not encode on one thread while it decodes on another)."""
        import copy

        return ChatFormat(
            copy.deepcopy(self.tokenizer), self.family, self.detected_by, self.stop_ids, self.variables
        )

    # ------------------------------------------------------------------ control tokens
    @cached_property
    def control_tokens(self) -> tuple[str, ...]:
        """Added tokens that text from messages must never turn into: special ones, and those the template
        writes itself (such as a non-special <tool_call>)."""
        text = self._template_text
        return tuple(
            t.content
            for t in self.tokenizer.added_tokens_decoder.values()
            if t.special or (t.content in text and not t.content.isspace())
        )

    @cached_property
    def _plain(self) -> PlainRenderer | None:
        return plain_renderer(self.tokenizer)

    @cached_property
    def _marks(self) -> ControlMarks:
        return ControlMarks(self.control_tokens)

    @cached_property
    def _template_text(self) -> str:
        template = self.tokenizer.chat_template
        return template if isinstance(template, str) else json.dumps(template)

    # ------------------------------------------------------------------ rendering and encoding
    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Raise ValueError naming a chat_template_kwargs key that this template would silently ignore."""
        for key in kwargs:
            if key in RESERVED_TEMPLATE_VARIABLES:
                raise ValueError(f"chat_template_kwargs may not set {key!r}; send it as a request field")
            if key not in self.variables:
                used = sorted(self.variables - RESERVED_TEMPLATE_VARIABLES - {"bos_token", "eos_token"})
                raise ValueError(
                    f"chat_template_kwargs key {key!r} is not read by this model's chat template "
                    f"(family {self.family.name}); the template reads: {', '.join(used) or 'none'}"
                )

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        generation_prompt: bool,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The rendered conversation, with control tokens that came from messages marked (see `encode`)."""
        from jinja2 import TemplateError

        try:
            given = template_messages(messages), tools or None, kwargs or {}
            marked, plain = zip(*(self._marks.mark_plain(v) for v in given), strict=True)
            # plain JSON without a control token: the template renders it without apply_chat_template's
            # copies (plain_render.py), where the renderer takes these inputs
            if all(plain) and self._plain is not None and self._plain.takes(*marked):
                return self._plain.render(marked[0], marked[1], generation_prompt, marked[2])
            return self.tokenizer.apply_chat_template(
                marked[0],
                tools=marked[1] or None,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **marked[2],
            )
        except (TemplateError, TypeError, KeyError, AttributeError) as exc:
            raise TemplateRenderError(f"the chat template rejected these messages: {exc}") from None

    def encode(self, text: str, *, start: bool = True) -> list[int]:
        """Token ids of rendered (marked) text; control tokens from messages are encoded as plain text.

        `start=False` encodes a piece from the middle of a conversation (after a newline, which is then
        removed, so that a SentencePiece tokenizer adds no word-start space)."""
        if len(text) > 65536:  # (a long prompt is not kept)
            return self._encode(text, start)
        return list(_remembered(self._encoded, (text, start), lambda: tuple(self._encode(text, start))))

    def _encode(self, text: str, start: bool) -> list[int]:
        sanitize = self._marks.needs_sanitizing(text)

        def encode(piece: str) -> list[int]:
            if sanitize:
                return self.tokenizer(piece, add_special_tokens=False, sanitize_control_tokens=True)[
                    "input_ids"
                ]
            if self._segments is not None and self._segments.usable():  # (each part once: segments.py)
                return self._segments.encode(piece)
            return self.tokenizer(piece, add_special_tokens=False)["input_ids"]

        if start:
            return encode(text)
        ids = encode("\n" + text)
        if ids[: len(self._newline)] == self._newline:
            return ids[len(self._newline) :]
        return encode(text)

    @cached_property
    def _segments(self) -> SegmentEncoder | None:
        return segment_encoder(self.tokenizer)

    @cached_property
    def _newline(self) -> list[int]:
        return self.tokenizer("\n", add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------ tool calls
    def tool_call_prefix(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None,
        name: str | None,
        prompt: str | None = None,
    ) -> str | None:
        """Text after the generation prompt that makes the model call a tool, read off the template itself
        (how it renders an assistant turn holding one call): up to the function name when any tool may be
        called; for a named function through the name and up to its first argument. The cut falls on a token
        boundary of the rendered call, so prompt + sampled ids tokenise like the rendering. None when the
        template does not write a call as a continuation of the generation prompt. `prompt`: the messages
        rendered with the generation prompt, where the caller has it."""
        if response_template(self.family.name) is None:
            return None
        if prompt is None:
            prompt = self.render(messages, tools, True, kwargs)

        def span(function: str, arguments: dict[str, Any]) -> str | None:
            call = {
                "id": "call_probe",
                "type": "function",
                "function": {"name": function, "arguments": arguments},
            }
            turn = {"role": "assistant", "content": "", "tool_calls": [call]}
            text = self.render([*messages, turn], tools, False, kwargs)
            return text[len(prompt) :] if text.startswith(prompt) else None

        if name is None or _has_parameters(tools, name):
            probe = (
                "xartrl_probe",
                "yartrl_probe",
            )  # two calls that differ in the function's name, or its key

            def call(k: int) -> str | None:
                return span(probe[k], {}) if name is None else span(name, {probe[k]: 1})

            first = call(0)
            if first is None:
                return None
            # the opening ends where the probe's word begins: known from two renders, which differ from there
            # on; where the template writes the word as it is, the second render confirms what the first
            # shows, so it is asked once per template, tools and call (a re-render of the whole conversation)
            shape = (
                name,
                json.dumps(tools, sort_keys=True, default=str),
                repr(sorted((kwargs or {}).items())),
            )
            at = first.find(probe[0])
            if at >= 0 and self._one_probe.get(shape):
                common = first[:at]
            else:
                second = call(1)
                if second is None:
                    return None
                common = _common_prefix(first, second)
                if len(self._one_probe) >= MEMO_SIZE:
                    self._one_probe.clear()
                self._one_probe[shape] = at >= 0 and common == first[:at]
        else:
            first = span(name, {})
            if not first or name not in first:
                return None
            common = first[: first.find(name) + len(name)]
        if name is not None and name not in common:
            return None
        return self._token_boundary(first, len(common))

    def _token_boundary(self, text: str, limit: int) -> str:
        """The longest prefix of text, at most `limit` long, that ends where a token of `text` ends."""
        return _remembered(self._boundaries, (text, limit), lambda: self._find_boundary(text, limit))

    def _find_boundary(self, text: str, limit: int) -> str:
        whole = self._encode(text, False)  # (not through the encode memo: these probes would flood it)
        for end in range(limit, 0, -1):
            ids = self._encode(text[:end], False)
            if whole[: len(ids)] == ids:
                return text[:end]
        return ""

    # ------------------------------------------------------------------ continuation
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def continuation_text(self, before: str, after: str, sampled: Sequence[int]) -> str | None:
        """What follows a recorded completion's sampled ids so that they continue into `after`.

        `before` renders the conversation through the completion's assistant turn, `after` the next prompt.
        None when `after` does not extend `before` (the template re-renders history: render afresh), or when
        the sampled turn ended in a way the rendered history does not show."""
        if not after.startswith(before):
            return None
        rest = after[len(before) :]
        body = before.rstrip()
        spacing = before[len(body) :]
        stops = self.stop_texts
        if sampled and sampled[-1] in self.stop_ids:
            stop = self.token_text(sampled[-1])
            if body.endswith(stop):
                return spacing + rest  # the template closes the turn with the token the model sampled
            if not spacing and rest.startswith(stop):
                return rest[len(stop) :]  # the next role's marker ends the turn (GLM): it was sampled already
        # cut short (length, a stop string), or ended by a stop token the template does not write (Qwen's
        # <|endoftext|>): the turn is closed as the template closes it, those tokens being prompt
        for stop in stops:
            if body.endswith(stop):
                return stop + spacing + rest
        if not spacing and any(rest.startswith(stop) for stop in stops):
            return rest
        return None

    @cached_property
    def stop_texts(self) -> tuple[str, ...]:
        """The text of each stop token, longest first."""
        return tuple(sorted({self.token_text(i) for i in self.stop_ids}, key=len, reverse=True))

    # ------------------------------------------------------------------ output
    @cached_property
    def reasoning(self) -> bool:
        """The model writes reasoning that the format parses and the template renders back."""
        template = response_template(self.family.name)
        return (
            bool(template)
            and any(f in template["fields"] for f in ("reasoning_content", "thinking", "reasoning"))
            and any(k in self._template_text for k in ("reasoning_content", "thinking", "<think>"))
        )

    @cached_property
    def skip_ids(self) -> frozenset[int]:
        """Special tokens that do not appear in the output as text (those that are not the format's markup)."""
        template = response_template(self.family.name)
        markup = json.dumps(template) if template else ""
        return frozenset(
            i
            for i, t in self.tokenizer.added_tokens_decoder.items()
            if t.special
            and not any(
                form in markup
                for form in (t.content, json.dumps(t.content)[1:-1], json.dumps(re.escape(t.content))[1:-1])
            )
        )

    @cached_property
    def _raw_template(self) -> Any:
        """The raw-call response template, compiled once (transformers' ResponseParser would compile its
        patterns again for every sampled sequence)."""
        template = response_template(self.family.name)
        if template is None:
            return None
        from transformers.utils.chat_parsing.response_templates import load_response_template

        return load_response_template(raw_call_template(template))

    def output_parser(
        self, prompt_text: str, tools: list[dict[str, Any]] | None, allowed_names: set[str]
    ) -> OutputParser:
        """A parser for one sampled sequence after `prompt_text` (the rendered prompt)."""
        template = response_template(self.family.name)
        return OutputParser(template, self._raw_template, prompt_text, tools, allowed_names, self.stop_texts)
