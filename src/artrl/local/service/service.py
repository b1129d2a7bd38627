"""One served model: loaded weights (+ adapter), the engine, the trainer and the gateway, wired together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from artrl.config import EngineConfig, GatewayConfig, LoraConfig, TrainerConfig, VLLMConfig
from artrl.local.chat_format import ChatFormat
from artrl.local.concurrency.shielded import to_thread_to_the_end
from artrl.local.engine.contract import Engine
from artrl.local.engine.hf.engine import HFEngine
from artrl.local.engine.vllm.engine import VLLMEngine
from artrl.local.engine.vllm.replicas import Replica
from artrl.local.engine.vllm.server import VLLMServer, replica_placement
from artrl.local.gateway.app import create_app
from artrl.local.gateway.names import ServedNames
from artrl.local.gateway.prompts import CompletionStore, PromptBuilder
from artrl.local.gateway.server import GatewayServer
from artrl.local.gateway.serving import ChatServing
from artrl.local.models.loading import (
    LOADING,
    context_length,
    end_of_turn_ids,
    load_model_and_tokenizer,
    pick_device,
    pick_dtype,
)
from artrl.local.train.ranks.trainer_ranks import TrainerRanks
from artrl.local.train.trainer import Trainer, attach_adapter, load_adapter

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass
class LocalService:
    model: Any
    tokenizer: Any
    chat_format: ChatFormat
    engine: Engine
    server: GatewayServer
    trainer: Trainer | TrainerRanks | None = None
    max_context: int = 0
    names: ServedNames = field(default_factory=lambda: ServedNames([]))

    @property
    def step(self) -> int:
        """The step whose weights are served (0: the base model); requests may pin it as `name@step`."""
        return self.names.step

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @classmethod
    def start(
        cls,
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
        """Blocking: load the model, attach the adapter, resume, serve. Run it in a worker thread.

        `trainable=False` serves `resume_from`'s weights only (`artrl serve`): no trainer, no optimizer state.
        `trainer_config.ranks > 1` trains in that many processes (TrainerRanks), started here."""
        trainer_config = trainer_config or TrainerConfig()
        if engine_config.load.quantization == "4bit" and trainer_config.ranks > 1 and trainable:
            raise ValueError(
                "4-bit base weights (QLoRA) train in one process here: sharding bitsandbytes' 4-bit weights "
                "across trainer ranks is not supported; use TrainerConfig(ranks=1), or bf16 weights with ranks"
            )
        if engine_config.load.device_map is not None and trainer_config.ranks > 1 and trainable:
            raise ValueError(
                "LoadConfig(device_map=...) places one copy of the model across devices; trainer ranks shard it "
                "themselves (FSDP2): use one or the other"
            )
        full_weights = lora is None and resume_from is not None
        if engine_config.load.quantization == "4bit" and lora is None and trainable:
            raise ValueError(
                "4-bit base weights (LoadConfig(quantization='4bit')) train only through a LoRA adapter: "
                "pass lora=artrl.LoraConfig(...) or load the weights unquantized"
            )
        with LOADING:  # one model built at a time in this process (see LOADING)
            model, tokenizer = load_model_and_tokenizer(
                base_model,
                main_copy_config(engine_config, trainer_config, trainable),
                str(resume_from) if full_weights else None,
            )
            trainer: Trainer | TrainerRanks | None = None
            if trainable:
                model = attach_adapter(model, lora)
                if trainer_config.ranks == 1:
                    trainer = Trainer(
                        model,
                        pad_id=tokenizer.pad_token_id or 0,
                        fused_lora=trainer_config.fused_lora,
                        share_prompts=trainer_config.share_prompts,
                        fused_norms=trainer_config.fused_norms,
                    )
                    if resume_from is not None:
                        trainer.load(str(resume_from))
                elif lora is not None and resume_from is not None:
                    load_adapter(model, str(resume_from))
            elif lora is not None and resume_from is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, str(resume_from))  # frozen: inference only
        model.eval()
        if trainable and trainer_config.ranks > 1:  # (after loading: the ranks start from its adapter)
            trainer = TrainerRanks(
                model,
                base_model,
                engine_config,
                lora,
                trainer_config,
                tokenizer.pad_token_id or 0,
                resume_from,
                log_dir or Path("."),
            )
        max_context = context_length(model, engine_config)
        try:
            if engine_config.kind == "vllm":
                launch = VLLMLaunch(served_name, base_model, engine_config, max_context, lora, log_dir)
                engine: Engine = launch.engine(resume_from)
            else:
                engine = HFEngine(model, max_context=max_context, config=engine_config)
        except BaseException:
            if trainer is not None:
                trainer.close()  # (no rank outlives a service that failed to start)
            raise
        try:
            step = int(resume_from.name) if resume_from is not None and resume_from.name.isdigit() else 0
            service = cls.serve(
                served_name, model, tokenizer, engine, engine_config, gateway_config, chat_format, step
            )
        except BaseException:
            try:
                asyncio.run(engine.close())  # a vLLM server started for it must not outlive it
            finally:
                if trainer is not None:
                    trainer.close()
            raise
        service.trainer = trainer
        return service

    @classmethod
    def serve(
        cls,
        served_name: str,
        model: Any,
        tokenizer: Any,
        engine: Engine,
        engine_config: EngineConfig,
        gateway_config: GatewayConfig,
        chat_format: str | None = None,
        step: int = 0,
    ) -> LocalService:
        """Put a gateway in front of an engine that is already running (serving `step`'s weights)."""
        fmt = ChatFormat.for_tokenizer(
            tokenizer, chat_format, extra_stop_ids=end_of_turn_ids(model, tokenizer)
        )
        builder = PromptBuilder(fmt.clone(), CompletionStore(gateway_config.completion_store_size))
        names = ServedNames([served_name], step)
        serving = ChatServing(
            engine, fmt, builder, names, engine_config.default_max_tokens, engine_config.max_n
        )
        server = GatewayServer(create_app(serving, gateway_config), gateway_config)
        server.start(gateway_config.startup_timeout_s)
        return cls(model, tokenizer, fmt, engine, server, max_context=engine.max_context, names=names)

    def _trainer(self) -> Trainer | TrainerRanks:
        if self.trainer is None:
            raise RuntimeError("this service serves a model it cannot train (started without a trainer)")
        return self.trainer

    async def train_step(self, batch: Any, config: Any) -> dict[str, float]:
        """One GRPO call (see Trainer.step)."""
        return await self._train(lambda trainer: trainer.step(batch, config))

    async def train_sft(self, steps: list[list[Any]], config: Any) -> dict[str, float]:
        return await self._train(lambda trainer: trainer.sft(steps, config))

    async def _train(self, call: Callable[[Any], dict[str, float]]) -> dict[str, float]:
        """In this process: where nothing else touches the weights (the embedded engine's thread). In the
        trainer ranks: while the engine keeps serving the previous weights, which are then replaced."""
        trainer = self._trainer()
        async with self.training():
            if isinstance(trainer, Trainer):
                return await self.run_exclusive(lambda: call(trainer))
            metrics = await to_thread_to_the_end(call, trainer)
            await self.run_exclusive(trainer.load_update)
            return metrics

    def save_weights(self, directory: str) -> None:
        """Adapter or full weights and the optimizer state into `directory` (call it through run_exclusive)."""
        self._trainer().save(directory)

    def save_tokenizer(self, directory: Path) -> None:
        """The tokenizer alone (a few MB), so the run's tokens can be shown as text without the model."""
        self.tokenizer.save_pretrained(str(directory))

    async def export(self, directory: str) -> None:
        """The current weights as a Hugging Face folder with the tokenizer."""

        def write() -> None:
            self.model.save_pretrained(directory)
            self.tokenizer.save_pretrained(directory)

        await self.run_exclusive(write, changes_weights=False)

    async def run_exclusive(self, fn: Callable[[], T], *, changes_weights: bool = True) -> T:
        """Run fn where nothing else touches the trainer's weights (the engine decides where).
        changes_weights=False (a save): the engine keeps what it derived from the weights (cached prefixes)."""
        return await self.engine.run_exclusive(fn, changes_weights=changes_weights)

    def training(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Around a training step (the engine decides what that means for it)."""
        return self.engine.training()

    async def weights_updated(self, step: int, checkpoint: Path) -> None:
        """The trainer published `checkpoint`: the engine generates with it from the next request on."""
        adapter = self.trainer is not None and self.trainer.has_adapter
        await self.engine.publish(step, str(checkpoint), adapter)
        self.names.step = step  # `name@step` answers from now on (not when the engine kept the old weights)

    async def close(self) -> None:
        """The gateway, the engine, the trainer: each stopped even when one before it fails to stop."""
        try:
            self.server.stop()
        finally:
            try:
                await self.engine.close()
            finally:
                if self.trainer is not None:
                    await asyncio.to_thread(self.trainer.close)


def main_copy_config(
    engine_config: EngineConfig, trainer_config: TrainerConfig, trainable: bool
) -> EngineConfig:
    """Where this process loads its copy of the model. Next to vLLM with trainer ranks (ranks > 1), the copy
    never runs: it receives the trained weights and writes the checkpoints vLLM loads, so it stays on the CPU
    (in the dtype the ranks train in), leaving the GPUs to vLLM and the ranks. Otherwise: `engine_config`."""
    device = pick_device(engine_config)
    if engine_config.kind != "vllm" or trainer_config.ranks == 1 or not trainable or device.type == "cpu":
        return engine_config
    dtype = str(pick_dtype(engine_config, device)).removeprefix("torch.")
    load = engine_config.load.model_copy(update={"attn_implementation": None})  # (kernels of the GPU)
    return engine_config.model_copy(update={"device": "cpu", "dtype": dtype, "load": load})


@dataclass(frozen=True)
class VLLMLaunch:
    """How vLLM serves one model: started by artrl (on the base weights, or on a full-weights checkpoint), or
    the server at `VLLMConfig.url`."""

    served_name: str
    base_model: str
    engine_config: EngineConfig
    max_context: int
    lora: LoraConfig | None
    log_dir: Path | None

    def engine(self, resume_from: Path | None) -> VLLMEngine:
        """The engine, with `resume_from`'s weights served: its adapter loaded, or its full weights."""
        config = self.engine_config.vllm
        start = None
        full_weights = resume_from if self.lora is None else None
        if config.urls:
            if self.lora is None:
                raise ValueError(
                    "full fine-tuning (lora=None) with a vLLM server artrl did not start (vllm_url) cannot "
                    "reload the weights after a step; train a LoRA, or let artrl start the server"
                )
            served = {served_model_of(url, config) for url in config.urls}
            if len(served) > 1:
                raise ValueError(f"the vLLM servers at {list(config.urls)} serve different models: {served}")
            replicas = [Replica(i, url.rstrip("/"), config.api_key) for i, url in enumerate(config.urls)]
            base = served.pop()
        else:
            with ThreadPoolExecutor(config.replicas) as pool:
                starts = [pool.submit(self.server, i, full_weights) for i in range(config.replicas)]
                wait(starts)
            if any(f.exception() for f in starts):
                for f in starts:
                    if f.exception() is None:
                        f.result().stop()
                raise next(f.exception() for f in starts if f.exception())  # type: ignore[misc]
            servers = [f.result() for f in starts]
            replicas = [Replica(i, s.base_url, s.api_key, s) for i, s in enumerate(servers)]
            base = self.served_name

            def start(index: int, checkpoint: str | None, cancel: threading.Event) -> VLLMServer:
                return self.server(index, Path(checkpoint) if checkpoint else None, cancel)

        idle_s = self.engine_config.engine_thread_idle_s
        engine = VLLMEngine(replicas, base, self.served_name, self.max_context, config, start, idle_s)
        engine.replicas.weights = str(full_weights) if full_weights else None
        if self.lora is not None and resume_from is not None:
            try:
                asyncio.run(engine.load_adapter(int(resume_from.name), str(resume_from)))
            except BaseException:
                asyncio.run(engine.close())
                raise
        return engine

    def server(
        self, index: int = 0, full_weights: Path | None = None, cancel: threading.Event | None = None
    ) -> VLLMServer:
        """Replica `index`'s supervised server on the base model (adapters enabled with a LoRA), or on a full
        checkpoint; several replicas on one machine get their own cores or GPUs (replica_placement)."""
        device = pick_device(self.engine_config)
        config = self.engine_config.vllm
        user_env = {**config.env, **(config.replica_env[index] if config.replica_env else {})}
        on_cpu = device.type == "cpu"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else None
        if gpus is None and device.type == "cuda":
            import torch

            gpus = [str(i) for i in range(torch.cuda.device_count())]
        placement = replica_placement(
            index,
            config.replicas,
            config.tensor_parallel_size,
            on_cpu,
            sorted(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else list(range(os.cpu_count() or 1)),
            {**os.environ, **user_env} if on_cpu else user_env,
            gpus,
        )
        log_name = "vllm.log" if config.replicas == 1 else f"vllm-{index}.log"
        return VLLMServer.start(
            str(full_weights or self.base_model),
            self.served_name,
            (self.log_dir or Path(".")) / log_name,
            config,
            max_model_len=self.max_context,
            tokenizer=self.base_model if full_weights else None,
            lora_rank=self.lora.rank if self.lora else None,
            dtype=str(pick_dtype(self.engine_config, device)).removeprefix("torch."),
            on_cpu=on_cpu,
            load=self.engine_config.load,
            env={**placement, **user_env},
            cancel=cancel,
        )


def served_model_of(url: str, config: VLLMConfig) -> str:
    """The model a running vLLM server serves (its first /v1/models entry that is not an adapter)."""
    import httpx

    try:
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        response = httpx.get(
            f"{url.rstrip('/')}/v1/models", timeout=config.connect_timeout_s, headers=headers
        )
        response.raise_for_status()
        models = response.json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise RuntimeError(f"could not list the models of the vLLM server at {url}: {exc}") from exc
    bases = [m["id"] for m in models if not m.get("parent")]
    if not bases:
        raise RuntimeError(f"the vLLM server at {url} serves no base model: {models}")
    return bases[0]
