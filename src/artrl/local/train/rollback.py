"""What a training call puts back when it fails after an optimizer step: the trainable parameters and the
optimizer state as they were before its first one (Trainer.step / Trainer.sft)."""

from __future__ import annotations

import copy as copy_module
from typing import Any

import torch


class CallStart:
    """The trainable parameters and the optimizer state before a call's first optimizer step, to put back if
    the call fails after it. A LoRA adapter's copy is small and stays on its device; with full fine-tuning
    the copy (the weights and Adam's two moments: three times the trained weights) goes to CPU memory, not
    the GPU's, and is taken once per call."""

    def __init__(self, parameters: list[torch.Tensor], state: dict[Any, dict[str, Any]]) -> None:
        self.parameters = parameters
        self.state = state

    @classmethod
    def of(cls, trainer: Any) -> CallStart:
        where = None if trainer.has_adapter else torch.device("cpu")

        def copy(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value.detach().to(where, copy=True)
            return copy_module.deepcopy(value)

        parameters = [copy(p) for p in trainer.parameters]
        state = {p: {k: copy(v) for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
        return cls(parameters, state)

    def restore(self, trainer: Any) -> None:
        with torch.no_grad():
            for p, saved in zip(trainer.parameters, self.parameters, strict=True):
                p.copy_(saved)
        # (a parameter's first step adds its state: the state before the call may have none)
        current = trainer.optimizer.state
        restored = {
            p: {
                k: (v.to(current[p][k].device) if isinstance(v, torch.Tensor) and k in current[p] else v)
                for k, v in s.items()
            }
            for p, s in self.state.items()
        }
        current.clear()
        current.update(restored)
