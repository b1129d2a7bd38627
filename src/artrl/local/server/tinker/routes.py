"""The Tinker API's routes (`/api/v1/...`) on the training server, as the `tinker` SDK calls them: its
start-up (client config, session, heartbeats, telemetry, finish), LoRA training clients (create_model,
get_info), forward / forward_backward (protobuf) and optim_step through futures (retrieve_future), health and
capabilities. The key is the tenant's (`X-API-Key`; the SDK wants keys that start with `tml-`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from artrl.local.gateway.calls import bounded_body
from artrl.local.gateway.dialects.dialect import json_body
from artrl.local.server.hosted import OverLimit
from artrl.local.server.tinker.futures import UserError
from artrl.local.server.tinker.listings import listings_router
from artrl.local.server.tinker.models import TinkerModels
from artrl.local.server.tinker.sampling import sample
from artrl.local.server.tinker.wire import forward_backward_output, read_forward_backward

CLIENT_CONFIG = {  # what this server serves of the SDK's options (the SDK's /client/config answer)
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": False,  # (chunks in seq order: every call of a model runs in turn)
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
}


def tinker_router(
    models: TinkerModels, tenant_of: Callable[[Request], str], limit: int, timeout_s: float
) -> APIRouter:
    hosted = models.hosted
    router = APIRouter(prefix="/api/v1")
    router.include_router(listings_router(models, tenant_of))

    async def body_of(request: Request) -> dict[str, Any]:
        return json_body(await bounded_body(request, limit, timeout_s) or b"{}")

    def user_error(exc: Exception) -> JSONResponse:
        return JSONResponse({"error": str(exc), "category": "user"}, status_code=400)

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/get_server_capabilities")
    async def capabilities(request: Request) -> dict[str, Any]:
        tenant_of(request)
        model = {"model_name": hosted.config.base_model, "trainable": True, "sampleable": True}
        return {"supported_models": [model]}

    @router.post("/client/config")
    async def client_config(request: Request) -> dict[str, Any]:
        tenant_of(request)
        return CLIENT_CONFIG

    @router.post("/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)
        return {"session_id": await models.create_session(tenant), "type": "create_session"}

    @router.post("/session_heartbeat")
    async def heartbeat(request: Request) -> Response:
        tenant = tenant_of(request)
        try:
            models.check_session(tenant, str((await body_of(request)).get("session_id")))
        except UserError:
            return JSONResponse({"error": "session finished or unknown"}, status_code=410)
        return JSONResponse({"type": "session_heartbeat"})

    @router.post("/telemetry")
    async def telemetry(request: Request) -> dict[str, str]:
        tenant_of(request)
        return {"status": "accepted"}  # (not kept: the server's own history records the training)

    @router.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> Response:
        tenant = tenant_of(request)
        try:
            models.check_session(tenant, session_id)
        except UserError as exc:
            return JSONResponse({"error": str(exc), "category": "user"}, status_code=404)
        await models.finish_session(session_id)
        return JSONResponse({})

    def creating(
        tenant: str, body: dict[str, Any], create: Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
    ) -> Response:
        """A training client's creation as the session's call `model_seq_id` (a resubmit: the same call)."""
        try:
            models.check_session(tenant, str(body.get("session_id")))
        except UserError as exc:
            return user_error(exc)
        key = ("create", body.get("session_id"), body.get("model_seq_id"))
        request_id = models.futures.known(tenant, key) or models.futures.submit(
            tenant, _created(create, tenant, body), key
        )
        return JSONResponse({"request_id": request_id})

    @router.post("/create_model")
    async def create_model(request: Request) -> Response:
        return creating(tenant_of(request), await body_of(request), models.create_model)

    @router.post("/get_info")
    async def get_info(request: Request) -> Response:
        tenant = tenant_of(request)
        try:
            return JSONResponse(models.info(tenant, str((await body_of(request)).get("model_id"))))
        except UserError as exc:
            return user_error(exc)

    @router.post("/forward_backward")
    async def forward_backward(request: Request) -> Response:
        tenant = tenant_of(request)
        try:
            call = read_forward_backward(await bounded_body(request, limit, timeout_s))
            request_id = models.in_order(
                tenant,
                call.model_id,
                call.seq_id,
                lambda steps: forward_backward_output(*fb(steps, call)),
                changes_weights=False,
            )
        except (UserError, ValueError) as exc:
            return user_error(exc)
        return JSONResponse({"request_id": request_id, "model_id": call.model_id})

    @router.post("/optim_step")
    async def optim_step(request: Request) -> Response:
        tenant = tenant_of(request)
        body = await body_of(request)
        adam = dict(body.get("adam_params") or {})
        try:
            settings = {
                "learning_rate": float(adam.pop("learning_rate")),
                **{
                    k: float(adam.pop(k))
                    for k in ("beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
                    if k in adam
                },
            }
            if body.get("optimizer_params") is not None or adam:
                raise UserError(
                    f"this server's optimizer is AdamW; unknown settings {sorted(adam) or 'optimizer_params'}"
                )
            request_id = models.in_order(
                tenant,
                str(body.get("model_id")),
                int(body.get("seq_id", 0)),
                lambda steps: {"metrics": steps.optim_step(**settings)},
                then=lambda result: row_of(str(body.get("model_id")), settings, result),
            )
        except KeyError:
            return user_error(ValueError("optim_step needs adam_params.learning_rate"))
        except (UserError, ValueError, TypeError) as exc:
            return user_error(exc)
        return JSONResponse({"request_id": request_id})

    @router.post("/save_weights")
    async def save_weights(request: Request) -> Response:
        body = await body_of(request)
        return submitted(lambda: models.save(tenant_of(request), body, "weights"), body)

    @router.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> Response:
        body = await body_of(request)
        if not body.get("path"):  # (save_weights_and_get_sampling_client)
            return submitted(lambda: models.sampler_of(tenant_of(request), body), body)
        return submitted(lambda: models.save(tenant_of(request), body, "sampler_weights"), body)

    @router.post("/create_sampling_session")
    async def create_sampling_session(request: Request) -> Response:
        tenant = tenant_of(request)
        body = await body_of(request)
        try:
            sampler_id = models.create_sampler(tenant, body)
        except (UserError, ValueError, TypeError) as exc:
            return user_error(exc)
        return JSONResponse({"sampling_session_id": sampler_id, "type": "create_sampling_session"})

    @router.get("/samplers/{sampler_id}")
    async def sampler_info(sampler_id: str, request: Request) -> Response:
        try:
            sampler = models.sampler(tenant_of(request), sampler_id)
        except UserError as exc:
            return JSONResponse({"error": str(exc), "category": "user"}, status_code=404)
        return JSONResponse(
            {
                "sampler_id": sampler_id,
                "base_model": hosted.config.base_model,
                "model_path": sampler.model_path,
            }
        )

    @router.post("/asample")
    async def asample(request: Request) -> Response:
        tenant = tenant_of(request)
        body = await body_of(request)
        sampler_id = str(body.get("sampling_session_id"))
        try:
            sampler = models.sampler(tenant, sampler_id)
            n = int(body.get("num_samples", 1))
        except (UserError, ValueError, TypeError) as exc:
            return user_error(exc)
        key = ("sample", sampler_id, body.get("seq_id"))
        request_id = models.futures.known(tenant, key) or models.futures.submit(
            tenant, sample(sampler, body), key
        )
        ids = [f"{sampler_id}:{body.get('seq_id')}:{i}" for i in range(n)]
        return JSONResponse({"request_id": request_id, "sample_sequence_ids": ids})

    @router.post("/load_weights")
    async def load_weights(request: Request) -> Response:
        tenant = tenant_of(request)
        body = await body_of(request)
        if body.get("model_id") is None:  # (create_training_client_from_state[_with_optimizer])
            return creating(tenant, body, models.create_from_state)
        return submitted(lambda: models.load(tenant, body), body)

    def fb(steps: Any, call: Any) -> tuple[list[list[float]], dict[str, float]]:
        logprobs, metrics = steps.forward_backward(call.data, call.loss_fn, call.config, call.forward_only)
        if not call.forward_only:
            models.step_rows.forward_backward(call.model_id, metrics, call.data)
        return logprobs, metrics

    def row_of(model_id: str, settings: dict[str, float], result: dict[str, Any]) -> dict[str, float]:
        step, row = models.step_rows.step(model_id, settings["learning_rate"], result["metrics"])
        return {"step": step, **row}

    def submitted(submit: Callable[[], str], body: dict[str, Any]) -> Response:
        try:
            return JSONResponse({"request_id": submit(), "model_id": body.get("model_id")})
        except (UserError, ValueError, TypeError) as exc:
            return user_error(exc)

    @router.post("/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        tenant = tenant_of(request)
        return await models.futures.retrieve(tenant, str((await body_of(request)).get("request_id")))

    return router


async def _created(
    create: Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]], tenant: str, body: dict[str, Any]
) -> dict[str, Any]:
    try:
        return await create(tenant, body)
    except OverLimit as exc:
        raise UserError(str(exc)) from None
