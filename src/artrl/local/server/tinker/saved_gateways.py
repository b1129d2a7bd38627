"""Saved sampler weights on the OpenAI-compatible routes by name: a chat completion (or Responses, Messages
request) whose `model` is a `tinker://MODEL_ID/sampler_weights/NAME` path of the caller's is answered from
those weights, frozen, by a gateway of their own over the shared engine (the adapter loaded as Tinker's
`create_sampling_client(model_path=...)` loads it). At most `ServerConfig.sampler_adapters` such gateways
stay open: the one used longest ago closes first (its next request opens it again)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from artrl.local.engine.contract import SamplingParams, SequenceStream
from artrl.local.server.tinker.futures import UserError
from artrl.local.server.tinker.models import TinkerModels
from artrl.local.service.service import LocalService
from artrl.sdk_http import openai_httpx

T = TypeVar("T")
PREFIX = "tinker://"


class SavedAdapterEngine:
    """The `Engine` a saved adapter's gateway sees: generation from that adapter on the shared engine (loaded
    again, blocking, if the shared model unloaded it since); no training."""

    def __init__(self, shared: Any, folder: Path, keep: int) -> None:
        self.shared, self.folder, self.keep = shared, folder, keep

    @property
    def max_context(self) -> int:
        return self.shared.engine.max_context

    def generate(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[SequenceStream]:
        adapter = self.shared.saved_adapter(self.folder, self.keep)  # (loaded: a lookup)
        return self.shared.engine.generate(prompt_ids, params, n, adapter=adapter)

    async def run_exclusive(self, fn: Callable[[], T], *, changes_weights: bool = True) -> T:
        return await asyncio.wrap_future(self.shared.engine.call(fn, changes_weights=False))

    def training(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()  # type: ignore[return-value]

    async def publish(self, step: int, checkpoint: str, adapter: bool) -> None:
        raise RuntimeError("saved weights are not trained")

    async def close(self) -> None:
        """Nothing: the shared model keeps or unloads the adapter (`ServerConfig.sampler_adapters`)."""


class SavedGateways:
    def __init__(self, models: TinkerModels) -> None:
        self.models = models
        self._open: OrderedDict[tuple[str, str], tuple[LocalService, httpx.AsyncClient]] = OrderedDict()
        self._lock = asyncio.Lock()

    async def client(self, tenant: str, path: str) -> httpx.AsyncClient:
        """A client of the gateway answering for the tenant's saved weights `path` (UserError: no such)."""
        folder = self.models.checkpoint(tenant, path)
        shared = self.models.hosted.shared
        if shared is None:
            raise UserError("saved weights are served on `--engine hf` only")
        keep = self.models.hosted.config.sampler_adapters
        async with self._lock:
            key = (tenant, path)
            if key in self._open:
                self._open.move_to_end(key)
                return self._open[key][1]
            await asyncio.to_thread(shared.saved_adapter, folder, keep)  # (loaded off the event loop)
            hosted = self.models.hosted
            service = await asyncio.to_thread(
                LocalService.serve,
                path,
                shared.model,
                copy.deepcopy(shared.tokenizer),
                SavedAdapterEngine(shared, folder, keep),
                hosted.engine,
                hosted.gateway,
            )
            http = openai_httpx()
            client = http.AsyncClient(
                base_url=service.base_url.removesuffix("/v1"),
                transport=service.server.transport(False),
                headers={"Authorization": f"Bearer {hosted.gateway.api_key}"},
                timeout=http.Timeout(None, connect=30.0),
            )
            self._open[key] = (service, client)
            while len(self._open) > keep:
                _, (old, old_client) = self._open.popitem(last=False)
                await old_client.aclose()
                await old.close()
            return client

    async def close(self) -> None:
        for service, client in self._open.values():
            await client.aclose()
            await service.close()
        self._open.clear()
