"""One served model: loaded weights (+ adapter), the engine, the trainer and the gateway, wired together."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from artrl.config import EngineConfig, GatewayConfig, LoraConfig
from artrl.local.engine import Engine
from artrl.local.engine_hf import HFEngine
from artrl.local.gateway.app import create_app
from artrl.local.gateway.captures import CaptureStore
from artrl.local.gateway.prompts import CompletionStore, PromptBuilder
from artrl.local.gateway.serving import ChatServing
from artrl.local.loading import context_length, end_of_turn_ids, load_model_and_tokenizer
from artrl.local.server import GatewayServer
from artrl.local.trainer import Trainer, attach_adapter

T = TypeVar("T")


@dataclass
class LocalService:
    model: Any
    tokenizer: Any
    engine: Engine
    server: GatewayServer
    trainer: Trainer | None = None
    max_context: int = 0

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
        engine = HFEngine(model, max_context=max_context, max_batch_size=engine_config.max_batch_size)
        service = cls.serve(served_name, model, tokenizer, engine, engine_config, gateway_config)
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
    ) -> LocalService:
        """Put a gateway in front of an engine that is already running."""
        builder = PromptBuilder(tokenizer, CompletionStore(gateway_config.completion_store_size))
        serving = ChatServing(
            engine,
            tokenizer,
            builder,
            [served_name],
            engine_config.default_max_tokens,
            engine_config.max_n,
            end_of_turn_ids(model, tokenizer),
        )
        app = create_app(
            serving,
            api_key=gateway_config.api_key,
            max_request_bytes=gateway_config.max_request_bytes,
            captures=CaptureStore(gateway_config.max_open_captures, gateway_config.max_capture_records),
        )
        server = GatewayServer(app, gateway_config.host, gateway_config.port, gateway_config.keep_alive_s)
        server.start(gateway_config.startup_timeout_s)
        return cls(model, tokenizer, engine, server, max_context=engine.max_context)

    async def run_exclusive(self, fn: Callable[[], T]) -> T:
        """Run fn where nothing else touches the weights: on the embedded engine's thread, between token steps."""
        if not isinstance(self.engine, HFEngine):
            raise RuntimeError("training needs the embedded engine")
        return await asyncio.wrap_future(self.engine.call(fn))

    async def close(self) -> None:
        self.server.stop()
        await self.engine.close()
