"""Encoding rendered chats piece by piece between their special tokens, each piece's ids remembered.

A fast tokenizer finds its added tokens before anything else and encodes the text between them independently
(normalizer, pre-tokenizer and model see one piece at a time), so that a special token that matches only
itself (not normalized, no lstrip/rstrip/single_word) cuts a text into parts whose ids, concatenated, are the
whole text's. A chat rendered for a request is such parts: the system turn with its tools, then one part per
message, the same parts at every turn of a conversation and in every rollout of a group. `SegmentEncoder`
encodes each part once: a conversation's next prompt costs its new messages, not its whole history.

It is used only where a probe proves the rule for this tokenizer (`segment_encoder` encodes probe texts both
ways at load and answers None on any difference: a tokenizer whose pre-tokenizer treats the first piece of a
text apart, such as a Metaspace with prepend_scheme="first", keeps the whole-text encode).
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_PIECES = 8192  # remembered pieces (all dropped when full)
MAX_CHARS = 8_000_000  # their characters in all (all dropped beyond)
_PROBE_TEXTS = (
    "{t}system\nYou are a helpful assistant.{t}\n{t}user\nHello, world! It's 12:30 - don't  wait.{t}\n",
    '{t}assistant\n<think>\nok\n</think>\n\n {{"name": "f", "arguments": {{"x": 1}}}}{t} x{t}\n\n  y',
    "{t}{t}Ünïcödé 文字 emoji 🙂\t tab{t}  {t}\n",
)


class SegmentEncoder:
    def __init__(self, backend: Any, splitters: dict[str, int]) -> None:
        self._backend = backend  # the fast tokenizer's own (tokenizers.Tokenizer)
        self._ids = splitters  # special token -> its id
        longest_first = sorted(splitters, key=len, reverse=True)
        self._pattern = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")
        self._memo: dict[str, tuple[int, ...]] = {}
        self._chars = 0

    def usable(self) -> bool:
        """Whether the fast tokenizer encodes as it was probed: transformers sets truncation, padding and
        special-token splitting on it at each call and leaves them set, so a call elsewhere that asked for
        them (on the same tokenizer object) would change what a piece encodes to."""
        backend = self._backend
        return backend.truncation is None and backend.padding is None and not backend.encode_special_tokens

    def encode(self, text: str) -> list[int]:
        """The ids of `text` (as the tokenizer encodes it whole, without special tokens added)."""
        parts = self._pattern.split(text)  # piece, token, piece, token, ..., piece
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self._ids[part])
            elif part:
                ids += self._piece(part)
        return ids

    def _piece(self, piece: str) -> tuple[int, ...]:
        known = self._memo.get(piece)
        if known is None:
            known = tuple(self._backend.encode(piece, add_special_tokens=False).ids)
            if len(self._memo) >= MAX_PIECES or self._chars + len(piece) > MAX_CHARS:
                self._memo.clear()
                self._chars = 0
            self._memo[piece] = known
            self._chars += len(piece)
        return known


def _overlap(a: str, b: str) -> bool:
    """Whether two token texts can match overlapping spans of one text: one inside the other, or an end of
    one the start of the other (then the tokenizer's leftmost-longest match may take the other one)."""
    if a in b or b in a:
        return True
    return any(a.endswith(b[:k]) for k in range(1, len(b))) or any(
        b.endswith(a[:k]) for k in range(1, len(a))
    )


def _splitters(tokenizer: Any) -> dict[str, int]:
    """The special tokens a chat rendered by the tokenizer's template is cut at: those that match only
    themselves (not normalized, no lstrip, rstrip or single_word), that the template writes (in its text, or
    as a named special token such as bos_token), that no other added token overlaps, and that cannot change
    where a single_word token counts as a word (a word character at either end, where there is one)."""
    added = [t for t in tokenizer.added_tokens_decoder.values() if t.content]
    template = tokenizer.chat_template
    written = template if isinstance(template, str) else json.dumps(template)
    named = {v for v in tokenizer.special_tokens_map.values() if isinstance(v, str)}
    words = any(t.single_word for t in added)
    found = {}
    for token in added:
        text = token.content
        if not token.special or token.normalized or token.lstrip or token.rstrip or token.single_word:
            continue
        if text not in written and text not in named:
            continue
        if words and (text[0].isalnum() or text[-1].isalnum() or "_" in (text[0], text[-1])):
            continue
        chars = set(text)
        others = (o.content for o in added if o.content != text)
        if any((o[0] in chars or o[-1] in chars or text[0] in o) and _overlap(text, o) for o in others):
            continue
        found[text] = tokenizer.convert_tokens_to_ids(text)
    return found


def segment_encoder(tokenizer: Any) -> SegmentEncoder | None:
    """A SegmentEncoder for a fast tokenizer whose special tokens split its chats (checked on probe texts
    against the tokenizer's own whole-text encode), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or tokenizer.chat_template is None:
        return None
    splitters = _splitters(tokenizer)
    if not splitters:
        return None
    segments = SegmentEncoder(backend, splitters)
    for token in splitters:
        for probe in _PROBE_TEXTS:
            text = probe.format(t=token)
            if segments.encode(text) != tokenizer(text, add_special_tokens=False)["input_ids"]:
                return None
    return SegmentEncoder(backend, splitters)  # (without the probes' pieces)
