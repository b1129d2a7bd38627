"""`artrl serve TARGET`: the OpenAI-compatible gateway, until SIGINT or SIGTERM, on one saved step of a run
(a run folder), or on a model as it is (a Hugging Face model folder or hub id), with the embedded engine or
vLLM. The wiring is training's own (`LocalService.start`), without a trainer."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from artrl.config import EngineConfig, GatewayConfig, LoraConfig
from artrl.local.backend.model_record import without_redacted
from artrl.local.runs.run_folder import Run, RunError

log = logging.getLogger(__name__)

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


def engine_config_of(run: Run, kind: str = "hf") -> EngineConfig:
    """The run's own engine settings (what the served tokens depend on), on engine `kind`."""
    kept = {k: v for k, v in run.engine.items() if k in _KEPT}
    if kind == "vllm" and isinstance(run.engine.get("vllm"), dict):
        kept["vllm"] = without_redacted(run.engine["vllm"])
    try:
        return EngineConfig(kind=kind, **kept)
    except ValueError as exc:  # a model.json from another version: the defaults serve it as well
        log.warning("the run's engine settings are not valid here (%s): serving with the defaults", exc)
        return EngineConfig(kind=kind)


def lora_of(run: Run) -> LoraConfig | None:
    try:
        return LoraConfig(**run.lora) if run.lora is not None else None
    except (ValueError, TypeError) as exc:
        raise RunError(f"{run.directory}/model.json has a lora artrl cannot read: {exc}") from None


def serve_run(
    run: Run, step: int | None, gateway: GatewayConfig, say: Callable[[str], Any] = print, engine: str = "hf"
) -> None:
    """Serve checkpoint `step` (the latest when None) until SIGINT/SIGTERM, then stop cleanly."""
    step, checkpoint = run.checkpoint(step)
    start = dict(
        served_name=run.name,
        base_model=run.base_model,
        engine_config=engine_config_of(run, engine),
        gateway_config=gateway,
        lora=lora_of(run),
        resume_from=checkpoint,
        chat_format=run.chat_format,
        log_dir=run.directory,  # (vLLM's log beside the run's, as in training)
    )
    _serve_until_stopped(start, f"{run.project}/{run.name} step {step} ({checkpoint}; {engine} engine)", say)


def serve_model(
    model: str,
    name: str | None,
    engine_config: EngineConfig,
    gateway: GatewayConfig,
    say: Callable[[str], Any] = print,
) -> None:
    """Serve a model as it is (a Hugging Face model folder or hub id, loaded as `engine_config.load` says)
    under `name` (default: the folder's or repo's last part) until SIGINT/SIGTERM."""
    name = name or Path(model.rstrip("/")).name
    start = dict(
        served_name=name, base_model=model, engine_config=engine_config, gateway_config=gateway, lora=None
    )
    _serve_until_stopped(start, f"{model} as {name} ({engine_config.kind} engine)", say)


def _serve_until_stopped(start: dict[str, Any], what: str, say: Callable[[str], Any]) -> None:
    from artrl.local.service.service import LocalService

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        say(f"loading {what}")  # (a big model, or vLLM's start, takes minutes)
        service = LocalService.start(**start, trainable=False)
        gateway: GatewayConfig = start["gateway_config"]
        try:
            say(f"serving {what}")
            say(f"base URL: {service.base_url}")
            say(f"models: {', '.join(service.names.listed())}")
            say(
                "api key: required (the one in --api-key-file or $ARTRL_API_KEY)"
                if gateway.api_key
                else "api key: any"
            )
            say("stop with Ctrl-C (or SIGTERM)")
            while not stop.wait(0.5):
                pass
            say("stopping")
        finally:
            asyncio.run(service.close())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
