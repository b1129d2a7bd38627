"""Incremental detokenisation: the text of each new token, exact for byte-level and SentencePiece tokenizers.

Each step decodes a short window twice (ending before and after the new tokens) and emits the difference,
so text costs O(window) per token rather than re-decoding the whole sequence, and a leading space that a
SentencePiece decoder drops at the start of a decode call is kept. Text ending in an incomplete UTF-8
sequence waits for the next token. Token ids in `skip` (special tokens that are not part of the chat
format's markup) produce no text.
"""

from __future__ import annotations

from typing import Any


class IncrementalDecoder:
    def __init__(self, tokenizer: Any, skip: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._skip = skip
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # end of the tokens whose text was emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Text of tokens still held back (an incomplete character at the very end)."""
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


def decode_all(tokenizer: Any, ids: list[int], skip: frozenset[int] = frozenset()) -> str:
    return tokenizer.decode(
        [i for i in ids if i not in skip], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
