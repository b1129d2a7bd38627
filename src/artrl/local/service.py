"""One served model: loaded weights (+ adapter), the engine, the trainer and the gateway, wired together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from artrl.config import EngineConfig, GatewayConfig, LoraConfig, VLLMConfig
from artrl.local.chat_format import ChatFormat
from artrl.local.engine import Engine, EngineError
from artrl.local.engine_hf import HFEngine
from artrl.local.engine_vllm import VLLMEngine
from artrl.local.gateway.app import create_app
from artrl.local.gateway.captures import CaptureStore
from artrl.local.gateway.prompts import CompletionStore, PromptBuilder
from artrl.local.gateway.serving import ChatServing
from artrl.local.loading import (
    context_length,
    end_of_turn_ids,
    load_model_and_tokenizer,
    pick_device,
    pick_dtype,
)
from artrl.local.server import GatewayServer
from artrl.local.trainer import Trainer, attach_adapter
from artrl.local.vllm_server import VLLMServer

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass
class LocalService:
    model: Any
    tokenizer: Any
    chat_format: ChatFormat
    engine: Engine
    server: GatewayServer
    trainer: Trainer | None = None
    max_context: int = 0
    _training_thread: ThreadPoolExecutor | None = None  # the vLLM engine: training runs here
    _vllm: VLLMLaunch | None = None  # how vLLM was started (full fine-tuning restarts it on a checkpoint)

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
    ) -> LocalService:
        """Blocking: load the model, attach the adapter, resume, serve. Run it in a worker thread."""
        full_weights = lora is None and resume_from is not None
        model, tokenizer = load_model_and_tokenizer(
            base_model, engine_config, str(resume_from) if full_weights else None
        )
        model = attach_adapter(model, lora)
        model.eval()
        trainer = Trainer(model, pad_id=tokenizer.pad_token_id or 0)
        if resume_from is not None:
            trainer.load(str(resume_from))
        max_context = context_length(model, engine_config)
        launch = None
        if engine_config.kind == "vllm":
            launch = VLLMLaunch(served_name, base_model, engine_config, max_context, lora, log_dir)
            engine: Engine = launch.engine(resume_from)
        else:
            engine = HFEngine(
                model,
                max_context=max_context,
                max_batch_size=engine_config.max_batch_size,
                max_prefill_tokens=engine_config.max_prefill_tokens,
                stream_idle_timeout_s=engine_config.stream_idle_timeout_s,
            )
        try:
            service = cls.serve(
                served_name, model, tokenizer, engine, engine_config, gateway_config, chat_format
            )
        except BaseException:
            if isinstance(engine, VLLMEngine) and engine.server is not None:
                engine.server.stop()
            raise
        service.trainer = trainer
        if isinstance(engine, VLLMEngine):
            service._training_thread = ThreadPoolExecutor(1, thread_name_prefix="artrl-trainer")
            service._vllm = launch
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
    ) -> LocalService:
        """Put a gateway in front of an engine that is already running."""
        fmt = ChatFormat.for_tokenizer(
            tokenizer, chat_format, extra_stop_ids=end_of_turn_ids(model, tokenizer)
        )
        builder = PromptBuilder(fmt.clone(), CompletionStore(gateway_config.completion_store_size))
        serving = ChatServing(
            engine, fmt, builder, [served_name], engine_config.default_max_tokens, engine_config.max_n
        )
        app = create_app(
            serving,
            api_key=gateway_config.api_key,
            max_request_bytes=gateway_config.max_request_bytes,
            max_inflight=gateway_config.max_inflight_requests,
            captures=CaptureStore(
                gateway_config.max_open_captures,
                gateway_config.max_capture_records,
                max_bytes=gateway_config.max_capture_bytes,
                max_total_bytes=gateway_config.max_captured_bytes,
            ),
        )
        server = GatewayServer(app, gateway_config.host, gateway_config.port, gateway_config.keep_alive_s)
        server.start(gateway_config.startup_timeout_s)
        return cls(model, tokenizer, fmt, engine, server, max_context=engine.max_context)

    async def run_exclusive(self, fn: Callable[[], T]) -> T:
        """Run fn where nothing else touches the trainer's weights: on the embedded engine's thread, between
        token steps; with vLLM (which has its own copy) on the trainer's own thread."""
        if isinstance(self.engine, HFEngine):
            return await asyncio.wrap_future(self.engine.call(fn))
        if self._training_thread is None:
            raise RuntimeError("training needs a model loaded by LocalService.start")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._training_thread, fn)

    @contextlib.asynccontextmanager
    async def training(self) -> AsyncIterator[None]:
        """Around a training step: where the user shares one GPU between vLLM and the trainer
        (VLLMConfig.sleep_while_training), vLLM sleeps inside the block and wakes up after it, failed or not."""
        engine = self.engine
        if not (isinstance(engine, VLLMEngine) and engine.config.sleep_while_training):
            yield
            return
        try:
            await engine.sleep()
            yield
        finally:
            try:  # a failure here must not cost the step its checkpoint: weights_updated wakes it again
                await engine.wake_up()
            except EngineError as exc:
                log.warning("vLLM did not wake up after training: %s", exc)

    async def weights_updated(self, step: int, checkpoint: Path) -> None:
        """The trainer published `checkpoint`: make the engine generate with it from the next request on.

        The embedded engine already does (same weights); vLLM loads the adapter as `{model}@{step}`, or, after
        full fine-tuning, restarts on the checkpoint."""
        if not isinstance(self.engine, VLLMEngine):
            return
        if self.engine.config.sleep_while_training:
            await self.engine.wake_up()  # awake already, unless waking after training failed
        if self.trainer is not None and self.trainer.has_adapter:
            await self.engine.load_adapter(step, str(checkpoint))
        else:
            launch = self._vllm
            await self.engine.reload_weights(None if launch is None else lambda: launch.server(checkpoint))

    async def close(self) -> None:
        self.server.stop()
        await self.engine.close()
        if self._training_thread is not None:
            self._training_thread.shutdown(wait=True)


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
        server = None
        if config.url is not None:
            if self.lora is None:
                raise ValueError(
                    "full fine-tuning (lora=None) with a vLLM server artrl did not start (vllm_url) cannot "
                    "reload the weights after a step; train a LoRA, or let artrl start the server"
                )
            base_url, served, key = config.url, served_model_of(config.url, config), config.api_key
        else:
            server = self.server(resume_from if self.lora is None else None)
            base_url, served, key = server.base_url, self.served_name, server.api_key
        engine = VLLMEngine(base_url, served, self.served_name, self.max_context, config, server, key)
        if self.lora is not None and resume_from is not None:
            try:
                asyncio.run(engine.load_adapter(int(resume_from.name), str(resume_from)))
            except BaseException:
                if server is not None:
                    server.stop()
                raise
        return engine

    def server(self, full_weights: Path | None = None) -> VLLMServer:
        """A supervised server on the base model (adapters enabled with a LoRA), or on a full checkpoint."""
        device = pick_device(self.engine_config)
        return VLLMServer.start(
            str(full_weights or self.base_model),
            self.served_name,
            (self.log_dir or Path(".")) / "vllm.log",
            self.engine_config.vllm,
            max_model_len=self.max_context,
            tokenizer=self.base_model if full_weights else None,
            lora_rank=self.lora.rank if self.lora else None,
            dtype=str(pick_dtype(self.engine_config, device)).removeprefix("torch."),
            on_cpu=device.type == "cpu",
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
