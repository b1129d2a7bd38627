"""LoRA linears trained through one autograd function each, instead of PEFT's layer forward.

A PEFT LoRA linear computes `base(x) + lora_B(lora_A(dropout(x))) * s` as separate modules: over bf16 base
weights with fp32 adapters that is an input cast to fp32 (undone again by autocast), casts of A and B, a
scaling product and a sum over the whole (N, out) output, and each of those again in the backward pass,
next to products that run at the CPU's bf16 rate. Here the same layer is

    y = x·Wᵀ + b + (x·Aᵀ)·(s·B)ᵀ          x (N, in), W (out, in) frozen, A (r, in), B (out, r) trained

computed in the layer's compute dtype (autocast's, else W's): the adapter's product is added into the base
output by one `addmm`, the scale folded into the (out, r) copy of B, and the backward pass written out
(grad x = g·W + (g·sB)·A, grad A = (g·sB)ᵀ·x, grad B = s·gᵀ·(x·Aᵀ), the adapter's in fp32). One such layer
(832 x 512 -> 1536, bf16) 8.1 -> 4.4 ms forward and backward; the 27M model's GRPO step 1.14x faster in bf16,
1.04x in fp32 (benchmarks/bench_bf16.py, on a 2-core AMD EPYC).

`FusedLoraTraining` swaps each plain LoRA linear of a model for a `FusedLoraLinear` around a training call
(the trainer's `_begin`/`_end`) and puts PEFT's module back after it, so that saving, merging for inference
and PEFT's own state see the model exactly as before. A swapped layer keeps PEFT's module as its child and
follows its state: with the adapter disabled (`disable_adapter()` for the KL reference) or merged it runs
PEFT's forward. Layers PEFT computes otherwise (dropout, DoRA and other variants, a LoRA bias, Conv1D's
transposed weight, quantised or trainable base weights) are never swapped.
"""

from __future__ import annotations

from typing import Any

import torch

from artrl.local.kernels.merged_lora import mergeable


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, bias, lora_a, lora_b, scale: float, dtype: torch.dtype):  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)  # (N, in)
        w = weight.to(dtype)  # (out, in) (no copy when W is already in the compute dtype)
        a = lora_a.to(dtype)  # (r, in)
        b = (lora_b * scale).to(dtype)  # (out, r)
        xa = x2 @ a.t()  # (N, r)
        y = torch.nn.functional.linear(x2, w, None if bias is None else bias.to(dtype))  # (N, out)
        y.addmm_(xa, b.t())  # (N, out) += (N, r)·(r, out)
        ctx.save_for_backward(x2, xa, w, a, b)
        ctx.scale, ctx.in_shape, ctx.x_dtype = scale, x.shape, x.dtype
        ctx.a_dtype, ctx.b_dtype = lora_a.dtype, lora_b.dtype
        return y.view(*x.shape[:-1], y.shape[-1])  # (..., out)

    @staticmethod
    def backward(ctx: Any, grad):  # type: ignore[override]
        x2, xa, w, a, b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(w.dtype)  # (N, out)
        gxa = g @ b  # (N, r): the gradient at x·Aᵀ
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ w).addmm_(gxa, a).view(ctx.in_shape).to(ctx.x_dtype)  # (..., in)
        if ctx.needs_input_grad[3]:
            grad_a = (gxa.t() @ x2).to(ctx.a_dtype)  # (r, in)
        if ctx.needs_input_grad[4]:
            grad_b = ((g.t() @ xa).to(torch.float32) * ctx.scale).to(ctx.b_dtype)  # (out, r)
        return grad_x, None, None, grad_a, grad_b, None, None


def fusable(layer: Any) -> bool:
    """A PEFT LoRA linear whose forward is exactly base + B·A·s: one active adapter, no dropout, variant,
    LoRA bias or transposed weight, over a frozen floating-point torch Linear."""
    if not mergeable(layer) or getattr(layer, "fan_in_fan_out", False):
        return False
    adapter = layer.active_adapters[0]
    base = layer.base_layer
    return (
        type(base) is torch.nn.Linear
        and base.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and not base.weight.requires_grad
        and (base.bias is None or not base.bias.requires_grad)
        and isinstance(layer.lora_dropout[adapter], torch.nn.Identity)
        and layer.lora_B[adapter].bias is None
    )


class FusedLoraLinear(torch.nn.Module):
    """A plain PEFT LoRA linear (`peft`, its child) computed through `_LoraLinear` while its adapter is on."""

    def __init__(self, peft: Any) -> None:
        super().__init__()
        self.peft = peft
        self.adapter = peft.active_adapters[0]  # (`fusable` checked the layer once, for this adapter)

    @property
    def weight(self) -> torch.Tensor:  # (what model code reads of a linear, as of PEFT's: its base layer's)
        return self.peft.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.peft.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer, adapter = self.peft, self.adapter
        base = layer.base_layer
        # what PEFT's state can change between calls: adapter off (KL reference), merged, another adapter
        # active, a base weight made trainable; in any of those, PEFT's forward
        if (
            layer.disable_adapters
            or layer.merged
            or layer.active_adapters != [adapter]
            or base.weight.requires_grad
        ):
            return layer(x)
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else base.weight.dtype
        with torch.autocast(device_type=device, enabled=False):  # (the casts are explicit above)
            return _LoraLinear.apply(
                x,
                base.weight,
                base.bias,
                layer.lora_A[adapter].weight,
                layer.lora_B[adapter].weight,
                float(layer.scaling[adapter]),
                dtype,
            )


class FusedLoraTraining:
    """Swaps a PEFT model's plain LoRA linears for `FusedLoraLinear`s (`fuse`) and back (`restore`)."""

    def __init__(self, places: list[tuple[torch.nn.Module, str, Any]]) -> None:
        self._places = [(parent, name, layer, FusedLoraLinear(layer)) for parent, name, layer in places]
        self.active = False

    @classmethod
    def of(cls, model: Any) -> FusedLoraTraining | None:
        """For a PEFT model with at least one fusable layer (the others keep PEFT's forward); None otherwise."""
        if not hasattr(model, "get_base_model"):
            return None
        places = [
            (parent, name, child)
            for parent in model.modules()
            for name, child in parent.named_children()
            if hasattr(child, "lora_A") and fusable(child)
        ]
        return cls(places) if places else None

    def fuse(self) -> None:
        if self.active:
            return
        for parent, name, _, fused in self._places:
            setattr(parent, name, fused)
        self.active = True

    def restore(self) -> None:
        if not self.active:
            return
        for parent, name, layer, _ in self._places:
            setattr(parent, name, layer)
        self.active = False
