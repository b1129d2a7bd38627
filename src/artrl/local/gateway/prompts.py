"""Prompt token ids for a request: a token-exact continuation when possible, a fresh render otherwise.

If the request's last assistant turn is a completion this gateway produced (same history before it, same
tools, same message), the prompt is

    that completion's prompt ids + its sampled ids + tokens(end of turn + rendered new messages + gen prompt)

so the model conditions on exactly what it sampled. Otherwise the whole history is rendered with the chat
template. `Prompt.source` says which happened.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from jinja2 import TemplateError

from artrl.local.gateway.messages import conversation_key
from artrl.local.gateway.protocol import RequestError


@dataclass(frozen=True)
class StoredCompletion:
    prompt_ids: array  # 'i' (4 bytes a token: the store holds many long prompts)
    token_ids: array


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    source: Literal["continuation", "rendered"]


class CompletionStore:
    """The completions the gateway served, by conversation key; least recently used ones are forgotten."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[str, StoredCompletion] = OrderedDict()

    def put(self, key: str, completion: StoredCompletion) -> None:
        if self._capacity == 0:
            return
        self._items[key] = completion
        self._items.move_to_end(key)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def get(self, key: str) -> StoredCompletion | None:
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def __len__(self) -> int:
        return len(self._items)


class PromptBuilder:
    def __init__(self, tokenizer: Any, store: CompletionStore) -> None:
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template; artrl serves chat models only")
        self._tokenizer = tokenizer
        self._store = store
        self._turn_end = tokenizer.eos_token
        self._turn_end_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        try:
            return self._tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
            )
        except TemplateError as exc:
            raise RequestError(
                f"the chat template rejected these messages: {exc}", param="messages", code="invalid_messages"
            ) from None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer(text, add_special_tokens=False)["input_ids"]

    def build(self, messages: list[dict], tools: list[dict] | None, forced: str = "") -> Prompt:
        full = self.render(messages, tools, generation_prompt=True) + forced
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is not None:
            stored = self._store.get(conversation_key(messages[: last + 1], tools))
            if stored is not None:
                ids = self._continue(stored, self.render(messages[: last + 1], tools, False), full)
                if ids is not None:
                    return Prompt(ids, "continuation")
        return Prompt(self.encode(full), "rendered")

    def _continue(self, stored: StoredCompletion, prefix: str, full: str) -> list[int] | None:
        at = prefix.rfind(self._turn_end)
        if not full.startswith(prefix) or at < 0:
            return None  # this template re-renders history differently: fall back to a fresh render
        tail = prefix[at + len(self._turn_end) :]  # what the template puts after the end-of-turn token
        ended = bool(stored.token_ids) and stored.token_ids[-1] == self._turn_end_id
        closing = tail if ended else self._turn_end + tail
        return [*stored.prompt_ids, *stored.token_ids, *self.encode(closing + full[len(prefix) :])]

    def remember(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        assistant: dict,
        prompt_ids: list[int],
        token_ids: list[int],
    ) -> None:
        key = conversation_key([*messages, assistant], tools)
        self._store.put(key, StoredCompletion(array("i", prompt_ids), array("i", token_ids)))
