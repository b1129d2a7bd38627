"""The training server's HTTP routes. `/artrl/v1/...`: the backend's calls for `artrl.RemoteBackend`
(register, step, train, train_sft, log, delete_checkpoints, export); `/v1/...`: one OpenAI-compatible gateway
in front of every model, each request handed to the gateway of the model its body names.

Every route but `/health` needs a tenant's key; a tenant reaches only its own models (another's answer 404,
as if absent). Bodies are bounded before they are read whole; errors are OpenAI-style JSON bodies."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from artrl.capturing.block import CAPTURE_HEADER
from artrl.config import CheckpointRetention, SFTConfig, TrainConfig
from artrl.local.gateway.calls import bounded_body
from artrl.local.gateway.dialects.dialect import json_body
from artrl.local.gateway.guard import Guard, Rules, TrustedHosts
from artrl.local.gateway.protocol import RequestError
from artrl.local.server.captures import CaptureNotFound, ServerCaptures
from artrl.local.server.forwarding import Forwarder, Gateways, Inflight, found
from artrl.local.server.hosted import HostedModels, NotFound, OverLimit
from artrl.local.server.progress_lines import progress_lines, started
from artrl.local.server.refusals import Refused, error_response
from artrl.local.server.tenants import ADMIN, Tenants, bearer
from artrl.local.server.tinker.models import TinkerModels
from artrl.local.server.tinker.routes import tinker_router
from artrl.local.server.tinker.saved_gateways import SavedGateways
from artrl.storage import latest_step
from artrl.trajectory import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)
PROXIED = ("chat/completions", "responses", "messages")  # answered by the named model's own gateway


def create_server_app(hosted: HostedModels, tenants: Tenants) -> FastAPI:
    """The routes over `hosted`; at shutdown every model's engine, gateway and trainer is closed."""
    gateways = Gateways(hosted)
    captures = ServerCaptures(hosted.config.max_open_captures)
    tinker = TinkerModels(hosted)
    saved = SavedGateways(tinker)
    inflight = Inflight(hosted.config.max_concurrent_requests)
    forwarder = Forwarder(hosted, gateways, inflight, captures, saved)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await gateways.close()
        await saved.close()
        await hosted.close()

    app = FastAPI(
        title="artrl training server", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    limit, timeout = hosted.config.max_request_bytes, hosted.config.body_read_timeout_s
    # with keys the key decides (any Host); without, a loopback server answers only loopback names (DNS
    # rebinding); a POST must be JSON, so no web page reaches it cross-site (gateway/guard.py)
    hosts = TrustedHosts(hosted.config.host, ("*",) if tenants.keyed else ())
    app.add_middleware(Guard, rules=Rules(hosts, lambda s, m, c: error_response(s, m, c), json_posts=True))

    @app.exception_handler(Refused)
    async def refused(_: Request, exc: Refused) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.code)

    @app.exception_handler(CaptureNotFound)
    async def capture_not_found(_: Request, exc: CaptureNotFound) -> JSONResponse:
        return error_response(404, str(exc), "capture_not_found")

    @app.exception_handler(RequestError)
    async def requesterror_response(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("training server: unexpected error")
        return error_response(
            500, f"internal error ({type(exc).__name__}); see the server's log", "internal_error"
        )

    app.include_router(tinker_router(tinker, lambda request: _tenant(request, tenants), limit, timeout))

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
        model = await _call(hosted.register(tenant, await _json(request, limit, timeout)))
        return _entry(tenant, model, hosted)

    @app.get("/artrl/v1/models/{name}/step")
    async def step(name: str, request: Request) -> dict[str, int]:
        here, model = found(hosted, _tenant(request, tenants), name)
        return {"step": latest_step(here.directory(model))}

    @app.post("/artrl/v1/models/{name}/{call}")
    async def backend_call(name: str, call: str, request: Request) -> Response:
        tenant = _tenant(request, tenants)
        here, model = found(hosted, tenant, name)
        body = await _json(request, limit, timeout)
        request_id = body.pop("request_id", None)
        streamed = body.pop("stream", False) is True and call in ("train", "train_sft")
        try:
            work = _work(here, model, call, body)
        except (ValueError, TypeError) as exc:  # (pydantic's ValidationError: trajectories that do not parse)
            raise Refused(400, f"{call}: {exc}", "invalid_request") from None
        if work is None:
            return await _export(here, model)
        answer = _call(hosted.once(tenant, request_id, work))
        if streamed:
            lines = progress_lines(started(answer), here.service(model).progress)
            return StreamingResponse(lines, media_type="application/x-ndjson")
        return JSONResponse({"result": _plain(await answer)})

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
        return await forwarder.forward(request, tenant, request.url.path, request.headers.get(CAPTURE_HEADER))

    async def captured(capture_id: str, request: Request) -> Response:
        tenant = _tenant(request, tenants)
        path = request.url.path.removeprefix(f"/capture/{capture_id}")
        return await forwarder.forward(request, tenant, path, capture_id)

    for path in PROXIED:
        app.post(f"/v1/{path}")(proxied)
        app.post(f"/capture/{{capture_id}}/v1/{path}", name=f"capture_{path}")(captured)

    @app.post("/v1/captures")
    async def open_capture(request: Request) -> dict[str, Any]:
        return {"id": captures.open(_tenant(request, tenants)), "object": "capture"}

    @app.delete("/v1/captures/{capture_id}")
    async def close_capture(capture_id: str, request: Request) -> dict[str, Any]:
        records = await forwarder.close_capture(_tenant(request, tenants), capture_id)
        return {"id": capture_id, "object": "capture", "records": records}

    @app.get("/capture/{capture_id}/v1/models")
    async def capture_models(capture_id: str, request: Request) -> dict[str, Any]:
        captures.check(_tenant(request, tenants), capture_id)
        return await openai_models(request)

    return app


def _tenant(request: Request, tenants: Tenants) -> str:
    tenant = tenants.tenant(bearer({k.lower(): v for k, v in request.headers.items()}))
    if tenant is None:
        raise Refused(401, "missing or wrong key: send 'Authorization: Bearer <key>'", "invalid_api_key")
    return tenant


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


def _work(here, model, call: str, body: dict[str, Any]):
    """The backend call `call` of the model with the body's arguments, to run (None: an export)."""
    if call == "train":
        groups = [TrajectoryGroup.model_validate(g) for g in body.get("groups", [])]
        config = TrainConfig.model_validate(body.get("config") or {})
        return lambda: here.train(model, groups, config)
    elif call == "train_sft":
        trajectories = [Trajectory.model_validate(t) for t in body.get("trajectories", [])]
        if not trajectories:
            raise Refused(400, "train_sft() got no trajectories", "invalid_request")
        sft = SFTConfig.model_validate(body.get("config") or {})
        return lambda: here.train_sft(model, trajectories, sft)
    elif call == "log":
        groups = [TrajectoryGroup.model_validate(g) for g in body.get("groups", [])]
        args = (groups, str(body.get("split")), body.get("metrics"), body.get("step"))
        return lambda: here.log(model, *args)
    elif call == "delete_checkpoints":
        retention = CheckpointRetention.model_validate(body.get("retention") or {})
        return lambda: here.delete_checkpoints(model, retention)
    elif call == "export":
        return None
    else:
        raise Refused(
            404, f"no call {call!r}: train, train_sft, log, delete_checkpoints, export", "not_found"
        )


def _entry(tenant: str, model, hosted: HostedModels) -> dict[str, Any]:
    here = hosted.find(tenant, model.name)[0]
    spec = model.model_dump(mode="json", include={"name", "project", "base_model", "chat_format"})
    return {**spec, "tenant": tenant, "step": latest_step(here.directory(model))}


def _plain(value: Any) -> Any:
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


async def _json(request: Request, limit: int, timeout_s: float) -> dict[str, Any]:
    """The body as a JSON object within `limit` bytes (the gateway's readers: 413 / 400 as RequestError)."""
    return json_body(await bounded_body(request, limit, timeout_s) or b"{}")


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
