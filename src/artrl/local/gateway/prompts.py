"""Prompt token ids for a request: a token-exact continuation when possible, a fresh render otherwise.

If the request's last assistant turn is a completion this gateway produced (same history before it, same
tools and template arguments, same message), the prompt is

    that completion's prompt ids + its sampled ids + tokens(what the template writes after that turn)

so the model conditions on exactly what it sampled. That needs the template to render the new conversation
as an extension of the old one (`ChatFormat.continuation_text`); where it does not (Qwen3 and GLM drop
earlier reasoning at a new user turn, gpt-oss once a final answer follows), the whole history is rendered
afresh with the chat template, as any server would, and training rows fork there. `Prompt.source` says
which happened. The gateway passes back the reasoning of its own completions when a client leaves it out.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from artrl.canonical import conversation_key
from artrl.local.chat_format import ChatFormat, TemplateRenderError
from artrl.local.gateway.protocol import RequestError


@dataclass(frozen=True)
class StoredCompletion:
    prompt_ids: array  # 'i' (4 bytes a token: the store holds many long prompts)
    token_ids: array
    reasoning: str | None = None


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    source: Literal["continuation", "rendered"]
    text: str = ""  # the rendered prompt (what the output parser reads its context from)
    opening: str = ""  # text the model's turn starts with (a forced tool call), its ids already in `ids`


_AMBIGUOUS = StoredCompletion(array("i"), array("i"))


class CompletionStore:
    """The completions the gateway served, by conversation key; least recently used ones are forgotten.

    Two rollouts can reach the same conversation text with different token ids (the same text sampled as
    other tokens, or a prompt reached another way). The text cannot tell them apart, so such a key is
    ambiguous: `get` returns None and the next prompt is rendered afresh rather than continuing one
    rollout's ids in another's conversation. The same ids under one key (greedy rollouts) stay usable."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[str, StoredCompletion] = OrderedDict()
        self._lock = threading.Lock()  # prompts are built on the gateway's preparation thread

    def put(self, key: str, completion: StoredCompletion) -> None:
        if self._capacity == 0:
            return
        with self._lock:
            self._put(key, completion)

    def _put(self, key: str, completion: StoredCompletion) -> None:
        known = self._items.get(key)
        if known is not None and (known.prompt_ids, known.token_ids) != (
            completion.prompt_ids,
            completion.token_ids,
        ):
            completion = _AMBIGUOUS
        self._items[key] = completion
        self._items.move_to_end(key)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def get(self, key: str) -> StoredCompletion | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
        return None if found is _AMBIGUOUS else found

    def __len__(self) -> int:
        return len(self._items)


def _key(messages: list[dict], tools: list[dict] | None, kwargs: dict[str, Any]) -> str:
    key = conversation_key(messages, tools)
    return key if not kwargs else f"{key}:{json.dumps(kwargs, sort_keys=True, default=str)}"


class PromptBuilder:
    def __init__(self, chat_format: ChatFormat, store: CompletionStore) -> None:
        self.format = chat_format
        self._store = store

    def render(
        self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool, kwargs: dict[str, Any]
    ) -> str:
        try:
            return self.format.render(messages, tools, generation_prompt, kwargs)
        except TemplateRenderError as exc:
            raise RequestError(str(exc), param="messages", code="invalid_messages") from None

    def build(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        kwargs: dict[str, Any] | None = None,
        forced: Callable[[list[dict], str], str] | None = None,
    ) -> Prompt:
        """The prompt ids of a request; `forced(messages, prompt text)`: text the model's turn starts with
        (a forced tool call), appended to the ids."""
        kwargs = kwargs or {}
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        stored = None
        if last is not None:
            stored = self._store.get(_key(messages[: last + 1], tools, kwargs))
            if stored is not None and stored.reasoning and not messages[last].get("reasoning_content"):
                messages = [
                    *messages[:last],
                    {**messages[last], "reasoning_content": stored.reasoning},
                    *messages[last + 1 :],
                ]
        text = self.render(messages, tools, True, kwargs)
        ids, source = None, "rendered"
        if stored is not None:
            before = self.render(messages[: last + 1], tools, False, kwargs)
            tail = self.format.continuation_text(before, text, stored.token_ids)
            if tail is not None:
                ids = [*stored.prompt_ids, *stored.token_ids, *self.format.encode(tail, start=False)]
                source = "continuation"
        if ids is None:
            ids = self.format.encode(text)
        opening = forced(messages, text) if forced is not None else ""
        if opening:
            ids += self.format.encode(opening, start=False)
        return Prompt(ids, source, text, opening)  # type: ignore[arg-type]

    def remember(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        kwargs: dict[str, Any] | None,
        assistant: dict,
        prompt_ids: list[int],
        token_ids: list[int],
    ) -> None:
        key = _key([*messages, assistant], tools, kwargs or {})
        completion = StoredCompletion(
            array("i", prompt_ids), array("i", token_ids), assistant.get("reasoning_content")
        )
        self._store.put(key, completion)
