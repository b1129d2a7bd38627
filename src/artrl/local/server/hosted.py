"""The models a training server hosts: each tenant's registered in that tenant's `ModelsHere` (its own run
folders under `{path}/{tenant}/`), looked up by the name they are served under, and training calls made
once per request id however often a client resends them — across a restart of the server too: a finished
call's answer is on disk (`{path}/{tenant}/.requests/`) before it is sent."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from artrl.config import EngineConfig, GatewayConfig, ServerConfig, TrainerConfig
from artrl.local.backend.models_here import ModelsHere
from artrl.local.server.shared_model import SharedModel
from artrl.local.server.shared_vllm import SharedVLLM
from artrl.model import TrainableModel
from artrl.storage import atomic_write_json

# what a client registers, the model's identity (and `config`: its own settings, recorded, not compared)
SPEC_FIELDS = ("name", "project", "base_model", "lora", "chat_format")


class NotFound(LookupError):
    """No model of that name for this tenant (another tenant's model is not found either)."""


class OverLimit(RuntimeError):
    """A tenant's limit (ServerConfig) is reached."""


class HostedModels:
    def __init__(
        self, config: ServerConfig, engine: EngineConfig, trainer: TrainerConfig | None = None
    ) -> None:
        # every model generates through its adapter (a merged copy of the adapted layers, the CPU's default,
        # would be a near base copy per model)
        if engine.merge_lora == "auto":
            engine = engine.model_copy(update={"merge_lora": "never"})
        self.config, self.engine, self.trainer = config, engine, trainer or TrainerConfig()
        # the base weights, once for every tenant's models: on the embedded engine one model holding every
        # adapter, one engine batching them all; next to vLLM, one vLLM server with every model's adapters
        # (and trainers over base tensors loaded once)
        self.shared = SharedModel(config.base_model, engine) if engine.kind == "hf" else None
        self.shared_vllm = SharedVLLM(config.base_model, engine, config.path) if self.shared is None else None
        # each model's own gateway answers only the server (loopback, and this key)
        self.gateway = GatewayConfig(api_key=secrets.token_urlsafe(32))
        self._here: dict[str, ModelsHere] = {}
        self._models: dict[str, dict[str, TrainableModel]] = {}  # tenant -> served name -> model
        self._once: dict[str, _Once] = {}
        self._queued: dict[str, int] = {}  # tenant -> training calls waiting or running
        self._registering = asyncio.Lock()

    def models_of(self, tenant: str) -> list[TrainableModel]:
        return list(self._models.get(tenant, {}).values())

    def tenants(self) -> list[str]:
        return sorted(self._models)

    def find(self, tenant: str, name: str) -> tuple[ModelsHere, TrainableModel]:
        """The tenant's model served as `name` (or `name@step`)."""
        model = self._models.get(tenant, {}).get(name.partition("@")[0])
        if model is None:
            raise NotFound(f"no model {name!r} is registered by this tenant (register it first)")
        return self._here[tenant], model

    async def register(self, tenant: str, spec: dict[str, Any]) -> TrainableModel:
        """Serve the tenant's model (its latest checkpoint, if any). Registering the same model again (a
        client that restarted) returns the one already served; another model under its name is refused."""
        unknown = sorted(set(spec) - {*SPEC_FIELDS, "config"})
        if unknown:
            raise ValueError(
                f"unknown model fields {unknown}; a model is registered with {list(SPEC_FIELDS)} (and its "
                "own settings as `config`)"
            )
        model = TrainableModel.model_validate(spec)
        if model.lora is None:
            raise ValueError(
                "the training server trains LoRA adapters on its one copy of the base weights; full "
                "fine-tuning (lora=None) changes those weights: train it with a LocalBackend"
            )
        if model.base_model != self.config.base_model:
            raise ValueError(
                f"this server trains models on {self.config.base_model!r}; model {model.name!r} has "
                f"base_model={model.base_model!r} (use that server's base, or another server)"
            )
        async with self._registering:
            models = self._models.setdefault(tenant, {})
            served = models.get(model.name)
            if served is not None:
                if served.model_dump(include=set(SPEC_FIELDS)) != model.model_dump(include=set(SPEC_FIELDS)):
                    raise ValueError(
                        f"this tenant already serves a different model named {model.name!r} (project "
                        f"{served.project!r}): model names are the names models are served under; pick another"
                    )
                return served
            if len(models) >= self.config.max_models_per_tenant:
                raise OverLimit(
                    f"this tenant has {len(models)} models, the most a tenant may register "
                    f"(ServerConfig.max_models_per_tenant); ask the server's operator for more"
                )
            here = self._here.get(tenant)
            if here is None:
                path = f"{self.config.path}/{tenant}"
                shared = self.shared or self.shared_vllm
                assert shared is not None
                start = shared.start
                here = ModelsHere(path, self.engine, self.gateway, self.trainer, start)
                self._here[tenant] = here
            await here.register(model)
            models[model.name] = model
            return model

    async def unregister(self, tenant: str, name: str) -> None:
        """Stop serving the tenant's model `name` (its run folder stays; registering it again resumes it)."""
        async with self._registering:
            model = self._models.get(tenant, {}).pop(name, None)
            if model is not None:
                await self._here[tenant].unregister(model)

    async def once(self, tenant: str, request_id: str | None, work: Callable[[], Awaitable[Any]]) -> Any:
        """`work()` at most once per request id: a resend while it runs waits for the same result, a resend
        after it succeeded gets that result again, after a restart too (a failure is not kept: a resend
        tries again). At most `max_queued_calls` of a tenant's calls wait or run at once."""
        if request_id is not None and not _REQUEST_ID.fullmatch(request_id):
            raise ValueError("request_id must be 8-64 letters, digits, '-' or '_'")
        queued = self._queued.get(tenant, 0)
        if queued >= self.config.max_queued_calls:
            raise OverLimit(
                f"this tenant has {queued} training calls waiting or running (ServerConfig.max_queued_calls); "
                "wait for one to finish"
            )
        self._queued[tenant] = queued + 1
        try:
            if request_id is None:
                return await work()
            folder = Path(self.config.path) / tenant / ".requests"
            once = self._once.setdefault(tenant, _Once(folder, self.config.remembered_results))
            return await once.run(request_id, work)
        finally:
            self._queued[tenant] -= 1

    async def close(self) -> None:
        try:
            for here in self._here.values():
                await here.close()
        finally:
            if self.shared is not None:
                await self.shared.close()
            if self.shared_vllm is not None:
                await asyncio.to_thread(self.shared_vllm.close)


_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")


class _Once:
    """Calls by request id: running ones in memory, finished ones' answers (JSON) in `folder`, the newest
    `size` of them kept."""

    def __init__(self, folder: Path, size: int) -> None:
        self._folder, self._size = folder, size
        self._running: dict[str, asyncio.Future] = {}

    async def run(self, key: str, work: Callable[[], Awaitable[Any]]) -> Any:
        done = self._folder / f"{key}.json"
        if done.exists():
            return json.loads(done.read_text())["result"]
        running = self._running.get(key)
        if running is None:
            running = self._running[key] = asyncio.ensure_future(self._run(key, work))
        # a caller that goes away (a dropped connection) leaves the work running for its resend
        return await asyncio.shield(running)

    async def _run(self, key: str, work: Callable[[], Awaitable[Any]]) -> Any:
        try:
            result = await work()
            plain = result.model_dump(mode="json") if hasattr(result, "model_dump") else result
            await asyncio.to_thread(self._keep, key, plain)
            return plain
        finally:
            self._running.pop(key, None)

    def _keep(self, key: str, result: Any) -> None:
        self._folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self._folder / f"{key}.json", {"result": result})
        kept = sorted(self._folder.glob("*.json"), key=lambda f: f.stat().st_mtime)
        for old in kept[: max(0, len(kept) - self._size)]:
            old.unlink(missing_ok=True)
