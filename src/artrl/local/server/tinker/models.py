"""Tinker sessions and training clients of the server's tenants. A training client is one of the server's
hosted models (project `tinker`): its own LoRA adapter on the shared model, trained by `TinkerSteps` on the
engine's thread with its adapter active; its calls run in the order the SDK numbers them (`seq_id`: each
waits for the one before), and a resubmitted call is the same call."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from artrl.local.server.hosted import HostedModels
from artrl.local.server.shared_model import saved_lora
from artrl.local.server.tinker.futures import Futures, UserError
from artrl.local.server.tinker.sampling import Sampler, frozen_sampler, live_sampler
from artrl.local.server.tinker.sessions import Sessions
from artrl.local.server.tinker.step_rows import SPLIT, StepRows
from artrl.local.train.adapters import load_adapter, save_weights
from artrl.local.train.tinker.steps import TinkerSteps
from artrl.storage import model_dir

PROJECT = "tinker"  # the hosted models' project
KINDS = ("weights", "sampler_weights")  # a training state (adapter + optimizer), an adapter for sampling
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class TinkerModels:
    def __init__(self, hosted: HostedModels) -> None:
        self.hosted = hosted
        self.futures = Futures()
        self.sessions = Sessions(hosted.config.tinker_session_timeout_s)
        self._unloaded: set[str] = set()  # model ids of finished sessions (their folders stay)
        self._models: dict[str, tuple[str, str, int]] = {}  # model id -> tenant, hosted name, rank
        self._last: dict[str, asyncio.Future] = {}  # model id -> its latest call (the next one waits for it)
        self.samplers: dict[str, Sampler] = {}  # sampling session id -> what samples
        self.last_used: dict[str, float] = {}  # model id -> when its latest call came (time.time())
        self.step_rows = StepRows()

    async def create_session(self, tenant: str) -> str:
        for silent in self.sessions.silent():  # (sessions of clients that stopped without closing)
            await self.finish_session(silent)
        return self.sessions.create(tenant)

    def check_session(self, tenant: str, session: str) -> None:
        self.sessions.check(tenant, session)

    async def finish_session(self, session: str) -> None:
        """End `session`: its sampling clients dropped, its training clients unloaded once their calls
        ended (their run folders stay)."""
        self.sessions.end(session)
        for sampler_id in [s for s in self.samplers if s.startswith(f"{session}:")]:
            del self.samplers[sampler_id]
        for model_id in [m for m in self._models if m.startswith(f"{session}:") and m not in self._unloaded]:
            self._unloaded.add(model_id)
            last = self._last.pop(model_id, None)
            if last is not None:
                await asyncio.wait([last])
            tenant, name, _ = self._models[model_id]
            await self.hosted.unregister(tenant, name)

    async def create_model(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        session = str(body.get("session_id"))
        self.check_session(tenant, session)
        model_id = f"{session}:train:{int(body.get('model_seq_id', 0))}"
        base = body.get("base_model")
        if base != self.hosted.config.base_model:
            raise UserError(
                f"this server trains LoRA adapters of {self.hosted.config.base_model!r} (asked: {base!r})"
            )
        lora = body.get("lora_config") or {}
        rank = int(lora.get("rank", 32))
        targets = (
            *(ATTENTION if lora.get("train_attn", True) else ()),
            *(MLP if lora.get("train_mlp", True) else ()),
        )
        if not targets:
            raise UserError("lora_config trains neither attention nor MLP layers: nothing to train")
        # (train_unembed: the output head stays the base's here, its adapter would slow every tenant's rows)
        await self._hosted_model(
            tenant, model_id, {"rank": rank, "alpha": float(rank), "target_modules": targets}
        )
        return {"model_id": model_id, "type": "create_model"}

    async def create_from_state(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        """`create_training_client_from_state[_with_optimizer]`: a new training client with the LoRA settings
        of the saved state `path` (one of this tenant's), loaded with its weights (and optimizer, if asked)."""
        session = str(body.get("session_id"))
        self.check_session(tenant, session)
        model_id = f"{session}:train:{int(body.get('model_seq_id', 0))}"
        base = body.get("base_model")
        if base not in (None, self.hosted.config.base_model):
            raise UserError(
                f"this server trains LoRA adapters of {self.hosted.config.base_model!r} (asked: {base!r})"
            )
        path = str(body.get("path"))
        folder = self.checkpoint(tenant, path)
        try:
            lora = saved_lora(folder)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        if model_id not in self._models:  # (a resubmit: created already)
            settings = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": lora.target_modules}
            await self._hosted_model(tenant, model_id, settings)
        request_id = self.load(
            tenant, {"model_id": model_id, "path": path, "optimizer": body.get("optimizer")}
        )
        return await self.futures.task(request_id)

    async def _hosted_model(self, tenant: str, model_id: str, lora: dict[str, Any]) -> None:
        session, seq = model_id.split(":train:")
        spec = {
            "name": f"tinker-{session.removeprefix('sess-')}-{seq}",
            "project": PROJECT,
            "base_model": self.hosted.config.base_model,
            "lora": {**lora, "target_modules": list(lora["target_modules"])},
        }
        model = await self.hosted.register(tenant, spec)
        self._models[model_id] = (tenant, model.name, int(lora["rank"]))

    def info(self, tenant: str, model_id: str) -> dict[str, Any]:
        _, _, rank = self._find(tenant, model_id)
        base = self.hosted.config.base_model
        return {
            "model_id": model_id,
            "model_data": {"arch": "artrl", "model_name": base, "tokenizer_id": base},
            "is_lora": True,
            "lora_rank": rank,
            "optimizer_config": {"type": "adamw"},
            "type": "get_info",
        }

    def in_order(
        self,
        tenant: str,
        model_id: str,
        seq_id: int,
        work: Callable[[TinkerSteps], Any],
        changes_weights: bool = True,
        then: Callable[[Any], dict[str, float] | None] | None = None,
    ) -> str:
        """Submit `work(steps)` as the model's call `seq_id` (after its calls before): its request id (the
        first submit's, for a resubmit). `then(result)`: a history row's metrics for the step it made, if
        any (logged under the row's step, split `tinker`)."""
        _, name, _ = self._find(tenant, model_id)
        if model_id in self._unloaded:
            raise UserError(
                f"training client {model_id!r} ended with its session: create a training client from one "
                "of its saved states (create_training_client_from_state)"
            )
        self.last_used[model_id] = time.time()
        key = ("model", model_id, seq_id)
        known = self.futures.known(tenant, key)
        if known is not None:
            return known
        here, model = self.hosted.find(tenant, name)
        service = here.service(model)
        before = self._last.get(model_id)

        async def call() -> Any:
            if before is not None:
                await asyncio.wait([before])  # (its outcome is its own caller's)
            steps = TinkerSteps(service.trainer, service.max_context)
            result = await service.run_exclusive(lambda: work(steps), changes_weights=changes_weights)
            row = then(result) if then is not None else None
            if row is not None:
                step = int(row.pop("step"))
                await here.log(model, [], SPLIT, row, step)
            return result

        request_id = self.futures.submit(tenant, call(), key)
        self._last[model_id] = self.futures.task(request_id)
        return request_id

    def save(self, tenant: str, body: dict[str, Any], kind: str) -> str:
        """Submit a save of the model's state (`weights`: adapter and optimizer; `sampler_weights`: the
        adapter) under `body["path"]`, a PEFT folder in the model's run folder: its request id."""
        model_id, name = str(body.get("model_id")), str(body.get("path"))
        if not _NAME.fullmatch(name):
            raise UserError(f"a checkpoint name is 1-128 letters, digits, '.', '-' or '_' (got {name!r})")
        folder = self.folder(tenant, model_id) / kind / name
        if folder.exists() and not body.get("overwrite", kind == "sampler_weights"):
            raise UserError(f"checkpoint {name!r} exists (save it with overwrite=True, or another name)")
        path = f"tinker://{model_id}/{kind}/{name}"

        def write(steps: TinkerSteps) -> dict[str, Any]:
            folder.mkdir(parents=True, exist_ok=True)
            if kind == "weights":
                steps.trainer.save(str(folder))
            else:
                save_weights(steps.trainer.model, str(folder))
            return {"path": path, "type": "save_weights" if kind == "weights" else "save_weights_for_sampler"}

        return self.in_order(tenant, model_id, int(body.get("seq_id", 0)), write, changes_weights=False)

    def load(self, tenant: str, body: dict[str, Any]) -> str:
        """Submit a load of a saved training state into the model (its optimizer's too when asked)."""
        model_id, path = str(body.get("model_id")), str(body.get("path"))
        folder = self.checkpoint(tenant, path)
        with_optimizer = bool(body.get("optimizer"))

        def read(steps: TinkerSteps) -> dict[str, Any]:
            if with_optimizer:
                steps.trainer.load(str(folder))
            else:
                load_adapter(steps.trainer.model, str(folder))
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        return self.in_order(tenant, model_id, int(body.get("seq_id", 0)), read)

    def sampler_of(self, tenant: str, body: dict[str, Any]) -> str:
        """Submit, in the model's order, a sampling client of its weights: its request id."""
        model_id = str(body.get("model_id"))
        _, name, _ = self._find(tenant, model_id)
        here, model = self.hosted.find(tenant, name)
        session = model_id.split(":train:")[0]
        sampler_id = f"{session}:sample:{int(body.get('sampling_session_seq_id', 0))}"
        self.samplers[sampler_id] = live_sampler(tenant, here.service(model))
        answer = {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
        return self.in_order(
            tenant, model_id, int(body.get("seq_id", 0)), lambda _: answer, changes_weights=False
        )

    def create_sampler(self, tenant: str, body: dict[str, Any]) -> str:
        """A sampling client of saved weights (`model_path`, a tinker:// path of this tenant's) or of the base
        model: its id."""
        session = str(body.get("session_id"))
        self.check_session(tenant, session)
        shared = self.hosted.shared
        if shared is None:
            raise UserError("sampling saved weights or the base model is served on `--engine hf` only")
        path = body.get("model_path")
        folder = None
        if path:
            folder = self.checkpoint(tenant, str(path))
        elif body.get("base_model") != self.hosted.config.base_model:
            raise UserError(
                f"this server samples {self.hosted.config.base_model!r} (asked: {body.get('base_model')!r})"
            )
        sampler_id = f"{session}:sample:{int(body.get('sampling_session_seq_id', 0))}"
        keep = self.hosted.config.sampler_adapters
        self.samplers[sampler_id] = frozen_sampler(tenant, shared, folder, path, keep)
        return sampler_id

    def sampler(self, tenant: str, sampler_id: str) -> Sampler:
        found = self.samplers.get(sampler_id)
        if found is None or found.tenant != tenant:
            raise UserError(f"no sampling client {sampler_id!r} of this key")
        return found

    def checkpoint(self, tenant: str, path: str) -> Path:
        """The folder of checkpoint `path` (tinker://MODEL_ID/KIND/NAME) of one of the tenant's models."""
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or parts[1] not in KINDS:
            raise UserError(f"a checkpoint path is tinker://MODEL_ID/weights/NAME (got {path!r})")
        folder = self.folder(tenant, parts[0]) / parts[1] / parts[2]  # (this tenant's models only)
        if not (folder / "adapter_model.safetensors").is_file():
            raise UserError(f"no checkpoint at {path!r}")
        return folder

    def model_ids(self, tenant: str) -> list[str]:
        return [model_id for model_id, found in self._models.items() if found[0] == tenant]

    def rank(self, tenant: str, model_id: str) -> int:
        return self._find(tenant, model_id)[2]

    def folder(self, tenant: str, model_id: str) -> Path:
        """The training client's checkpoints' folder (its session may have ended)."""
        _, name, _ = self._find(tenant, model_id)
        return model_dir(f"{self.hosted.config.path}/{tenant}", PROJECT, name) / "tinker"

    def _find(self, tenant: str, model_id: str) -> tuple[str, str, int]:
        found = self._models.get(model_id)
        if found is None or found[0] != tenant:
            raise UserError(
                f"no training client {model_id!r} of this key (create_lora_training_client first)"
            )
        return found
