"""The models a training server hosts: each tenant's registered in that tenant's `ModelsHere` (its own run
folders under `{path}/{tenant}/`), looked up by the name they are served under, and training calls made
once per request id however often a client resends them."""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from artrl.config import EngineConfig, GatewayConfig, ServerConfig, TrainerConfig
from artrl.local.backend.models_here import ModelsHere
from artrl.model import TrainableModel

T = TypeVar("T")
SPEC_FIELDS = ("name", "project", "base_model", "lora", "chat_format")  # what a client registers


class NotFound(LookupError):
    """No model of that name for this tenant (another tenant's model is not found either)."""


class OverLimit(RuntimeError):
    """A tenant's limit (ServerConfig) is reached."""


class HostedModels:
    def __init__(
        self, config: ServerConfig, engine: EngineConfig, trainer: TrainerConfig | None = None
    ) -> None:
        self.config, self.engine, self.trainer = config, engine, trainer or TrainerConfig()
        # each model's own gateway answers only the server (loopback, and this key)
        self.gateway = GatewayConfig(api_key=secrets.token_urlsafe(32))
        self._here: dict[str, ModelsHere] = {}
        self._models: dict[str, dict[str, TrainableModel]] = {}  # tenant -> served name -> model
        self._once: dict[str, _Once] = {}
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
        unknown = sorted(set(spec) - set(SPEC_FIELDS))
        if unknown:
            raise ValueError(
                f"unknown model fields {unknown}; a model is registered with {list(SPEC_FIELDS)}"
            )
        model = TrainableModel.model_validate(spec)
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
                here = self._here[tenant] = ModelsHere(path, self.engine, self.gateway, self.trainer)
            await here.register(model)
            models[model.name] = model
            return model

    async def once(self, tenant: str, request_id: str | None, work: Callable[[], Awaitable[T]]) -> T:
        """`work()` at most once per request id: a resend while it runs waits for the same result, a resend
        after it succeeded gets that result again (a failure is not kept: a resend tries again)."""
        if request_id is None:
            return await work()
        once = self._once.setdefault(tenant, _Once(self.config.remembered_results))
        return await once.run(request_id, work)

    async def close(self) -> None:
        for here in self._here.values():
            await here.close()


class _Once:
    def __init__(self, size: int) -> None:
        self._size = size
        self._done: OrderedDict[str, Any] = OrderedDict()
        self._running: dict[str, asyncio.Future] = {}

    async def run(self, key: str, work: Callable[[], Awaitable[T]]) -> T:
        if key in self._done:
            return self._done[key]
        running = self._running.get(key)
        if running is None:
            running = self._running[key] = asyncio.ensure_future(work())
            running.add_done_callback(lambda f: self._finished(key, f))
        # a caller that goes away (a dropped connection) leaves the work running for its resend
        return await asyncio.shield(running)

    def _finished(self, key: str, future: asyncio.Future) -> None:
        self._running.pop(key, None)
        if not future.cancelled() and future.exception() is None:
            self._done[key] = future.result()
            while len(self._done) > self._size:
                self._done.popitem(last=False)
