"""The embedded engine's inference weights with the LoRA folded in, as a separate copy of the adapted layers.

A PEFT LoRA layer computes base(x) + B(A(x))·s on every forward: two more small matrix products per adapted
module, plus dtype casts when the adapter is fp32 over bf16 weights. On a CPU that is a third of a decode
step and more than half of a prefill (27M model, 32 sequences). For inference the engine instead swaps each
adapted layer's base weight for a merged copy W + s·B·A and turns the layer's adapter branch off; before
anything else runs on the model (training, saving: the engine's jobs) it swaps the original weights back
and turns the adapters on again. The base weights are never modified (merging into them and unmerging
would drift in bf16), at the cost of one extra copy of the adapted weights. The merged copy is recomputed
after each job, so generation always uses the weights the trainer has just updated.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def mergeable(module: Any) -> bool:
    """A plain PEFT LoRA linear layer with one active adapter (no DoRA or other variant)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return False
    if not isinstance(module, Linear) or len(module.active_adapters) != 1:
        return False
    adapter = module.active_adapters[0]
    return adapter in module.lora_A and adapter not in module.lora_variant and not module.merged


def folded(layer: Any, weight: torch.Tensor) -> torch.Tensor:
    """weight + s·B·A of a mergeable layer's active adapter, summed in fp32 (the caller rounds it once)."""
    delta = layer.get_delta_weight(layer.active_adapters[0])  # same shape as W
    return torch.add(weight.float(), delta.float())


def _keeping_requires_grad(layer: Any, toggle: Any, enabled: bool) -> None:
    """PEFT's enable_adapters also sets the adapter's requires_grad; which weights train is the trainer's
    business, so the flags stay as they were."""
    adapter = [p for name, p in layer.named_parameters() if name.startswith("lora_")]
    flags = [p.requires_grad for p in adapter]
    toggle(enabled)
    for p, flag in zip(adapter, flags, strict=True):
        p.requires_grad_(flag)


class MergedLora:
    """Swaps a PEFT model's LoRA layers between training form (base + adapter) and merged inference form."""

    def __init__(self, layers: list[Any]) -> None:
        self._layers = layers
        self._originals: list[torch.nn.Parameter] = [layer.base_layer.weight for layer in layers]
        self._merged: list[torch.nn.Parameter | None] = [None] * len(layers)
        self.active = False

    @classmethod
    def of(cls, model: Any) -> MergedLora | None:
        """For a PEFT model whose every LoRA layer can be merged; None otherwise (nothing to do)."""
        if not hasattr(model, "get_base_model"):
            return None
        lora = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
        if not lora:
            return None
        unmergeable = sorted({type(m).__name__ for m in lora if not mergeable(m)})
        if unmergeable:  # (ParamWrapper: LoRA on an MoE's fused expert weights)
            log.info(
                "the adapter has layers artrl does not merge (%s): inference keeps the adapter", unmergeable
            )
            return None
        return cls(lora)

    def merge(self) -> None:
        """Inference form: each layer's weight is W + s·B·A (computed now) and its adapter branch is off."""
        if self.active:
            return
        with torch.no_grad():
            for i, layer in enumerate(self._layers):
                original = self._originals[i]
                merged = self._merged[i]
                if merged is None:
                    merged = self._merged[i] = torch.nn.Parameter(
                        torch.empty_like(original), requires_grad=False
                    )
                merged.copy_(folded(layer, original))  # (rounded once to W's dtype)
                layer.base_layer.weight = merged
                _keeping_requires_grad(layer, layer.enable_adapters, False)
        self.active = True

    def unmerge(self) -> None:
        """Training form again: the original weights back, the adapter branches on."""
        if not self.active:
            return
        for layer, original in zip(self._layers, self._originals, strict=True):
            layer.base_layer.weight = original
            _keeping_requires_grad(layer, layer.enable_adapters, True)
        self.active = False
