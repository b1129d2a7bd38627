"""The training server's models next to vLLM (`artrl server --engine vllm`): one vLLM server (or
`VLLMConfig.replicas` of them) on the base weights serves every hosted model, each model's adapters loaded
into it at runtime under the model's own names (`TENANT/PROJECT/MODEL@STEP`: tenants' models of one name
never meet), and requests of several models batched together by vLLM's multi-LoRA serving (`--max-loras`
adapters in one batch). Each model's trainer is its own module tree over base tensors loaded once
(`SharedBase`); their training calls take turns on one thread."""

from __future__ import annotations

import secrets
import threading
from pathlib import Path
from types import SimpleNamespace

from artrl.config import EngineConfig, GatewayConfig, LoraConfig, TrainerConfig, VLLMConfig
from artrl.local.concurrency.idle_thread import IdleEndingExecutor
from artrl.local.engine.vllm.launch import VLLMLaunch, VLLMShare
from artrl.local.engine.vllm.server import VLLMServer, lora_rank_limit
from artrl.local.models.loading import context_length
from artrl.local.models.shared_base import SharedBase
from artrl.local.service.service import LocalService

SHARED_MAX_LORAS = 8  # adapters in one vLLM batch, unless VLLMConfig.max_loras says
SHARED_MAX_CPU_LORAS = (
    256  # adapters vLLM keeps in memory, unless VLLMConfig.extra_args say (--max-cpu-loras)
)
SHARED_MIN_RANK = 32  # the shared server's --max-lora-rank at least this (models register with their own)
BASE_NAME = "artrl-base"  # the base weights' name on the shared server


class SharedVLLM:
    def __init__(self, base_model: str, engine: EngineConfig, path: str) -> None:
        self.base_model, self.engine_config, self.path = base_model, engine, Path(path)
        self.base = SharedBase(base_model)
        self.servers: list[VLLMServer] = []
        # every model's training calls, one at a time, in the order they come (the GPU holds one step's
        # activations at a time; a tenant's calls at once are bounded by ServerConfig.max_queued_calls)
        self.trainer_thread = IdleEndingExecutor(engine.engine_thread_idle_s, "artrl-trainer")
        self._vllm: VLLMConfig | None = None  # how each model's engine reaches them
        self._lock = threading.Lock()
        self._closed = False

    def start(
        self,
        served_name: str,
        base_model: str,
        engine_config: EngineConfig,
        gateway_config: GatewayConfig,
        lora: LoraConfig | None,
        resume_from: Path | None = None,
        log_dir: Path | None = None,
        chat_format: str | None = None,
        trainable: bool = True,
        trainer_config: TrainerConfig | None = None,
    ) -> LocalService:
        """`LocalService.start` for one more model, its engine on the shared vLLM server(s) (blocking)."""
        if lora is None:
            raise ValueError("models on a shared vLLM server are LoRA adapters (lora=None changes the base)")
        vllm = self._shared(lora)
        if lora.rank > (vllm.max_lora_rank or 0):
            raise ValueError(
                f"this server's vLLM takes LoRA ranks up to {vllm.max_lora_rank} (VLLMConfig.max_lora_rank); "
                f"the model's rank is {lora.rank}"
            )
        adapter = served_name
        if log_dir is not None:  # (its folder under the server's: TENANT/PROJECT/MODEL)
            adapter = Path(log_dir).resolve().relative_to(self.path.resolve()).as_posix()
        return LocalService.start(
            served_name,
            base_model,
            engine_config.model_copy(update={"vllm": vllm}),
            gateway_config,
            lora,
            resume_from,
            log_dir,
            chat_format,
            trainable,
            trainer_config,
            load=self.base.load,
            vllm_share=VLLMShare(adapter, self.trainer_thread),
        )

    def _shared(self, lora: LoraConfig) -> VLLMConfig:
        """The servers' settings for a model's engine (started with the first model)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the training server is closing")
            if self._vllm is not None:
                return self._vllm
            from transformers import AutoConfig

            own = self.engine_config.vllm
            rank = own.max_lora_rank or lora_rank_limit(max(lora.rank, SHARED_MIN_RANK))
            # every model's latest adapters stay in vLLM's CPU cache (an evicted one is read again from its
            # checkpoint folder, which checkpoint retention may have deleted)
            cpu = (
                () if "--max-cpu-loras" in own.extra_args else ("--max-cpu-loras", str(SHARED_MAX_CPU_LORAS))
            )
            started = own.model_copy(
                update={
                    "api_key": own.api_key or secrets.token_urlsafe(32),
                    "max_loras": own.max_loras or SHARED_MAX_LORAS,
                    "max_lora_rank": rank,
                    "extra_args": (*own.extra_args, *cpu),
                }
            )
            config = self.engine_config.model_copy(update={"vllm": started})
            model_config = SimpleNamespace(config=AutoConfig.from_pretrained(self.base_model))
            launch = VLLMLaunch(
                BASE_NAME,
                self.base_model,
                config,
                context_length(model_config, self.engine_config),
                LoraConfig(rank=rank),
                self.path / ".vllm",
            )
            try:
                for index in range(own.replicas):
                    self.servers.append(launch.server(index))
            except BaseException:
                self._stop()
                raise
            fields = started.model_dump(exclude={"replicas", "url"})
            self._vllm = VLLMConfig.model_validate({**fields, "url": [s.base_url for s in self.servers]})
            return self._vllm

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stop()
        self.trainer_thread.shutdown(wait=True)

    def _stop(self) -> None:
        servers, self.servers = self.servers, []
        for server in servers:
            server.stop()
