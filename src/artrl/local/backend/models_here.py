"""`LocalBackend`'s models served and trained in this process: each model's service (weights, engine,
gateway, trainer), its training lock, trackers and step commits. `LocalBackend(in_process=True)` holds one;
the service process of `in_process=False` (service_child.py) runs one too."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from artrl.config import (
    CheckpointRetention,
    EngineConfig,
    GatewayConfig,
    SFTConfig,
    TrainConfig,
    TrainerConfig,
)
from artrl.history.trackers import Trackers, open_trackers
from artrl.local.backend.model_record import recorded_engine
from artrl.local.concurrency.shielded import to_the_end
from artrl.local.service.checkpoints import delete_unkept, save_tokenizer
from artrl.local.service.step_commits import StepCommits
from artrl.model import TrainableModel, TrainResult, config_json
from artrl.storage import (
    FolderLock,
    append_history,
    atomic_write_json,
    checkpoint_dir,
    latest_step,
    lock_model_dir,
    model_dir,
    repair_history,
    restore_interrupted_publishes,
    write_step_rows,
    write_trajectories,
)
from artrl.trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from artrl.local.service.service import LocalService
    from artrl.local.train.row_renderer import RowRenderer

log = logging.getLogger(__name__)
RESERVED_SPLITS = ("train", "sft")  # written by model.train / model.train_sft, never by model.log


class ModelsHere:
    """The models of one backend, served and trained in this process. Files under `path/{project}/{model}/`."""

    def __init__(
        self,
        path: str,
        engine: EngineConfig,
        gateway: GatewayConfig,
        trainer: TrainerConfig,
        start: Callable[..., LocalService] | None = None,
    ) -> None:
        self.path = path
        self.engine_config, self.gateway_config, self.trainer_config = engine, gateway, trainer
        # what starts a model's service, with LocalService.start's arguments (None: that; a training server:
        # its adapter on the server's shared model)
        self._start_service = start
        self._services: dict[tuple[str, str], LocalService] = {}
        self._train_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._trackers: dict[tuple[str, str], Trackers] = {}
        self._locks: dict[tuple[str, str], FolderLock] = {}  # each registered model's folder (storage.py)
        # checkpoints written, engines updated, rows recorded (a step whose checkpoint failed: before the next)
        self._commits = StepCommits(self._record)
        self._renderer: RowRenderer | None = None  # (train_sft's render workers, started on first use)

    def service(self, model: TrainableModel) -> LocalService:
        try:
            return self._services[(model.project, model.name)]
        except KeyError:
            raise RuntimeError(f"model {model.name!r} is not registered with this backend") from None

    def directory(self, model: TrainableModel):
        return model_dir(self.path, model.project, model.name)

    def registered(self, model: TrainableModel) -> bool:
        return (model.project, model.name) in self._services

    async def register(self, model: TrainableModel) -> tuple[str, str]:
        key = (model.project, model.name)
        if key in self._services:
            raise ValueError(f"model {model.name!r} of project {model.project!r} is already registered")
        directory = self.directory(model)
        # this process's while the model is registered here: a second process (a script launched twice) or
        # a second backend on the same folder is refused, saying who holds it
        lock = lock_model_dir(directory)
        try:
            service, spec = await self._start(model, directory)
        except BaseException:
            lock.release()
            raise
        self._locks[key] = lock
        self._services[key] = service
        self._train_locks[key] = asyncio.Lock()
        if not (directory / "tokenizer").exists():  # for `artrl dashboard` to show tokens as text
            await asyncio.to_thread(save_tokenizer, service, directory)
        self._trackers[key] = await asyncio.to_thread(  # W&B starts a process: seconds
            open_trackers, model.report_to, directory, model.project, model.name, spec
        )
        return service.base_url, self.gateway_config.api_key or "artrl"

    async def unregister(self, model: TrainableModel) -> None:
        """Stop serving `model` (a training call in flight first ends): its service closed (its requests in
        flight end), trackers closed, folder unlocked. Its run folder stays: registering it again resumes."""
        key = (model.project, model.name)
        self.service(model)
        async with self._train_locks[key]:
            # a step whose checkpoint failed: written now, or logged as lost (no later train call writes it)
            await self._commits.write_unsaved_at_close(model, self._services[key], self.directory(model))
            service = self._services.pop(key)
            del self._train_locks[key]
            trackers, lock = self._trackers.pop(key, None), self._locks.pop(key, None)
            try:
                await service.close()
            finally:
                if trackers is not None:
                    await asyncio.to_thread(trackers.close)
                if lock is not None:
                    lock.release()

    async def _start(self, model: TrainableModel, directory: Path) -> tuple[LocalService, dict[str, Any]]:
        """model.json written, the service started from the latest checkpoint (the folder locked)."""
        from artrl.local.service.service import LocalService

        restore_interrupted_publishes(directory)  # (a crash mid-publish: the folder's lock is ours now)
        spec = {
            "name": model.name,
            "project": model.project,
            "base_model": model.base_model,
            "lora": model.lora.model_dump(mode="json") if model.lora else None,
            "chat_format": model.chat_format,
            "config": config_json(model.config),  # (the user's own settings: model.json and the trackers)
        }
        saved = directory / "model.json"
        if saved.exists():
            before = json.loads(saved.read_text())
            changed = [k for k in ("base_model", "lora") if before.get(k) != json.loads(json.dumps(spec[k]))]
            if changed and latest_step(directory) > 0:
                raise ValueError(
                    f"{directory} holds checkpoints of this model with a different {', '.join(changed)}; "
                    "use another model name (or remove that folder) to start afresh"
                )
        atomic_write_json(
            saved,
            {
                **spec,
                "engine": recorded_engine(self.engine_config),
                "gateway": self.gateway_config.model_dump(exclude={"api_key"}),
                "trainer": self.trainer_config.model_dump(),
            },
        )
        step = latest_step(directory)
        repair_history(directory)
        service = await asyncio.to_thread(
            self._start_service or LocalService.start,
            model.name,
            model.base_model,
            self.engine_config,
            self.gateway_config,
            model.lora,
            checkpoint_dir(directory, step) if step > 0 else None,
            directory,
            model.chat_format,
            True,
            self.trainer_config,
        )
        return service, spec

    def client_transport(self, model: TrainableModel, sync: bool = False, httpx: Any = None) -> Any:
        """The gateway in this process, reached without a socket (see local/gateway/in_process.py)."""
        service = self._services.get((model.project, model.name))
        if service is None or not self.gateway_config.in_process_clients:
            return None
        return service.server.transport(sync, httpx)

    async def train(
        self, model: TrainableModel, groups: list[TrajectoryGroup], config: TrainConfig
    ) -> TrainResult:
        """One GRPO step of `model` on `groups`, `config` as given (ART's names already translated)."""
        from artrl.local.train.batch import build_batch, check_groups, drop_stale, step_record

        service = self.service(model)
        directory = self.directory(model)
        async with self._train_locks[(model.project, model.name)]:
            await self._commits.write_unsaved(model, service, directory)
            check_groups(groups)  # (every trajectory, the stale ones too: they are written below)
            fresh, staleness, origin = drop_stale(groups, latest_step(directory), config.max_staleness)
            if staleness["trajectories_dropped_stale"] and not any(g.trajectories for g in fresh):
                log.warning(
                    "every trajectory of this step was sampled more than max_staleness=%s steps ago: nothing is "
                    "trained (with artrl.rollouts_ahead(ahead=k), set TrainConfig(max_staleness=k) or more)",
                    config.max_staleness,
                )
            batch = build_batch(
                fresh,
                service.train_format,  # (not the gateway's: it decodes on another thread meanwhile)
                service.max_context,
                config.scale_rewards,
                config.advantage_eps,
                config.allow_rendered_turns,
                config.chat_template_kwargs,
            )
            # the rows' places in `groups` as written (build_batch saw `fresh`)
            batch.locations = [(g, origin[g][t]) for g, t in batch.locations]
            step = latest_step(directory) + 1
            write_trajectories(directory, "train", step, groups)
            metrics = {**batch.metrics, **staleness, "learning_rate": config.learning_rate}

            async def whole_step() -> None:
                started = time.time()
                if batch.rows:
                    metrics.update(await service.train_step(batch, config))
                else:
                    metrics["optimizer_steps"] = 0
                metrics["step_seconds"] = time.time() - started
                if config.save_rows:
                    try:
                        await asyncio.to_thread(write_step_rows, directory, step, step_record(batch))
                    except (
                        OSError
                    ) as exc:  # (the weights changed: the step is saved and recorded all the same)
                        log.warning(
                            "step %d's trained rows were not written (%s); the step goes on", step, exc
                        )
                        metrics["rows_saved"] = 0
                await self._commits.complete(model, service, directory, step, "train", metrics)

            # a cancelled caller still gets the step saved and recorded (its weights change) before it is
            # cancelled: no step trains unrecorded, the next one is numbered after it
            try:
                async with self._progress(model, step, service):
                    await to_the_end(whole_step())
            finally:
                service.progress.phase = "idle"  # (failed or not: no call in flight)
        return TrainResult(step=step, metrics=metrics)

    def _progress(self, model: TrainableModel, step: int, service: LocalService):
        from artrl.progress_bar import progress_shown, watched

        shown = progress_shown(self.trainer_config.progress)
        return watched(f"{model.name} step {step}", service.progress.snapshot, shown)

    async def train_sft(
        self, model: TrainableModel, trajectories: list[Trajectory], config: SFTConfig
    ) -> TrainResult:
        from artrl.local.train.row_renderer import RowRenderer, sft_rows

        service = self.service(model)
        directory = self.directory(model)
        async with self._train_locks[(model.project, model.name)]:
            await self._commits.write_unsaved(model, service, directory)
            self._renderer = self._renderer or RowRenderer()
            per_trajectory = await sft_rows(self._renderer, service.train_format, trajectories, config)
            too_long = sum(len(r.ids) > service.max_context for rows in per_trajectory for r in rows)
            per_trajectory = [
                [r for r in rows if len(r.ids) <= service.max_context] for rows in per_trajectory
            ]
            rng = random.Random(config.seed)
            steps: list[list[Any]] = []
            for _ in range(config.epochs):
                order = list(range(len(trajectories)))
                rng.shuffle(order)
                for k in range(0, len(order), config.batch_size):
                    steps.append([r for i in order[k : k + config.batch_size] for r in per_trajectory[i]])
            step = latest_step(directory) + 1
            write_trajectories(directory, "sft", step, [TrajectoryGroup(trajectories)])
            metrics: dict[str, float] = {"trajectories": len(trajectories), "rows_skipped_too_long": too_long}

            async def whole_step() -> None:  # (as in train: saved and recorded even when cancelled)
                metrics.update(await service.train_sft(steps, config))
                await self._commits.complete(model, service, directory, step, "sft", metrics)

            try:
                async with self._progress(model, step, service):
                    await to_the_end(whole_step())
            finally:
                service.progress.phase = "idle"  # (failed or not: no call in flight)
        return TrainResult(step=step, metrics=metrics)

    async def export(self, model: TrainableModel, directory: str | os.PathLike[str]) -> None:
        await self.service(model).export(os.fspath(directory))

    async def log(
        self,
        model: TrainableModel,
        groups: list[TrajectoryGroup],
        split: str,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """A history row of `split` at `step` (default: the current): the groups' reward and metric means,
        then `metrics` as given; the groups' trajectories are written under that step."""
        if split in RESERVED_SPLITS:
            raise ValueError(
                f"split {split!r} holds what model.train/train_sft trained on (logging under it would overwrite "
                "that step's trajectories); log evaluations under another name, such as 'val'"
            )
        directory = self.directory(model)
        if step is None:
            step = latest_step(directory)
        elif isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a step number >= 0, got {step!r}")
        row: dict[str, float] = {}
        if groups:
            rewards = [t.reward for g in groups for t in g.trajectories]
            row = {
                "trajectories": len(rewards),
                "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            }
            for name in sorted({k for g in groups for t in g.trajectories for k in t.metrics}):
                values = [float(t.metrics[name]) for g in groups for t in g.trajectories if name in t.metrics]
                row[f"{name}_mean"] = sum(values) / len(values)
            write_trajectories(directory, split, step, groups)
        for name, value in (metrics or {}).items():
            if name in ("step", "split", "time"):
                raise ValueError(f"metric name {name!r} is a column of every history row; rename it")
            row[name] = float(value)
        self._record(model, directory, {"step": step, "split": split, "time": time.time(), **row})
        return row

    def _record(self, model: TrainableModel, directory, row: dict[str, Any]) -> None:
        """A history row: on disk (fsynced) first, then to the model's trackers (which never raise)."""
        append_history(directory, row)
        trackers = self._trackers.get((model.project, model.name))
        if trackers is not None:
            trackers.log(row)

    async def delete_checkpoints(self, model: TrainableModel, retention: CheckpointRetention) -> list[int]:
        """Delete the checkpoints `retention` does not keep (never the latest); return their steps."""
        self.service(model)  # registered with this backend (its training lock guards the folder)
        async with self._train_locks[(model.project, model.name)]:
            return await delete_unkept(self.directory(model), retention)

    async def close(self) -> None:
        if self._renderer is not None:
            await asyncio.to_thread(self._renderer.close)
        for model in self._commits.unsaved_models():  # (as in unregister: written now or logged as lost)
            key = (model.project, model.name)
            if key in self._services:
                async with self._train_locks[key]:
                    await self._commits.write_unsaved_at_close(
                        model, self._services[key], self.directory(model)
                    )
        services, self._services = list(self._services.values()), {}
        trackers, self._trackers = list(self._trackers.values()), {}
        locks, self._locks = list(self._locks.values()), {}
        try:
            for service in services:
                await service.close()
            for tracker in trackers:
                await asyncio.to_thread(tracker.close)
        finally:  # (the folders are free once nothing here writes to them)
            for lock in locks:
                lock.release()
