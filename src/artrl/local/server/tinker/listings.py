"""The Tinker REST listings of a tenant's training runs (its Tinker training clients) and their checkpoints,
as the SDK's `RestClient` reads them: `list_training_runs`, `get_training_run`, `list_checkpoints`,
`get_weights_info_by_tinker_path`, `delete_checkpoint`. A checkpoint is a PEFT folder under the model's run
folder (`tinker/weights/NAME`: adapter and optimizer; `tinker/sampler_weights/NAME`: adapter)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from artrl.local.server.shared_model import saved_lora
from artrl.local.server.tinker.futures import UserError
from artrl.local.server.tinker.models import ATTENTION, KINDS, MLP, TinkerModels

CHECKPOINT_TYPE = {"weights": "training", "sampler_weights": "sampler"}


def checkpoints(models: TinkerModels, tenant: str, model_id: str) -> list[dict[str, Any]]:
    """The model's saved checkpoints, oldest first."""
    folder = models.folder(tenant, model_id)
    found = []
    for kind in KINDS:
        for saved in (folder / kind).iterdir() if (folder / kind).is_dir() else ():
            if (saved / "adapter_model.safetensors").is_file():
                found.append(_checkpoint(model_id, kind, saved))
    return sorted(found, key=lambda c: c["time"])


def _checkpoint(model_id: str, kind: str, saved: Path) -> dict[str, Any]:
    files = [f for f in saved.iterdir() if f.is_file()]
    return {
        "checkpoint_id": f"{kind}/{saved.name}",
        "checkpoint_type": CHECKPOINT_TYPE[kind],
        "time": _time(max(f.stat().st_mtime for f in files)),
        "tinker_path": f"tinker://{model_id}/{kind}/{saved.name}",
        "size_bytes": sum(f.stat().st_size for f in files),
    }


def training_run(models: TinkerModels, tenant: str, model_id: str) -> dict[str, Any]:
    saved = checkpoints(models, tenant, model_id)
    last = {kind: [c for c in saved if c["checkpoint_type"] == kind] for kind in ("training", "sampler")}
    return {
        "training_run_id": model_id,
        "base_model": models.hosted.config.base_model,
        "model_owner": tenant,
        "is_lora": True,
        "lora_rank": models.rank(tenant, model_id),
        "last_request_time": _time(models.last_used.get(model_id, 0.0)),
        "last_checkpoint": last["training"][-1] if last["training"] else None,
        "last_sampler_checkpoint": last["sampler"][-1] if last["sampler"] else None,
    }


def weights_info(models: TinkerModels, tenant: str, path: str) -> dict[str, Any]:
    lora = saved_lora(models.checkpoint(tenant, path))
    return {
        "base_model": models.hosted.config.base_model,
        "is_lora": True,
        "lora_rank": lora.rank,
        "train_unembed": False,
        "train_mlp": any(t in lora.target_modules for t in MLP),
        "train_attn": any(t in lora.target_modules for t in ATTENTION),
    }


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat()


def listings_router(models: TinkerModels, tenant_of: Callable[[Request], str]) -> APIRouter:
    router = APIRouter()

    def answer(make: Callable[[], Any]) -> Response:
        try:
            return JSONResponse(make())
        except (UserError, ValueError) as exc:
            return JSONResponse({"error": str(exc), "category": "user"}, status_code=404)

    @router.get("/training_runs")
    async def list_training_runs(request: Request, limit: int = 20, offset: int = 0) -> Response:
        tenant = tenant_of(request)
        ids = models.model_ids(tenant)
        runs = [training_run(models, tenant, i) for i in ids[offset : offset + max(limit, 0)]]
        cursor = {"offset": offset, "limit": limit, "total_count": len(ids)}
        return JSONResponse({"training_runs": runs, "cursor": cursor})

    @router.get("/training_runs/{model_id}")
    async def get_training_run(model_id: str, request: Request) -> Response:
        tenant = tenant_of(request)
        return answer(lambda: training_run(models, tenant, model_id))

    @router.get("/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str, request: Request) -> Response:
        tenant = tenant_of(request)
        return answer(lambda: {"checkpoints": checkpoints(models, tenant, model_id)})

    @router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str, request: Request) -> Response:
        tenant = tenant_of(request)

        def delete() -> dict[str, Any]:
            folder = models.checkpoint(tenant, f"tinker://{model_id}/{checkpoint_id}")
            shutil.rmtree(folder)
            return {}

        return answer(delete)

    @router.post("/weights_info")
    async def get_weights_info(request: Request) -> Response:
        tenant = tenant_of(request)
        path = str((await request.json()).get("tinker_path"))
        return answer(lambda: weights_info(models, tenant, path))

    return router
