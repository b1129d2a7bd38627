"""Control tokens in text that came from messages, marked so that they encode as plain text.

transformers marks them (`mark_control_tokens`: each control token inside a string of the messages, tools or
template variables gets private-use markers around it) and encodes the rendered text piece by piece between
the markers (`sanitize_control_tokens=True`). Both cost a walk over everything, on every render and encode,
while almost no conversation holds a control token. `ControlMarks` gives the same results: it hands back the
value itself where the walk would only copy it (a check that only searches the strings), and encodes text
without markers in one piece. It also marks dict keys, which transformers leaves as they are: a parameter
name in a tool schema (often a third-party MCP server's) or a key of echoed tool-call arguments is rendered
into the prompt like any value, and a control token in it must not become the real token.
"""

from __future__ import annotations

import re
from typing import Any

from transformers.utils import chat_template_utils

from artrl.local.chat_format.plain_render import is_plain_scalar

# the markers transformers puts around a marked token (None: this transformers names them otherwise, and
# every value is walked and every text encoded piecewise, as before)
MARKERS: tuple[str, ...] | None = (
    tuple(
        m
        for m in (
            getattr(chat_template_utils, n, None) for n in ("_CONTROL_TOKEN_START", "_CONTROL_TOKEN_END")
        )
        if isinstance(m, str) and m
    )
    or None
)


class ControlMarks:
    def __init__(self, control_tokens: tuple[str, ...]) -> None:
        longest_first = sorted(control_tokens, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")  # (?!): never matches
        markers = MARKERS or ()
        self._markers = re.compile("|".join(map(re.escape, markers)) or "(?!)")
        self._anything = re.compile("|".join(map(re.escape, [*longest_first, *markers])) or "(?!)")

    def mark(self, value: Any) -> Any:
        """`mark_control_tokens(value)`: the value itself where that would only copy it."""
        return self.mark_plain(value)[0]

    def mark_plain(self, value: Any) -> tuple[Any, bool]:
        """`mark(value)`, and whether that is the value itself and it is plain JSON without a control token or
        a marker (what ChatFormat.render may hand to the template without transformers' copies)."""
        if MARKERS is None:
            return chat_template_utils.mark_control_tokens(value, self.pattern), False
        if self._unmarked(value):
            return value, True
        return self._marked(value), False

    def _marked(self, value: Any) -> Any:
        """transformers' walk, keys included."""
        if isinstance(value, str):
            return chat_template_utils.mark_control_tokens(value, self.pattern)
        if isinstance(value, dict):
            return {self._marked(k) if isinstance(k, str) else k: self._marked(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._marked(v) for v in value]
        return value

    def _unmarked(self, value: Any) -> bool:
        """Whether `value` is plain JSON (dicts, lists, strings and scalars of their exact types) in which no
        string (keys included) holds a control token or a marker: marking would return a copy of it, so `mark`
        returns the value itself; anything else is walked (a tuple or subclass becomes a list, dict or str,
        other values are left as they are)."""
        kind = type(value)
        if kind is str:
            return self._anything.search(value) is None
        if kind is dict:
            return all(self._unmarked(k) and self._unmarked(v) for k, v in value.items())
        if kind is list:
            return all(self._unmarked(v) for v in value)
        return is_plain_scalar(value)

    def needs_sanitizing(self, text: str) -> bool:
        """Whether encoding rendered `text` must go piecewise (`sanitize_control_tokens`): text without a
        marker encodes the same either way."""
        return MARKERS is None or self._markers.search(text) is not None
