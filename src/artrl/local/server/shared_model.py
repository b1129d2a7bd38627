"""The training server's models on the embedded engine: one PEFT model over one copy of the base weights,
holding every hosted model's LoRA adapter by name, and one engine generating for all of them (rows of
different adapters in one batch) and running their training steps in turn on its thread. A hosted model's
`LocalService` is its gateway over `AdapterEngine` (its adapter of the engine) and its own `Trainer` (its
optimizer state, over its adapter's parameters), so memory grows by adapters and optimizer states only."""

from __future__ import annotations

import copy
import itertools
import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from artrl.config import EngineConfig, GatewayConfig, LoraConfig, TrainerConfig
from artrl.local.chat_format.chat_format import ChatFormat
from artrl.local.engine.hf.adapter_engine import AdapterEngine
from artrl.local.engine.hf.engine import HFEngine
from artrl.local.engine.hf.fused_decode import FusedDecode
from artrl.local.models.loading import LOADING, context_length, end_of_turn_ids, load_model_and_tokenizer
from artrl.local.service.service import LocalService
from artrl.local.train.adapters import add_adapter, attach_adapter, load_adapter
from artrl.local.train.trainer import Trainer

# what the fused CPU forward computes per adapter (adapter_factors.py); an adapter elsewhere (the embeddings,
# the output head) would turn that forward off for every model, so the server refuses it where it runs
FUSED_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


