"""A saved run, read back from its folder ({root}/{project}/{model}): what `artrl export`, `merge` and
`serve` start from. Light (no torch): every problem is a `RunError` whose message says what to do."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from artrl.storage import (
    FolderInUseError,
    checkpoint_dir,
    checkpoint_steps,
    lock_model_dir,
    restore_interrupted_publishes,
)

# what a checkpoint holds besides the weights (training state, not part of a Hugging Face folder)
TRAINING_FILES = ("optimizer.pt", "history_row.json")


class RunError(ValueError):
    """Bad input about a run folder (missing, no checkpoints, no such step...): one line for the user."""


@dataclass(frozen=True)
class Run:
    directory: Path
    name: str
    project: str
    base_model: str
    lora: dict[str, Any] | None  # LoraConfig fields; None = full fine-tuning
    chat_format: str | None
    engine: dict[str, Any]  # the EngineConfig it was trained with

    @property
    def is_lora(self) -> bool:
        return self.lora is not None

    @property
    def hub_options(self) -> dict[str, Any]:
        """How the run loaded its base (`LoadConfig`'s `revision`, `trust_remote_code`), for every later
        `from_pretrained` of it (serve, merge, the tokenizer): the same weights, not the hub's newest."""
        load = self.engine.get("load") or {}
        return {k: load[k] for k in ("revision", "trust_remote_code") if load.get(k) not in (None, False)}

    def checkpoint(self, step: int | None = None) -> tuple[int, Path]:
        """(step, folder) of checkpoint `step`, or of the latest one when None."""
        steps = checkpoint_steps(self.directory)
        if not steps:
            raise RunError(
                f"{self.directory} has no checkpoints yet: train at least one step "
                "(model.train or model.train_sft) first"
            )
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise RunError(
                f"{self.directory} has no checkpoint of step {step}; its checkpoints: "
                f"{', '.join(map(str, steps))} (a CheckpointRetention or delete_checkpoints may have removed it)"
            )
        return step, checkpoint_dir(self.directory, step)


def open_run(path: str | Path) -> Run:
    directory = Path(path)
    if not directory.is_dir():
        raise RunError(f"{directory} is not a folder; give a run folder such as .artrl/PROJECT/MODEL")
    spec_path = directory / "model.json"
    if not spec_path.is_file():
        below = sorted(p.parent for p in directory.glob("*/*/model.json")) + sorted(
            p.parent for p in directory.glob("*/model.json")
        )
        hint = f" (runs below it: {', '.join(map(str, below[:5]))})" if below else ""
        raise RunError(f"{directory} is not a run folder: it has no model.json{hint}")
    _restore_if_unused(directory)
    try:
        spec = json.loads(spec_path.read_text())
        return Run(
            directory=directory,
            name=str(spec["name"]),
            project=str(spec.get("project", directory.parent.name)),
            base_model=str(spec["base_model"]),
            lora=spec.get("lora"),
            chat_format=spec.get("chat_format"),
            engine=spec.get("engine") or {},
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise RunError(f"{spec_path} is not a model.json artrl wrote ({type(exc).__name__}: {exc})") from None


def _restore_if_unused(directory: Path) -> None:
    """A checkpoint a crash left moved aside mid-publish, put back, when no process has the run registered
    (one that has it may be publishing this instant; it restores them itself when it registers again)."""
    try:
        lock = lock_model_dir(directory)
    except (FolderInUseError, OSError):  # (in use, or a folder this user cannot write: read it as it is)
        return
    try:
        restore_interrupted_publishes(directory)
    finally:
        lock.release()
