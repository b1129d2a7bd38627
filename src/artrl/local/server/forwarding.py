"""Generation requests through the training server: each answered by the gateway of the model its body
names (chat completions, Responses, Messages), over the in-process transport, streamed back as it comes; a
tenant's requests in flight bounded; the requests of a capture block recorded on that model's gateway
(captures.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from artrl.capturing.block import CAPTURE_HEADER
from artrl.config import GatewayConfig
from artrl.local.gateway.calls import bounded_body
from artrl.local.server.captures import ServerCaptures
from artrl.local.server.hosted import HostedModels, NotFound
from artrl.local.server.refusals import Refused
from artrl.sdk_http import openai_httpx


class Forwarder:
    def __init__(
        self,
        hosted: HostedModels,
        gateways: Gateways,
        inflight: Inflight,
        captures: ServerCaptures,
        saved: Any = None,
    ) -> None:
        self.hosted, self.gateways, self.inflight, self.captures = hosted, gateways, inflight, captures
        self.saved = saved  # tinker/saved_gateways.SavedGateways: `model` names of saved Tinker weights
        self.chat_limit = GatewayConfig().max_request_bytes

    async def forward(self, request: Request, tenant: str, path: str, capture: str | None) -> Response:
        """The named model's gateway's answer to the request (sent on to its `path`), recorded in the
        tenant's capture `capture` when given."""
        release = self.inflight.take(
            tenant
        )  # (429 beyond the tenant's limit; given back when the answer ends)
        try:
            return await self._forward(request, tenant, path, capture, release)
        except BaseException:
            release()
            raise

    async def _forward(
        self, request: Request, tenant: str, path: str, capture: str | None, release
    ) -> Response:
        raw = await bounded_body(request, self.chat_limit, self.hosted.config.body_read_timeout_s)
        try:
            name = json.loads(raw).get("model")
        except (ValueError, AttributeError, RecursionError):
            raise Refused(
                400, "the body must be a JSON object naming its `model`", "invalid_request"
            ) from None
        if not isinstance(name, str):
            raise Refused(400, "the body must name the served model in `model`", "invalid_request")
        if name.startswith("tinker://") and self.saved is not None:
            client = await self._saved(tenant, name, capture)
        else:
            found(self.hosted, tenant, name)
            client = self.gateways.client(tenant, name)
        headers = {"content-type": "application/json"}
        if capture is not None:
            headers[CAPTURE_HEADER] = await self.captures.gateway_id(
                tenant, capture, self.hosted.find(tenant, name)[1].name, lambda: self._open_there(client)
            )
        upstream = client.build_request("POST", path, content=raw, headers=headers)
        response = await client.send(upstream, stream=True)

        async def finished() -> None:
            release()
            await response.aclose()

        async def body():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:  # (the client went away mid-answer, too: the slot is given back)
                release()

        return StreamingResponse(
            body(),
            status_code=response.status_code,
            media_type=response.headers.get("content-type"),
            background=BackgroundTask(finished),
        )

    async def close_capture(self, tenant: str, key: str) -> list[dict[str, Any]]:
        async def close_there(model: str, gateway_key: str) -> list[dict[str, Any]]:
            try:
                client = self.gateways.client(tenant, model)
            except NotFound:  # (its model is gone: its records with it)
                return []
            response = await client.delete(f"/v1/captures/{gateway_key}")
            _raise_for(response, "close the capture on the model's gateway")
            return response.json()["records"]

        return await self.captures.close(tenant, key, close_there)

    async def _saved(self, tenant: str, path: str, capture: str | None) -> httpx.AsyncClient:
        if capture is not None:
            raise Refused(
                400,
                "captures record a hosted model's calls; saved weights (tinker://...) are not captured",
                "invalid_request",
            )
        try:
            return await self.saved.client(tenant, path)
        except ValueError as exc:  # (tinker's UserError: not a checkpoint of this key)
            raise Refused(404, str(exc), "model_not_found") from None

    @staticmethod
    async def _open_there(client: httpx.AsyncClient) -> str:
        response = await client.post("/v1/captures")
        _raise_for(response, "open a capture on the model's gateway")
        return response.json()["id"]


def found(hosted: HostedModels, tenant: str, name: str):
    """The tenant's model served as `name` (its ModelsHere and model); 404 when it has none."""
    try:
        return hosted.find(tenant, name)
    except NotFound as exc:
        raise Refused(404, str(exc), "model_not_found") from None


def _raise_for(response: httpx.Response, action: str) -> None:
    if response.status_code >= 400:
        raise Refused(response.status_code, f"could not {action}: {response.text[:500]}", "capture_failed")


class Inflight:
    """Each tenant's generation requests in flight, at most `limit` at once."""

    def __init__(self, limit: int) -> None:
        self.limit, self.count = limit, {}

    def take(self, tenant: str):
        """A slot (429 when none is left): the function that gives it back, once, however often called."""
        if self.count.get(tenant, 0) >= self.limit:
            raise Refused(
                429,
                f"this tenant has {self.limit} requests in flight (ServerConfig.max_concurrent_requests); "
                "retry shortly",
                "too_many_requests",
            )
        self.count[tenant] = self.count.get(tenant, 0) + 1
        given = False

        def release() -> None:
            nonlocal given
            if not given:
                given = True
                self.count[tenant] -= 1

        return release


class Gateways:
    """An httpx client per hosted model, to its own gateway without a socket (the in-process transport)."""

    def __init__(self, hosted: HostedModels) -> None:
        self._hosted = hosted
        # (tenant, name) -> the service it was made for, and the client (a model registered again: anew)
        self._clients: dict[tuple[str, str], tuple[object, httpx.AsyncClient]] = {}

    def client(self, tenant: str, name: str) -> httpx.AsyncClient:
        here, model = self._hosted.find(tenant, name)
        key = (tenant, model.name)
        service = here.service(model)
        cached = self._clients.get(key)
        if cached is not None and cached[0] is service:
            return cached[1]
        http = openai_httpx()  # (the httpx the in-process transport is built on)
        client = http.AsyncClient(
            base_url=service.base_url.removesuffix("/v1"),
            transport=here.client_transport(model),
            headers={"Authorization": f"Bearer {self._hosted.gateway.api_key}"},
            timeout=http.Timeout(None, connect=30.0),  # (generation: as long as the client waits)
        )
        self._clients[key] = (service, client)
        return client

    async def close(self) -> None:
        for _, client in self._clients.values():
            await client.aclose()
