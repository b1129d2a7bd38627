"""One copy of a base model's weights under several model objects: the training server's models each get
their own module tree (their own LoRA layers, trainer and engine) over the same, frozen base tensors, so
memory grows by adapters and optimizer states, not by base copies.

A model object is a deep copy of a pristine loaded instance in which every parameter is itself (the copy
shares it; buffers, a few small tensors, are copied). The base parameters must never change: only LoRA
adapters train on a shared base (full fine-tuning and 4-bit weights load their own copy)."""

from __future__ import annotations

import copy
import threading
from typing import Any

from artrl.config import EngineConfig
from artrl.local.models.loading import load_model_and_tokenizer


class SharedBase:
    def __init__(self, base_model: str) -> None:
        self.base_model = base_model
        self._pristine: tuple[Any, Any] | None = None  # (model, tokenizer): never adapted, served or trained
        self._lock = threading.Lock()

    def load(self, base_model: str, config: EngineConfig, weights_from: str | None = None) -> tuple[Any, Any]:
        """What `load_model_and_tokenizer` returns: a model over the shared weights where it may share them
        (this base, no full-weights checkpoint, no 4-bit weights), else a copy of its own."""
        if base_model != self.base_model or weights_from is not None or config.load.quantization != "none":
            return load_model_and_tokenizer(base_model, config, weights_from)
        with self._lock:
            if self._pristine is None:
                self._pristine = load_model_and_tokenizer(base_model, config)
            model, tokenizer = self._pristine
            shared = {id(p): p for p in model.parameters()}  # (deepcopy hands these back as they are)
            return copy.deepcopy(model, shared), copy.deepcopy(tokenizer)

    def parameters_shared_with(self, model: Any) -> int:
        """How many of `model`'s parameters are the shared base's own tensors (for tests and reports)."""
        if self._pristine is None:
            return 0
        base = {p.data_ptr() for p in self._pristine[0].parameters()}
        return sum(1 for p in model.parameters() if p.data_ptr() in base)
