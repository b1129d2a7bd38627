"""Rendering a chat template without `apply_chat_template`'s copies, for inputs that are plain JSON.

Before its compiled template renders, transformers' `apply_chat_template` copies every message, tool and
template variable three times (message objects to dicts; None-valued message keys dropped; everything rebuilt
from plain JSON types, so that the sandboxed template sees no rich object). For what a request's JSON body
parses into (dicts, lists, strings, numbers, booleans, None) each copy equals its input: `PlainRenderer`
renders such inputs with transformers' own compiled template and its own reasoning-field aliasing, dropping
None-valued message keys as it does: the same text (tests compare the two on every family's template) in
about a third of the time. transformers' sandbox is immutable, so the template cannot change the caller's
values. Where transformers lacks a helper this relies on, `plain_renderer` answers None and the caller keeps
`apply_chat_template`.
"""

from __future__ import annotations

from typing import Any

_PLAIN_SCALARS = (int, float, bool, type(None))


def is_plain_scalar(value: Any) -> bool:
    """A JSON scalar other than a string, of its exact type (a subclass may carry methods the sandbox would
    reach: transformers rebuilds those, so a value holding one goes through `apply_chat_template`)."""
    return type(value) in _PLAIN_SCALARS


class PlainRenderer:
    def __init__(self, tokenizer: Any, compile_template: Any, alias_reasoning: Any) -> None:
        import inspect

        self._tokenizer = tokenizer
        self._compile, self._alias = compile_template, alias_reasoning
        # apply_chat_template's own parameters: a template variable of one of these names never reaches the
        # template there (it sets the parameter instead)
        self._parameters = frozenset(inspect.signature(tokenizer.apply_chat_template).parameters)

    def takes(self, messages: Any, tools: Any, kwargs: Any) -> bool:
        """Whether `render` gives apply_chat_template's text for these (plain JSON) inputs: a conversation of
        messages (dicts), tools as schemas (dicts), no template variable that apply_chat_template would take for itself."""
        return (
            bool(messages)
            and all(type(m) is dict for m in messages)
            and (tools is None or all(type(t) is dict for t in tools))
            and type(kwargs) is dict
            and self._parameters.isdisjoint(kwargs)
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> str:
        """What `apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=...,
        **kwargs)` returns, for plain JSON inputs that it `takes`."""
        # (the template apply_chat_template picks: a dict of templates has one for tools; compiled once)
        compiled = self._compile(self._tokenizer.get_chat_template(None, tools))
        chat = self._alias([{k: v for k, v in m.items() if v is not None} for m in messages])
        return compiled.render(
            messages=chat,
            tools=tools,
            documents=None,
            add_generation_prompt=generation_prompt,
            **{**self._tokenizer.special_tokens_map, **kwargs},  # (as apply_chat_template: read each time)
        )


def plain_renderer(tokenizer: Any) -> PlainRenderer | None:
    """A PlainRenderer for `tokenizer`, or None where this transformers lacks what it uses."""
    try:
        from transformers.utils.chat_template_utils import _alias_reasoning_fields, _compile_jinja_template
    except ImportError:
        return None
    return PlainRenderer(tokenizer, _compile_jinja_template, _alias_reasoning_fields)
