"""One served model: loaded weights (+ adapter), the engine, the trainer and the gateway, wired together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from artrl.config import EngineConfig, GatewayConfig, LoraConfig, TrainerConfig
from artrl.local.chat_format import ChatFormat
from artrl.local.engine.contract import Engine
from artrl.local.engine.hf.engine import HFEngine
from artrl.local.engine.vllm.launch import VLLMLaunch, VLLMShare
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
from artrl.local.train.adapters import attach_adapter, load_adapter, save_weights
from artrl.local.train.progress import TrainProgress
from artrl.local.train.ranks.trainer_ranks import TrainerRanks
from artrl.local.train.trainer import Trainer

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass
class LocalService:
    model: Any
    tokenizer: Any
    chat_format: ChatFormat  # the gateway's: it decodes with its tokenizer on the gateway's thread
    engine: Engine
    server: GatewayServer
    trainer: Trainer | TrainerRanks | None = None
    max_context: int = 0
    names: ServedNames = field(default_factory=lambda: ServedNames([]))
    # training's own copy (rows of model.train/train_sft, built on the caller's thread): a fast tokenizer
    # used by two threads at once fails ("Already borrowed") or worse. None: chat_format's clone
    train_format: ChatFormat | None = None

    def __post_init__(self) -> None:
        if self.train_format is None and self.chat_format is not None:
            self.train_format = self.chat_format.clone()

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
        load: Callable[..., tuple[Any, Any]] = load_model_and_tokenizer,
        vllm_share: VLLMShare | None = None,
    ) -> LocalService:
        """Blocking: load the model, attach the adapter, resume, serve. Run it in a worker thread.

        `load` is `load_model_and_tokenizer` or what stands for it (`SharedBase.load`: the base weights of a
        training server's models, in memory once).

        `vllm_share`: the model is one of several on one vLLM server (a training server's, see VLLMShare).

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
        started = time.monotonic()
        log.info("loading %s%s", base_model, f" (resuming {resume_from})" if resume_from is not None else "")
        with LOADING:  # one model built at a time in this process (see LOADING)
            model, tokenizer = load(
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
        log.info("%s loaded in %.1f s", base_model, time.monotonic() - started)
        try:
            if engine_config.kind == "vllm":
                launch = VLLMLaunch(
                    served_name, base_model, engine_config, max_context, lora, log_dir, vllm_share
                )
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

    @property
    def progress(self) -> TrainProgress:
        """Where its current training call is (idle without a trainer)."""
        return self.trainer.progress if self.trainer is not None else TrainProgress()

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
        """Where the trainer decides (see `Trainer.run`, `TrainerRanks.run`), inside the engine's training
        context."""
        async with self.training():
            return await self._trainer().run(call, self.engine)

    def save_weights(self, directory: str) -> None:
        """Adapter or full weights and the optimizer state into `directory` (call it through run_exclusive)."""
        self._trainer().save(directory)

    def save_tokenizer(self, directory: Path) -> None:
        """The tokenizer alone (a few MB), so the run's tokens can be shown as text without the model."""
        self.tokenizer.save_pretrained(str(directory))

    async def export(self, directory: str) -> None:
        """The current weights as a Hugging Face folder with the tokenizer, into a new or empty `directory`
        (OutputFolderError otherwise: writing into a full one could overwrite a base model's own files). Written in a
        temporary sibling folder and renamed into place at the end: a failed export leaves no half folder."""
        import shutil

        from artrl.storage import prepare_output, publish_new_directory

        final = Path(directory)
        final.parent.mkdir(parents=True, exist_ok=True)  # (as save_pretrained did, unlike `artrl export`)
        prepare_output(final)
        tmp = final.parent / f".tmp-export-{final.name}"

        def write() -> None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            try:
                save_weights(self.model, str(tmp))
                self.tokenizer.save_pretrained(str(tmp))
                publish_new_directory(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise

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
