"""Reading runs from disk for the dashboard: the run folders under a root, their history, and the groups
and trajectories each step recorded. Read-only; a file torn by a running training is skipped, not fatal."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from artrl.local.dashboard.parsed_files import STEP_FILES
from artrl.storage import read_history

MAX_DEPTH = 4  # how deep under the root a run folder is looked for ({root}/{project}/{model} is 2)


class RunNotFound(LookupError):
    """A run, split, step, group or trajectory that is not on disk (the API answers 404)."""


def _is_run(folder: Path) -> bool:
    return (folder / "model.json").is_file() or (folder / "history.jsonl").is_file()


def find_runs(root: Path) -> dict[str, Path]:
    """Run id (its folder relative to `root`, '.' for the root itself) -> folder."""
    root = root.resolve()
    found: dict[str, Path] = {}

    def walk(folder: Path, depth: int) -> None:
        if _is_run(folder):
            found[folder.relative_to(root).as_posix() or "."] = folder
            return
        if depth >= MAX_DEPTH:
            return
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        for child in children:
            walk(child, depth + 1)

    walk(root, 0)
    return found


def run_folder(root: Path, run: str) -> Path:
    """The folder of run id `run` under `root`; never a path outside it."""
    root = root.resolve()
    folder = (root / run).resolve()
    if folder != root and root not in folder.parents:
        raise RunNotFound(f"run {run!r} is outside the dashboard's folder")
    if not _is_run(folder):
        raise RunNotFound(f"no run {run!r} under {root}")
    return folder


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def read_spec(folder: Path) -> dict[str, Any]:
    """The run's model.json ({} when it has none, or a torn one)."""
    try:
        spec = json.loads((folder / "model.json").read_text())
    except (OSError, ValueError):
        return {}
    return spec if isinstance(spec, dict) else {}


def run_summary(run: str, folder: Path) -> dict[str, Any]:
    spec = read_spec(folder)
    history = read_history(folder)
    history_file = folder / "history.jsonl"
    return {
        "id": run,
        "name": spec.get("name", folder.name),
        "project": spec.get("project", folder.parent.name),
        "base_model": spec.get("base_model"),
        "step": max((r["step"] for r in history if isinstance(r.get("step"), int)), default=0),
        "history_rows": len(history),
        "updated": history_file.stat().st_mtime if history_file.exists() else None,
        "splits": sorted({str(r.get("split")) for r in history if r.get("split")}),
    }


def clean_history(folder: Path) -> list[dict[str, Any]]:
    """History rows with numbers only (JSON has no NaN: non-finite values become null)."""
    rows = []
    for row in read_history(folder):
        rows.append({k: (v if finite(v) or not isinstance(v, float) else None) for k, v in row.items()})
    return rows


def recorded_steps(folder: Path) -> dict[str, list[int]]:
    """Split -> the steps whose trajectories were recorded (trajectories/{split}/{step}.jsonl)."""
    out: dict[str, list[int]] = {}
    base = folder / "trajectories"
    if not base.is_dir():
        return out
    for split_dir in sorted(p for p in base.iterdir() if p.is_dir()):
        steps = sorted(
            int(p.name.split(".")[0])
            for p in split_dir.glob("*.jsonl")
            if p.name.split(".")[0].isdigit() and p.name.count(".") == 1
        )
        if steps:
            out[split_dir.name] = steps
    return out


def _trajectory_file(folder: Path, split: str, step: int) -> Path:
    if not split.replace("_", "").replace("-", "").replace(".", "").isalnum() or split.startswith("."):
        raise RunNotFound(f"no split {split!r}")
    path = folder / "trajectories" / split / f"{step:04d}.jsonl"
    if not path.is_file():
        raise RunNotFound(f"no trajectories of split {split!r} at step {step}")
    return path


def read_groups(folder: Path, split: str, step: int) -> list[dict[str, Any]]:
    """The TrajectoryGroups of one step as JSON objects (a line torn by a crash is skipped); parsed once
    while the file is unchanged (shared: read only)."""
    return STEP_FILES.get(_trajectory_file(folder, split, step), parse_groups)


def parse_groups(path: Path) -> list[dict[str, Any]]:
    groups = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            groups.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return groups


def _is_choice(item: Any) -> bool:
    return isinstance(item, dict) and "finish_reason" in item and "message" in item


def group_summaries(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group with its trajectories ranked by reward (best first); groups by mean reward."""
    out = []
    for g, group in enumerate(groups):
        trajectories = []
        for t, traj in enumerate(group.get("trajectories", [])):
            items = traj.get("messages_and_choices", [])
            trajectories.append(
                {
                    "index": t,
                    "reward": traj.get("reward", 0.0),
                    "metrics": traj.get("metrics", {}),
                    "messages": len(items),
                    "sampled_turns": sum(1 for item in items if _is_choice(item)),
                }
            )
        rewards = [x["reward"] for x in trajectories if finite(x["reward"])]
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        spread = max(rewards) - min(rewards) if rewards else 0.0
        trajectories.sort(key=lambda x: -x["reward"] if finite(x["reward"]) else math.inf)
        out.append(
            {
                "group": g,
                "reward_mean": mean,
                "reward_spread": spread,
                "exceptions": len(group.get("exceptions", [])),
                "trajectories": trajectories,
            }
        )
    out.sort(key=lambda x: -x["reward_mean"])
    return out


def trajectory_at(groups: list[dict[str, Any]], group: int, index: int) -> dict[str, Any]:
    try:
        if group < 0 or index < 0:
            raise IndexError
        return groups[group]["trajectories"][index]
    except (IndexError, KeyError, TypeError):
        raise RunNotFound(f"no trajectory {index} in group {group}") from None


def _text(content: Any) -> str | None:
    """Message content as text (a list of parts: their text parts joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return json.dumps(content)


def conversation(history: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of one history for display: system/user/assistant/tool, sampled turns marked."""
    out = []
    for item in history.get("messages_and_choices", []):
        if _is_choice(item):
            message = item.get("message") or {}
            out.append(
                {
                    "role": "assistant",
                    "content": _text(message.get("content")),
                    "reasoning_content": message.get("reasoning_content"),
                    "tool_calls": message.get("tool_calls"),
                    "sampled": True,
                    "finish_reason": item.get("finish_reason"),
                    "sampled_tokens": len(item.get("token_ids") or []),
                }
            )
        elif isinstance(item, dict):
            out.append(
                {
                    "role": item.get("role"),
                    "content": _text(item.get("content")),
                    "reasoning_content": item.get("reasoning_content"),
                    "tool_calls": item.get("tool_calls"),
                    "tool_call_id": item.get("tool_call_id"),
                    "name": item.get("name"),
                    "sampled": False,
                }
            )
    return out
