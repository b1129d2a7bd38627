"""`artrl serve RUN_DIR`: the OpenAI-compatible gateway on one saved step of a run, with the embedded engine,
until SIGINT or SIGTERM. The wiring is training's own (`LocalService.start`), without a trainer."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from typing import Any

from artrl.config import EngineConfig, GatewayConfig, LoraConfig
from artrl.local.runs.run_folder import Run, RunError

# settings of the run's EngineConfig that serving it again keeps (the engine is the embedded one)
_KEPT = (
    "max_batch_size",
    "max_prefill_tokens",
    "max_context",
    "dtype",
    "device",
    "default_max_tokens",
    "max_n",
    "load",  # (how its base was loaded: the same revision, remote code, quantization)
)


def engine_config_of(run: Run) -> EngineConfig:
    kept = {k: v for k, v in run.engine.items() if k in _KEPT}
    try:
        return EngineConfig(**kept)
    except ValueError:  # a model.json from another version: the defaults serve it as well
        return EngineConfig()


def lora_of(run: Run) -> LoraConfig | None:
    try:
        return LoraConfig(**run.lora) if run.lora is not None else None
    except (ValueError, TypeError) as exc:
        raise RunError(f"{run.directory}/model.json has a lora artrl cannot read: {exc}") from None


def serve_run(run: Run, step: int | None, gateway: GatewayConfig, say: Callable[[str], Any] = print) -> None:
    """Serve checkpoint `step` (the latest when None) until SIGINT/SIGTERM, then stop cleanly."""
    from artrl.local.service.service import LocalService

    step, checkpoint = run.checkpoint(step)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        service = LocalService.start(
            run.name,
            run.base_model,
            engine_config_of(run),
            gateway,
            lora_of(run),
            resume_from=checkpoint,
            chat_format=run.chat_format,
            trainable=False,
        )
        try:
            say(f"serving {run.project}/{run.name} step {step} ({checkpoint})")
            say(f"base URL: {service.base_url}")
            say(f"models: {', '.join(service.names.listed())}")
            say("api key: required (the one given with --api-key)" if gateway.api_key else "api key: any")
            say("stop with Ctrl-C (or SIGTERM)")
            while not stop.wait(0.5):
                pass
            say("stopping")
        finally:
            asyncio.run(service.close())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
