"""A trained step made permanent: its checkpoint written, the engine serving its weights, its history row
recorded; a step whose checkpoint could not be written is written before anything else trains."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from artrl.local.service.checkpoints import delete_unkept, save_checkpoint
from artrl.storage import checkpoint_dir

if TYPE_CHECKING:
    from artrl.local.service.service import LocalService
    from artrl.model import TrainableModel

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A training step's checkpoint could not be written (the disk is full, say). The step is not lost: its
    weights stay in memory and the next `train`/`train_sft` call writes that checkpoint first (closing the
    model tries once more, and logs the step as lost if it still cannot)."""


class StepCommits:
    """`record(model, directory, row)`: a history row, on disk and to the trackers (the backend's)."""

    def __init__(self, record: Callable[[TrainableModel, Any, dict[str, Any]], None]) -> None:
        self._record = record
        # a step whose checkpoint failed to write: (model, step, history row), written before any further
        # step, or at close
        self._unsaved: dict[tuple[str, str], tuple[TrainableModel, int, dict[str, Any]]] = {}

    async def complete(
        self,
        model: TrainableModel,
        service: LocalService,
        directory,
        step: int,
        split: str,
        metrics: dict[str, Any],
    ) -> None:
        row = {"step": step, "split": split, "time": time.time(), **metrics}
        try:
            await service.run_exclusive(
                lambda: save_checkpoint(service, directory, step, row), changes_weights=False
            )
        except Exception as exc:  # ENOSPC, or torch/safetensors' own errors for a failed write
            self._unsaved[(model.project, model.name)] = (model, step, row)
            raise CheckpointError(
                f"step {step}'s checkpoint could not be written to {checkpoint_dir(directory, step)}: {exc}. "
                f"The step is not lost: its weights are in memory and the next train or train_sft call writes "
                f"checkpoint {step} first (free some space before it)."
            ) from exc
        await self._publish(model, service, directory, step, row, metrics)

    async def _publish(
        self,
        model: TrainableModel,
        service: LocalService,
        directory,
        step: int,
        row: dict[str, Any],
        metrics: dict[str, Any],
    ) -> None:
        try:  # the engine serves the new weights from the next request on (vLLM: the adapter hot-load)
            started = time.time()
            await service.weights_updated(step, checkpoint_dir(directory, step))
            row["weight_sync_seconds"] = metrics["weight_sync_seconds"] = time.time() - started
        finally:
            self._record(model, directory, row)  # the step is saved whether or not the engine took it
        if model.retention is not None:  # (the caller holds the training lock)
            try:
                await delete_unkept(directory, model.retention)
            except ValueError as exc:  # a keep_best metric the history never had: the step itself is saved
                log.warning("checkpoint retention skipped after step %d: %s", step, exc)

    async def write_unsaved(self, model: TrainableModel, service: LocalService, directory) -> None:
        """Write the checkpoint of a step whose save failed, before anything else trains (CheckpointError
        again, and no training, while it still cannot be written)."""
        key = (model.project, model.name)
        if key not in self._unsaved:
            return
        _, step, row = self._unsaved[key]
        try:
            await service.run_exclusive(
                lambda: save_checkpoint(service, directory, step, row), changes_weights=False
            )
        except Exception as exc:
            raise CheckpointError(
                f"step {step}'s checkpoint still cannot be written: {exc}; nothing was trained. Free some space "
                "and call again."
            ) from exc
        del self._unsaved[key]
        await self._publish(model, service, directory, step, row, {})

    def unsaved_models(self) -> list[TrainableModel]:
        """The models with a step whose checkpoint is not written yet."""
        return [model for model, _, _ in self._unsaved.values()]

    async def write_unsaved_at_close(self, model: TrainableModel, service: LocalService, directory) -> None:
        """`write_unsaved` before `model`'s service closes (no later train call would write it); never
        raises: a step that still cannot be written is lost with the weights in memory, and said so."""
        key = (model.project, model.name)
        try:
            await self.write_unsaved(model, service, directory)
        except Exception as exc:
            if key not in self._unsaved:  # (written: the engine or the history failed after it)
                log.error(
                    "model %r: its checkpoint written at close was not published whole: %s", model.name, exc
                )
                return
            _, step, _ = self._unsaved.pop(key)
            log.error(
                "model %r (project %r): step %d is lost: its checkpoint could not be written before the model "
                "closed (%s); its weights were only in memory. Training resumes from the checkpoint before it.",
                model.name,
                model.project,
                step,
                exc,
            )