class SharedModel:
    def __init__(self, base_model: str, engine: EngineConfig) -> None:
        self.base_model, self.engine_config = base_model, engine
        self._model: Any = None  # the PeftModel (None until the first model starts)
        self._tokenizer: Any = None
        self.engine: HFEngine | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._fused = False  # whether the engine runs the fused CPU forward (known once the base is loaded)
        self._saved: OrderedDict[tuple[str, int], str] = OrderedDict()  # saved adapter's file -> its name
        self._loading_saved = threading.Lock()
        self._stop_ids: frozenset[int] | None = None

    @property
    def model(self) -> Any:
        return self._model

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def start(
        self,
        served_name: str,
        base_model: str,
        engine_config: EngineConfig,
        gateway_config: GatewayConfig,
        lora: LoraConfig | None,
        resume_from: Path | None = None,
        log_dir: Path | None = None,
        chat_format: str | None = None,
        trainable: bool = True,
        trainer_config: TrainerConfig | None = None,
    ) -> LocalService:
        """What `LocalService.start` returns, for one more adapter on the shared model (blocking: run it in a
        worker thread): a fresh adapter, or `resume_from`'s, with its optimizer state."""
        trainer_config = trainer_config or TrainerConfig()
        if lora is None or not trainable or base_model != self.base_model or trainer_config.ranks != 1:
            raise ValueError(
                f"models on the shared {self.base_model!r} are LoRA adapters trained in this process "
                f"(got base_model={base_model!r}, lora={lora!r}, ranks={trainer_config.ranks})"
            )
        adapter = f"model{next(self._ids)}"  # (a PEFT adapter's name is a module key: no '.' in it)
        engine, model = self._with_adapter(adapter, lora)

        def build_trainer() -> Trainer:
            model.set_adapter(adapter)  # (the trainer takes the active adapter's parameters)
            trainer = Trainer(
                model,
                pad_id=self._tokenizer.pad_token_id or 0,
                fused_lora=trainer_config.fused_lora,
                share_prompts=trainer_config.share_prompts,
                fused_norms=trainer_config.fused_norms,
            )
            if resume_from is not None:
                trainer.load(str(resume_from))
            return trainer

        view = AdapterEngine(
            engine,
            adapter,
            activate=lambda: model.set_adapter(adapter),
            remove=lambda: _remove(model, adapter),
        )
        try:
            trainer = engine.call(build_trainer, adapter=adapter).result()
            step = int(resume_from.name) if resume_from is not None and resume_from.name.isdigit() else 0
            tokenizer = copy.deepcopy(
                self._tokenizer
            )  # (a fast tokenizer is not for several threads at once)
            service = LocalService.serve(
                served_name, model, tokenizer, view, engine_config, gateway_config, chat_format, step
            )
        except BaseException:
            engine.forget_adapter(adapter, lambda: _remove(model, adapter)).result()
            raise
        service.trainer = trainer
        return service

    def saved_adapter(self, folder: Path, keep: int) -> str:
        """The name, on the shared model, of the adapter saved in `folder` (a PEFT folder of an adapter of this
        base), to sample from: loaded at its first use (blocking: run it in a worker thread) and never
        trained. At most `keep` saved adapters stay loaded: the one used longest ago is unloaded first (its
        requests still running end; its next use loads it again). A rewritten folder is loaded anew."""
        weights = folder / "adapter_model.safetensors"
        with self._loading_saved:
            key = (str(folder.resolve()), weights.stat().st_mtime_ns)
            name = self._saved.get(key)
            if name is not None:
                self._saved.move_to_end(key)
                return name
            name = f"saved{next(self._ids)}"
            engine, model = self._with_adapter(name, saved_lora(folder))

            def fill() -> None:
                model.set_adapter(name)
                load_adapter(model, str(folder))
                for parameter in model.parameters():
                    parameter.requires_grad_(False)  # (a training job makes its own adapter trainable again)

            try:
                engine.call(fill, adapter=name).result()
            except BaseException:
                engine.forget_adapter(name, lambda: _remove(model, name)).result()
                raise
            self._saved[key] = name
            while len(self._saved) > keep:
                _, old = self._saved.popitem(last=False)
                engine.forget_adapter(old, lambda old=old: _remove(model, old)).result()
            return name

    def base_engine(self) -> HFEngine:
        """The shared engine, to sample the base model from (its rows name no adapter), started if need be
        (blocking): a PEFT model holds at least one adapter, so a first one, never used, comes with it."""
        with self._lock:
            if self.engine is not None:
                return self.engine
        engine, _ = self._with_adapter(
            f"unused{next(self._ids)}", LoraConfig(rank=1, target_modules=("q_proj",))
        )
        return engine

    def stop_ids(self) -> frozenset[int]:
        """The tokens a sample of the base (or of a saved adapter) stops at by default (blocking)."""
        if self._stop_ids is None:  # (once: every sample asks)
            self.base_engine()
            fmt = ChatFormat.for_tokenizer(
                self._tokenizer, None, end_of_turn_ids(self._model, self._tokenizer)
            )
            self._stop_ids = fmt.stop_ids
        return self._stop_ids

    def _with_adapter(self, adapter: str, lora: LoraConfig) -> tuple[HFEngine, Any]:
        """The engine and the model, with a fresh adapter named `adapter` on it (loaded at the first)."""
        with self._lock:
            if self.engine is None:
                with LOADING:
                    model, self._tokenizer = load_model_and_tokenizer(self.base_model, self.engine_config)
                    self._fused = self.engine_config.fused_decode and FusedDecode.of(model) is not None
                    self._check_targets(lora)
                    model = attach_adapter(model, lora, adapter)
                model.eval()
                max_context = context_length(model, self.engine_config)
                self._model = model
                self.engine = HFEngine(
                    model, max_context=max_context, config=self.engine_config, adapters=True
                )
                return self.engine, model
            engine, model = self.engine, self._model
        self._check_targets(lora)

        def add() -> None:
            add_adapter(model, lora, adapter)
            try:
                engine.check_adapter(adapter)
            except ValueError:
                _remove(model, adapter)
                raise

        engine.call(add, adapter=adapter).result()
        return engine, model

    def _check_targets(self, lora: LoraConfig) -> None:
        outside = sorted(set(lora.target_modules) - FUSED_TARGETS)
        if self._fused and outside:
            raise ValueError(
                f"this server's models adapt the decoder's linear layers ({', '.join(sorted(FUSED_TARGETS))}); "
                f"LoraConfig(target_modules=...) also names {outside}"
            )

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()


def saved_lora(folder: Path) -> LoraConfig:
    """The LoRA settings of the adapter saved in `folder` (its PEFT adapter_config.json)."""
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        return LoraConfig(
            rank=int(config["r"]),
            alpha=float(config["lora_alpha"]),
            target_modules=tuple(sorted(config["target_modules"])),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{folder} holds no readable LoRA adapter config ({exc})") from None


def _remove(model: Any, adapter: str) -> None:
    """`adapter` out of the model, unless it is the last one (a PeftModel keeps at least one; a fresh model
    is a fresh adapter, never this one's weights)."""
    if len(model.peft_config) > 1:
        model.delete_adapter(adapter)
