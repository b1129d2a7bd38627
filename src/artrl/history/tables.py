"""`artrl history PATH`: the history.jsonl of a run (or of every run under a folder) as terminal tables.

Pure formatting over the files; no torch, no model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from artrl.storage import read_history

# shown when no --metrics is given, in this order, where the history has them
DEFAULT_METRICS = (
    "trajectories",
    "reward_mean",
    "reward_std",
    "loss",
    "loss_sum",  # (a Tinker step's: the sum over its tokens, as Tinker defines its losses)
    "clip_fraction",
    "kl",
    "entropy",
    "grad_norm",
    "step_seconds",
)
_NOT_METRICS = ("step", "split", "time")


def is_run(path: Path) -> bool:
    return (path / "history.jsonl").is_file() or (path / "model.json").is_file()


def runs_under(path: Path) -> list[Path]:
    """`path` itself when it is a run folder, else the run folders below it ({project}/{model} under a
    root, or {model} under a project), sorted."""
    if is_run(path):
        return [path]
    found = [p for p in sorted(path.glob("*")) if p.is_dir() and is_run(p)]
    found += [p for p in sorted(path.glob("*/*")) if p.is_dir() and is_run(p)]
    return sorted(found)


def metrics_of(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The metric names the rows carry, in first-seen order."""
    names: dict[str, None] = {}
    for row in rows:
        names.update((k, None) for k in row if k not in _NOT_METRICS)
    return list(names)


def default_metrics(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The usual training metrics present, then the means of the user's own evaluation metrics."""
    present = metrics_of(rows)
    chosen = [m for m in DEFAULT_METRICS if m in present]
    evaluated = {k for r in rows if r.get("split") not in ("train", "sft") for k in r}
    chosen += [m for m in present if m.endswith("_mean") and m in evaluated and m not in chosen]
    return chosen


def format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):  # bool too
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == int(value) and abs(value) < 1e9:
            return str(int(value))
        return f"{value:.4g}"
    return str(value)


def table(rows: Sequence[dict[str, Any]], metrics: Sequence[str]) -> str:
    """One line per history row: step, split, then `metrics` ('-' where a row lacks one)."""
    header = ["step", "split", *metrics]
    body = [
        [format_value(r.get("step")), str(r.get("split", "-"))] + [format_value(r.get(m)) for m in metrics]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(b) for b in body)])


def render(path: Path, split: str | None = None, metrics: Sequence[str] | None = None) -> str:
    """The tables of every run at or under `path` (ValueError, with what to do, for bad input)."""
    if not path.exists():
        raise ValueError(
            f"{path} does not exist; give a run folder ({{root}}/{{project}}/{{model}}) or a root"
        )
    runs = runs_under(path)
    if not runs:
        raise ValueError(
            f"no runs under {path}: a run folder holds history.jsonl (e.g. .artrl/PROJECT/MODEL)"
        )
    histories = {run: read_history(run) for run in runs}
    if split is not None:
        histories = {run: [r for r in rows if r.get("split") == split] for run, rows in histories.items()}
        if not any(histories.values()):
            splits = sorted({str(r.get("split")) for run in runs for r in read_history(run)})
            raise ValueError(
                f"no history rows of split {split!r} under {path}; its splits: {', '.join(splits)}"
            )
    if metrics:
        known = {m for rows in histories.values() for m in metrics_of(rows)}
        unknown = [m for m in metrics if m not in known]
        if unknown:
            raise ValueError(
                f"no metric {', '.join(map(repr, unknown))} in the history under {path}; "
                f"it has: {', '.join(sorted(known))}"
            )
    parts = []
    for run, rows in histories.items():
        title = f"{run.parent.name}/{run.name}  ({run})"
        if not rows:
            parts.append(f"{title}\n(no history rows{'' if split is None else f' of split {split!r}'} yet)")
            continue
        parts.append(f"{title}\n{table(rows, list(metrics) if metrics else default_metrics(rows))}")
    return "\n\n".join(parts)
