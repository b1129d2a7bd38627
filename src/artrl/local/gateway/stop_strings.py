"""Stop strings (`stop` in a request) on streamed text: text is released once it cannot be the start of a
stop string; at a stop string the text before it is released and the rest is dropped."""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._held = ""
        self.hit = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        if not self._stops:
            return text
        if self.hit:
            return ""
        text = self._held + text
        found = [(at, s) for s in self._stops if (at := text.find(s)) >= 0]
        if found:
            cut, self.matched = min(found)
            self.hit, self._held = True, ""
            return text[:cut]
        keep = max((_overlap(text, s) for s in self._stops), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def finish(self, text: str = "") -> str:
        out = self.feed(text)
        if not self.hit:
            out, self._held = out + self._held, ""
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for size in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0
