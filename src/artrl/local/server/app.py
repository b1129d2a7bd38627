"""The training server's HTTP routes. `/artrl/v1/...`: the backend's calls for `artrl.RemoteBackend`
(register, step, train, train_sft, log, delete_checkpoints, export); `/v1/...`: one OpenAI-compatible gateway
in front of every model, each request handed to the gateway of the model its body names.

Every route but `/health` needs a tenant's key; a tenant reaches only its own models (another's answer 404,
as if absent). Bodies are bounded before they are read whole; errors are OpenAI-style JSON bodies."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from artrl.config import CheckpointRetention, GatewayConfig, SFTConfig, TrainConfig
from artrl.local.gateway.calls import bounded_body
from artrl.local.gateway.dialects.dialect import json_body
from artrl.local.gateway.guard import Guard, Rules, TrustedHosts
from artrl.local.gateway.in_process import openai_httpx
from artrl.local.gateway.protocol import RequestError
from artrl.local.server.hosted import HostedModels, NotFound, OverLimit
from artrl.local.server.tenants import ADMIN, Tenants, bearer
from artrl.storage import latest_step
from artrl.trajectory import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)
PROXIED = ("chat/completions", "responses", "messages")  # answered by the named model's own gateway


class Refused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": code, "code": code}}, status_code=status)


def create_server_app(hosted: HostedModels, tenants: Tenants) -> FastAPI:
    """The routes over `hosted`; at shutdown every model's engine, gateway and trainer is closed."""
    gateways = _Gateways(hosted)
    inflight = Inflight(hosted.config.max_concurrent_requests)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await gateways.close()
        await hosted.close()

    app = FastAPI(
        title="artrl training server", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    limit = hosted.config.max_request_bytes
    chat_limit = GatewayConfig().max_request_bytes
    # with keys the key decides (any Host); without, a loopback server answers only loopback names (DNS
    # rebinding); a POST must be JSON, so no web page reaches it cross-site (gateway/guard.py)
    hosts = TrustedHosts(hosted.config.host, ("*",) if tenants.keyed else ())
    app.add_middleware(Guard, rules=Rules(hosts, lambda s, m, c: _error(s, m, c), json_posts=True))

    @app.exception_handler(Refused)
    async def refused(_: Request, exc: Refused) -> JSONResponse:
        return _error(exc.status, str(exc), exc.code)

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("training server: unexpected error")
        return _error(500, f"internal error ({type(exc).__name__}); see the server's log", "internal_error")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "base_model": hosted.config.base_model}

    @app.get("/artrl/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        tenant = _tenant(request, tenants)
        seen = hosted.tenants() if tenant == ADMIN else [tenant]
        return {"data": [_entry(t, m, hosted) for t in seen for m in hosted.models_of(t)]}

    @app.post("/artrl/v1/models")
    async def register(request: Request) -> dict[str, Any]:
        tenant = _tenant(request, tenants)
        model = await _call(hosted.register(tenant, await _json(request, limit)))
        return _entry(tenant, model, hosted)

    @app.get("/artrl/v1/models/{name}/step")
    async def step(name: str, request: Request) -> dict[str, int]:
        here, model = _find(hosted, _tenant(request, tenants), name)
        return {"step": latest_step(here.directory(model))}

    @app.post("/artrl/v1/models/{name}/{call}")
    async def backend_call(name: str, call: str, request: Request) -> Response:
        tenant = _tenant(request, tenants)
        here, model = _find(hosted, tenant, name)
        body = await _json(request, limit)
        request_id = body.pop("request_id", None)
        if call == "train":
            groups = [TrajectoryGroup.model_validate(g) for g in body.get("groups", [])]
            config = TrainConfig.model_validate(body.get("config") or {})
            work = lambda: here.train(model, groups, config)  # noqa: E731
        elif call == "train_sft":
            trajectories = [Trajectory.model_validate(t) for t in body.get("trajectories", [])]
            if not trajectories:
                raise Refused(400, "train_sft() got no trajectories", "invalid_request")
            sft = SFTConfig.model_validate(body.get("config") or {})
            work = lambda: here.train_sft(model, trajectories, sft)  # noqa: E731
        elif call == "log":
            groups = [TrajectoryGroup.model_validate(g) for g in body.get("groups", [])]
            args = (groups, str(body.get("split")), body.get("metrics"), body.get("step"))
            work = lambda: here.log(model, *args)  # noqa: E731
        elif call == "delete_checkpoints":
            retention = CheckpointRetention.model_validate(body.get("retention") or {})
            work = lambda: here.delete_checkpoints(model, retention)  # noqa: E731
        elif call == "export":
            return await _export(here, model)
        else:
            raise Refused(
                404, f"no call {call!r}: train, train_sft, log, delete_checkpoints, export", "not_found"
            )
        result = await _call(hosted.once(tenant, request_id, work))
        return JSONResponse({"result": _plain(result)})

    @app.get("/v1/models")
    async def openai_models(request: Request) -> dict[str, Any]:
        tenant = _tenant(request, tenants)
        entries = []
        for model in hosted.models_of(tenant):
            response = await gateways.client(tenant, model.name).get("/v1/models")
            entries += response.json().get("data", [])
        return {"object": "list", "data": entries}

    async def proxied(request: Request) -> Response:
        tenant = _tenant(request, tenants)
        release = inflight.take(tenant)  # (429 beyond the tenant's limit; given back when the answer ends)
        try:
            return await _proxy(request, tenant, release)
        except BaseException:
            release()
            raise

    async def _proxy(request: Request, tenant: str, release) -> Response:
        raw = await bounded_body(request, chat_limit)
        try:
            name = json.loads(raw).get("model")
        except (ValueError, AttributeError, RecursionError):
            raise Refused(
                400, "the body must be a JSON object naming its `model`", "invalid_request"
            ) from None
        if not isinstance(name, str):
            raise Refused(400, "the body must name the served model in `model`", "invalid_request")
        _find(hosted, tenant, name)
        client = gateways.client(tenant, name)
        upstream = client.build_request(
            "POST", request.url.path, content=raw, headers={"content-type": "application/json"}
        )
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

    for path in PROXIED:
        app.post(f"/v1/{path}")(proxied)

    @app.post("/v1/captures")
    async def captures(request: Request) -> Response:
        _tenant(request, tenants)
        raise Refused(
            501,
            "capture blocks are not served by the training server yet: record trajectories from the choices "
            "(Trajectory(messages_and_choices=[..., choice])), as the examples do",
            "not_implemented",
        )

    return app


def _tenant(request: Request, tenants: Tenants) -> str:
    tenant = tenants.tenant(bearer({k.lower(): v for k, v in request.headers.items()}))
    if tenant is None:
        raise Refused(401, "missing or wrong key: send 'Authorization: Bearer <key>'", "invalid_api_key")
    return tenant


def _find(hosted: HostedModels, tenant: str, name: str):
    try:
        return hosted.find(tenant, name)
    except NotFound as exc:
        raise Refused(404, str(exc), "model_not_found") from None


async def _call(work):
    """A backend call's refusals as HTTP answers: bad input 400, a limit 429, an unknown model 404."""
    try:
        return await work
    except OverLimit as exc:
        raise Refused(429, str(exc), "limit_reached") from None
    except NotFound as exc:
        raise Refused(404, str(exc), "model_not_found") from None
    except ValueError as exc:  # (pydantic's ValidationError included)
        raise Refused(400, str(exc), "invalid_request") from None


def _entry(tenant: str, model, hosted: HostedModels) -> dict[str, Any]:
    here = hosted.find(tenant, model.name)[0]
    spec = model.model_dump(mode="json", include={"name", "project", "base_model", "chat_format"})
    return {**spec, "tenant": tenant, "step": latest_step(here.directory(model))}


def _plain(value: Any) -> Any:
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


async def _json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object within `limit` bytes (the gateway's readers: 413 / 400 as RequestError)."""
    return json_body(await bounded_body(request, limit) or b"{}")


async def _export(here, model) -> Response:
    """The model's current weights and tokenizer as a Hugging Face folder, sent as a .tar.gz."""
    folder = Path(tempfile.mkdtemp(prefix="artrl-export-"))
    try:
        await here.export(model, str(folder / "model"))
        archive = folder / "model.tar.gz"
        await asyncio.to_thread(_tar, folder / "model", archive)
        data = archive.read_bytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return Response(data, media_type="application/gzip")


def _tar(source: Path, archive: Path) -> None:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname=".")


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


class _Gateways:
    """An httpx client per hosted model, to its own gateway without a socket (the in-process transport)."""

    def __init__(self, hosted: HostedModels) -> None:
        self._hosted = hosted
        self._clients: dict[tuple[str, str], httpx.AsyncClient] = {}

    def client(self, tenant: str, name: str) -> httpx.AsyncClient:
        here, model = self._hosted.find(tenant, name)
        key = (tenant, model.name)
        client = self._clients.get(key)
        if client is None:
            service = here.service(model)
            http = openai_httpx()  # (the httpx the in-process transport is built on)
            client = self._clients[key] = http.AsyncClient(
                base_url=service.base_url.removesuffix("/v1"),
                transport=here.client_transport(model),
                headers={"Authorization": f"Bearer {self._hosted.gateway.api_key}"},
                timeout=http.Timeout(None, connect=30.0),  # (generation: as long as the client waits)
            )
        return client

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
