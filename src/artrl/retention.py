"""Which checkpoints to keep: the newest N, the best by a history metric, and always the latest."""

from __future__ import annotations

import math
from typing import Any

from artrl.config import CheckpointRetention


def metric_by_step(history: list[dict[str, Any]], metric: str) -> dict[int, float]:
    """`metric` ('split/name') per step, from history rows; the last row of a step wins (a re-run
    evaluation replaces an earlier one). Steps where it is missing or not a finite number are left out."""
    split, name = metric.split("/", 1)
    values: dict[int, float] = {}
    for row in history:
        value = row.get(name)
        if row.get("split") != split or not isinstance(row.get("step"), int) or isinstance(value, bool):
            continue
        if isinstance(value, int | float) and math.isfinite(value):
            values[row["step"]] = float(value)
    return values


def checkpoints_to_keep(
    steps: list[int], history: list[dict[str, Any]], retention: CheckpointRetention
) -> set[int]:
    """The steps of `steps` (checkpoints on disk) that `retention` keeps. A `keep_best` metric that the rows
    of its split never carry (a misspelt name) is a ValueError: the best would otherwise never be kept."""
    if not steps:
        return set()
    if retention.keep_last is None and retention.keep_best is None:
        return set(steps)
    ordered = sorted(steps)
    keep = {ordered[-1]}  # training resumes from the latest
    if retention.keep_last is not None:
        keep.update(ordered[-retention.keep_last :])
    if retention.keep_best is not None:
        _check_metric(history, retention.keep_best)
        on_disk = set(steps)
        values = {s: v for s, v in metric_by_step(history, retention.keep_best).items() if s in on_disk}
        if values:
            pick = max if retention.best_mode == "max" else min
            # ties go to the later step (it trained longer for the same score)
            keep.add(pick(sorted(values), key=lambda s: (values[s], s if pick is max else -s)))
    return keep


def _check_metric(history: list[dict[str, Any]], metric: str) -> None:
    split, name = metric.split("/", 1)
    rows = [r for r in history if r.get("split") == split]
    if rows and not any(name in r for r in rows):  # none logged yet is fine: only keep_last applies
        names = sorted({k for r in rows for k in r} - {"step", "split", "time"})
        raise ValueError(
            f"CheckpointRetention(keep_best={metric!r}): the {split!r} rows of history.jsonl have no {name!r} "
            f"(they have: {', '.join(names)}); no checkpoint was deleted"
        )
