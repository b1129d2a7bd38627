"""A trajectory's training rows, token by token, for the viewer: what a train step trained (its rows file:
mask, advantage, the sampler's and the trainer's logprobs) or, for other splits, the rows its recorded calls
make (sampler logprobs only). Token text comes from the run's saved tokenizer."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from artrl.local.dashboard.parsed_files import STEP_FILES
from artrl.storage import read_step_rows, rows_path

log = logging.getLogger(__name__)


class TokenText:
    """Each token id as text (a token that is part of a multi-byte character shows as its bytes' text)."""

    def __init__(self, folder: Path, base_model: str | None) -> None:
        self.folder_saved = (folder / "tokenizer").is_dir()  # before the load: one saved meanwhile is new
        self.loaded_at = time.monotonic()
        self._decode = self._load(folder, base_model)
        self._cache: dict[int, str] = {}

    @staticmethod
    def _load(folder: Path, base_model: str | None):
        candidates = [str(folder / "tokenizer")] + ([base_model] if base_model else [])
        for source in candidates:
            try:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(source)
            except Exception as exc:  # no tokenizer there (a hub id offline, a deleted folder): try the next
                log.info("no tokenizer from %s: %s", source, exc)
                continue
            return lambda i: tokenizer.decode([i], skip_special_tokens=False)
        return None

    @property
    def available(self) -> bool:
        return self._decode is not None

    def __call__(self, token: int) -> str:
        if self._decode is None:
            return f"<{token}>"
        if token not in self._cache:
            try:
                self._cache[token] = self._decode(token)
            except Exception:  # an id outside the vocabulary (a corrupt file)
                self._cache[token] = f"<{token}>"
        return self._cache[token]


# a tokenizer that did not load is tried again after this long: loading a hub id offline fails only after
# the hub's retries, which every view of the run would otherwise wait for
TOKENIZER_RETRY_S = 60.0

_TOKEN_TEXTS: dict[tuple[Path, str | None], TokenText] = {}


def token_text(folder: Path, base_model: str | None) -> TokenText:
    """The run's TokenText, loaded once; while none loads, tried again after TOKENIZER_RETRY_S, or at once
    when the run saves its tokenizer folder (a run that has not registered yet)."""
    key = (folder, base_model)
    text = _TOKEN_TEXTS.get(key)
    if text is None or (
        not text.available
        and (
            time.monotonic() - text.loaded_at >= TOKENIZER_RETRY_S
            or (not text.folder_saved and (folder / "tokenizer").is_dir())
        )
    ):
        text = _TOKEN_TEXTS[key] = TokenText(folder, base_model)
    return text


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return round(float(value), 4)
    return None


def _recorded_calls(trajectory: dict[str, Any]) -> list[tuple[list[int], list[int], list[float] | None]]:
    calls = []
    for history in [trajectory, *trajectory.get("additional_histories", [])]:
        for item in history.get("messages_and_choices", []):
            if not (isinstance(item, dict) and "finish_reason" in item):
                continue
            prompt, sampled = item.get("prompt_token_ids"), item.get("token_ids")
            if isinstance(prompt, list) and isinstance(sampled, list):
                logprobs = item.get("token_logprobs")
                ok = isinstance(logprobs, list) and len(logprobs) == len(sampled)
                calls.append((prompt, sampled, [float(x) for x in logprobs] if ok else None))
    return calls


def recorded_rows(trajectory: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows from a trajectory's recorded calls, as a train step would build them (not trained: no
    advantage, no trainer logprobs)."""
    from artrl.local.train.rows import rows_from_calls

    rows = rows_from_calls(_recorded_calls(trajectory), 0)
    return [
        {
            "row": r,
            "trained": False,
            "advantage": None,
            "weight": 1.0 / len(rows),
            "ids": row.ids,
            "mask": row.mask,
            "sampler_logprobs": row.logprobs,
            "trainer_logprobs": None,
            "before_update": False,
        }
        for r, row in enumerate(rows)
    ]


def trained_rows(folder: Path, step: int, group: int, index: int) -> list[dict[str, Any]] | None:
    """The rows a train step trained for one trajectory; None when the step kept no record of them."""
    records = STEP_FILES.get(rows_path(folder, step), lambda _: read_step_rows(folder, step))
    if not records:
        return None
    return [r for r in records if r.get("group") == group and r.get("trajectory") == index]


def _fork(ids: list[int], earlier: list[list[int]]) -> dict[str, int] | None:
    """Where a row departs from the earlier row it shares the longest prefix with."""
    best: dict[str, int] | None = None
    for j, other in enumerate(earlier):
        n = 0
        for a, b in zip(ids, other, strict=False):
            if a != b:
                break
            n += 1
        if n and (best is None or n > best["at"]):
            best = {"from_row": j, "at": n}
    return best


def view_rows(rows: list[dict[str, Any]], text: TokenText, max_tokens: int) -> list[dict[str, Any]]:
    """Rows as the page draws them: per token [id, text, mask, sampler logprob, trainer logprob]."""
    out = []
    for k, row in enumerate(rows):
        ids = row.get("ids") or []
        mask = row.get("mask") or [0] * len(ids)
        sampler = row.get("sampler_logprobs") or [None] * len(ids)
        trainer = row.get("trainer_logprobs") or [None] * len(ids)
        shown = min(len(ids), max_tokens)
        tokens = [
            [ids[t], text(ids[t]), int(mask[t]), _number(sampler[t]), _number(trainer[t])]
            for t in range(shown)
        ]
        out.append(
            {
                "row": row.get("row", k),
                "trained": bool(row.get("trained")),
                "advantage": _number(row.get("advantage")),
                "weight": _number(row.get("weight")),
                "before_update": bool(row.get("before_update")),
                "length": len(ids),
                "trained_tokens": sum(mask),
                "truncated": shown < len(ids),
                "fork": _fork(ids, [r.get("ids") or [] for r in rows[:k]]),
                "tokens": tokens,
            }
        )
    return out
