"""`LocalBackend` (public as `artrl.LocalBackend`): serve and train models on this machine. A small facade:
it checks the user's arguments, translates ART's names once, and hands every call to one of two modes —
`ModelsHere` (models_here.py: everything in this process) or `ServiceProcess` (service_process.py: the same
in a child process, over pipes). Light to import: the engine, gateway and trainer load on `register`."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from artrl.art_names import train_config
from artrl.config import (
    CheckpointRetention,
    EngineConfig,
    GatewayConfig,
    SFTConfig,
    TrainConfig,
    TrainerConfig,
    VLLMConfig,
)
from artrl.local.service.step_commits import CheckpointError
from artrl.log_handler import ensure_log_handler
from artrl.model import TrainableModel, TrainResult
from artrl.storage import latest_step, model_dir
from artrl.trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from artrl.local.backend.models_here import ModelsHere
    from artrl.local.backend.service_process import ServiceProcess
    from artrl.local.service.service import LocalService

__all__ = ["CheckpointError", "LocalBackend"]  # (CheckpointError: public as artrl.CheckpointError)


class LocalBackend:
    """Serves and trains models on this machine: the OpenAI-compatible gateway, the engine, the trainer.

    `engine="hf"` (default): the embedded engine, in this process, on the trainer's own weights.
    `engine="vllm"`: a vLLM server that artrl starts and supervises (its environment: `bash
    scripts/setup_vllm.sh`; `VLLMConfig(replicas=N)`: N of them), or the one(s) at `vllm_url=`; the trained
    adapter is loaded into it (every replica) every step.
    Pass an `EngineConfig` for every setting (`EngineConfig(kind="vllm", vllm=VLLMConfig(...))`).
    `trainer=TrainerConfig(ranks=N)` trains in N processes with FSDP2 (docs/multi-gpu.md); default: in this one.
    `in_process=False`: all of it (engines, gateways, trainers) in one child process, the agents in this one:
    `model.openai_client()` reaches the gateway over a pipe (local/backend/service_process.py), and the SDK's work
    runs beside the engine's instead of taking turns with it on one interpreter lock.

    Files go under `path/{project}/{model}/`. Use `async with LocalBackend() as backend:` or call
    `await backend.close()`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] = ".artrl",
        *,
        engine: EngineConfig | Literal["hf", "vllm"] | None = None,
        gateway: GatewayConfig | None = None,
        vllm_url: str | list[str] | None = None,
        trainer: TrainerConfig | None = None,
        in_process: bool = True,
    ) -> None:
        ensure_log_handler()  # (a model loading, vLLM starting: minutes on a real model, said on stderr)
        self.path = os.fspath(path)
        if isinstance(engine, str):
            if engine not in ("hf", "vllm"):
                raise ValueError(f"engine={engine!r}: use 'hf' (embedded) or 'vllm', or an EngineConfig")
            engine = EngineConfig(kind=engine)
        engine = engine or EngineConfig()
        if vllm_url is not None:
            if engine.kind != "vllm":
                raise ValueError("vllm_url= needs engine='vllm'")
            url = vllm_url if isinstance(vllm_url, str) else tuple(vllm_url)
            engine = engine.model_copy(update={"vllm": engine.vllm.model_copy(update={"url": url})})
            VLLMConfig.model_validate(engine.vllm.model_dump(exclude_unset=True))  # as if given together
        self.engine_config = engine
        self.gateway_config = gateway or GatewayConfig()
        self.trainer_config = trainer or TrainerConfig()
        self._models: ModelsHere | ServiceProcess
        if in_process:
            from artrl.local.backend.models_here import ModelsHere

            self._models = ModelsHere(self.path, engine, self.gateway_config, self.trainer_config)
        else:
            from artrl.local.backend.service_process import ServiceProcess

            self._models = ServiceProcess(self.path, engine, self.gateway_config, self.trainer_config)

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def service(self, model: TrainableModel) -> LocalService:
        """The model's service (weights, engine, gateway, trainer), for tests and tools in this process."""
        return self._models.service(model)

    def directory(self, model: TrainableModel) -> Path:
        return model_dir(self.path, model.project, model.name)

    def registered(self, model: TrainableModel) -> bool:
        return self._models.registered(model)

    async def register(self, model: TrainableModel) -> tuple[str, str]:
        """Serve `model` (its latest checkpoint, if any): the gateway's base URL and API key."""
        return await self._models.register(model)

    def client_transport(self, model: TrainableModel, sync: bool = False, httpx: Any = None) -> Any:
        """An httpx transport to the model's gateway without a socket (None: use HTTP); `httpx`: the package
        of the client it is for (None: openai's)."""
        return self._models.client_transport(model, sync, httpx)

    async def get_step(self, model: TrainableModel) -> int:
        return latest_step(self.directory(model))

    async def train(
        self,
        model: TrainableModel,
        groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        **art_settings: Any,
    ) -> TrainResult:
        """One GRPO step of `model` on `groups` (what `model.train` does). ART's form works too:
        `backend.train(model, groups, learning_rate=5e-6, ...)` (the names artrl.art_names knows)."""
        if art_settings or config is None:
            config = train_config(config, art_settings)
        return await self._models.train(model, list(groups), config)

    async def train_sft(
        self, model: TrainableModel, trajectories: list[Trajectory], config: SFTConfig
    ) -> TrainResult:
        if not trajectories:
            raise ValueError("train_sft() got no trajectories")
        return await self._models.train_sft(model, trajectories, config)

    async def export(self, model: TrainableModel, directory: str | os.PathLike[str]) -> None:
        """Write the current weights as a Hugging Face folder with the tokenizer: a full model after full
        fine-tuning (usable as `base_model=`), or a PEFT adapter folder (referencing its base) with LoRA."""
        await self._models.export(model, os.fspath(directory))

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
        return await self._models.log(model, groups, split, metrics, step)

    async def delete_checkpoints(self, model: TrainableModel, retention: CheckpointRetention) -> list[int]:
        """Delete the checkpoints `retention` does not keep (never the latest); return their steps."""
        return await self._models.delete_checkpoints(model, retention)

    async def close(self) -> None:
        await self._models.close()
