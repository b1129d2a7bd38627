"""`LocalBackend`: serve (and later train) models on this machine. Light to import; heavy parts load on
`register` from `artrl.local`."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

from artrl.config import EngineConfig, GatewayConfig
from artrl.model import TrainableModel
from artrl.storage import atomic_write_json, latest_step, model_dir

if TYPE_CHECKING:
    from artrl.local.service import LocalService


class LocalBackend:
    """Runs the embedded engine and the OpenAI-compatible gateway in this process.

    Files go under `path/{project}/{model}/`. Use `async with LocalBackend() as backend:` or call
    `await backend.close()`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] = ".artrl",
        *,
        engine: EngineConfig | None = None,
        gateway: GatewayConfig | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.engine_config = engine or EngineConfig()
        self.gateway_config = gateway or GatewayConfig()
        self._services: dict[tuple[str, str], LocalService] = {}

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def service(self, model: TrainableModel) -> LocalService:
        try:
            return self._services[(model.project, model.name)]
        except KeyError:
            raise RuntimeError(f"model {model.name!r} is not registered with this backend") from None

    async def register(self, model: TrainableModel) -> tuple[str, str]:
        from artrl.local.service import LocalService

        key = (model.project, model.name)
        if key in self._services:
            raise ValueError(f"model {model.name!r} of project {model.project!r} is already registered")
        directory = model_dir(self.path, model.project, model.name)
        atomic_write_json(
            directory / "model.json",
            {
                "name": model.name,
                "project": model.project,
                "base_model": model.base_model,
                "engine": self.engine_config.model_dump(),
                "gateway": self.gateway_config.model_dump(exclude={"api_key"}),
            },
        )
        service = await asyncio.to_thread(
            LocalService.start, model.name, model.base_model, self.engine_config, self.gateway_config
        )
        self._services[key] = service
        return service.base_url, self.gateway_config.api_key or "artrl"

    async def get_step(self, model: TrainableModel) -> int:
        return latest_step(model_dir(self.path, model.project, model.name))

    async def close(self) -> None:
        services, self._services = list(self._services.values()), {}
        for service in services:
            await service.close()
