"""A model's files beside its weights: checkpoints written whole or not at all, the tokenizer copy, and
retention (which checkpoints to delete)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from artrl.config import CheckpointRetention
from artrl.retention import checkpoints_to_keep
from artrl.storage import (
    atomic_write_json,
    checkpoint_dir,
    checkpoint_steps,
    delete_checkpoint,
    publish_directory,
    read_history,
)

if TYPE_CHECKING:
    from artrl.local.service.service import LocalService


def save_checkpoint(service: LocalService, directory: Path, step: int, history_row: dict[str, Any]) -> None:
    """Weights, optimizer and the step's history row, published together by one rename (call it where
    nothing else touches the weights: `service.run_exclusive`)."""
    final = checkpoint_dir(directory, step)
    tmp = final.parent / f".tmp-{step:04d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        service.save_weights(str(tmp))
        atomic_write_json(tmp / "history_row.json", history_row)
        publish_directory(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written checkpoint must not take the space
        raise


def save_tokenizer(service: LocalService, directory: Path) -> None:
    """The tokenizer alone under `directory/tokenizer` (for `artrl dashboard` and `artrl serve`)."""
    tmp = directory / ".tmp-tokenizer"
    shutil.rmtree(tmp, ignore_errors=True)
    service.save_tokenizer(tmp)
    publish_directory(tmp, directory / "tokenizer")


async def delete_unkept(directory: Path, retention: CheckpointRetention) -> list[int]:
    """Delete the checkpoints `retention` does not keep; return their steps (the caller holds the model's
    training lock)."""
    steps = checkpoint_steps(directory)
    keep = checkpoints_to_keep(steps, read_history(directory), retention)
    doomed = [s for s in steps if s not in keep]
    for step in doomed:
        await asyncio.to_thread(delete_checkpoint, directory, step)
    return doomed
