"""RMS norms trained through one autograd function each, with the backward pass written out.

The RMS norm of Llama, Qwen2/3, Mistral and their kin computes, per row of H values,

    y = w ⊙ (x·r).to(dtype)      r = (mean(x²) + eps)^-½ in fp32      x (..., H), w (H,)

as six tensor operations (a cast to fp32, a square, a mean, an rsqrt, a product, a cast back) and a product by
the weight, each with its own node in autograd: its backward pass is a dozen more passes over the whole
activation, in bf16 slower than in fp32 (a (8, 104, 512) norm: 3.5 ms forward and backward in bf16 against
1.5 ms in fp32), and the 27M `small` model has 33 of them (per decoder layer two, and the query and key norms;
the final one). Here the forward pass is the same operations (bit for bit the model's own output) and the
backward pass is the closed form, in fp32,

    ĝ = (g ⊙ w) in fp32,  x̂ = x·r:   grad x = r·(ĝ − x̂·mean(ĝ ⊙ x̂)),   grad w = Σ g ⊙ x̂.to(dtype)

from the input and r alone (a (8, 104, 512) norm: 1.6 ms in bf16). `FusedNormTraining` swaps every such
norm for a `FusedRMSNorm` around a training call and puts the model's own module back after it, as
`FusedLoraTraining` does for LoRA linears. A norm is swapped only after its own forward and the fused one gave
equal outputs on a test input: a norm that computes anything else (Gemma's 1 + w, a norm in the input
dtype) keeps its forward.
"""

from __future__ import annotations

from typing import Any

import torch


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, eps: float):  # type: ignore[override]
        xf = x.to(torch.float32)  # (..., H)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        y = weight * (xf * r).to(x.dtype)  # (..., H): the model's own operations, in its order
        ctx.save_for_backward(x, r, weight)
        return y

    @staticmethod
    def backward(ctx: Any, grad):  # type: ignore[override]
        x, r, weight = ctx.saved_tensors
        x_hat = x.to(torch.float32) * r  # (..., H)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g_hat = (grad * weight).to(torch.float32)  # (..., H): the gradient at x·r
            grad_x = (r * (g_hat - x_hat * (g_hat * x_hat).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            terms = grad.to(torch.float32) * x_hat.to(x.dtype).to(torch.float32)  # (..., H)
            grad_w = terms.reshape(-1, terms.shape[-1]).sum(0).to(weight.dtype)  # (H,)
        return grad_x, grad_w, None


class FusedRMSNorm(torch.nn.Module):
    """The model's RMS norm (`norm`, its child) computed through `_RMSNorm`."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.norm = norm

    @property
    def weight(self) -> torch.Tensor:  # (what model code reads of a norm)
        return self.norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.norm.weight, float(self.norm.variance_epsilon))


def fusable(norm: torch.nn.Module) -> bool:
    """An RMS norm whose forward is the formula above: checked on a test input in its weight's dtype."""
    weight = getattr(norm, "weight", None)
    if (
        not type(norm).__name__.endswith("RMSNorm")
        or not isinstance(weight, torch.Tensor)
        or weight.dim() != 1
        or not weight.dtype.is_floating_point
        or weight.device.type == "meta"
        or not isinstance(getattr(norm, "variance_epsilon", None), float)
    ):
        return False
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = (3 * torch.randn(2, 3, weight.shape[0], generator=generator)).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            return bool(torch.equal(norm(x), _RMSNorm.apply(x, weight, norm.variance_epsilon)))
        except Exception:  # (a norm that takes other arguments, or fails on this input: not the formula)
            return False


class FusedNormTraining:
    """Swaps a model's fusable RMS norms for `FusedRMSNorm`s (`fuse`) and back (`restore`)."""

    def __init__(self, places: list[tuple[torch.nn.Module, str, torch.nn.Module]]) -> None:
        self._places = [(parent, name, norm, FusedRMSNorm(norm)) for parent, name, norm in places]
        self.active = False

    @classmethod
    def of(cls, model: torch.nn.Module) -> FusedNormTraining | None:
        """For a model with at least one fusable norm (the others keep their forward); None otherwise."""
        verdicts: dict[type, bool] = {}  # (one check per norm class and dtype: the formula is the class's)
        places = []
        for parent in model.modules():
            for name, child in parent.named_children():
                if not type(child).__name__.endswith("RMSNorm"):
                    continue
                key = (type(child), getattr(getattr(child, "weight", None), "dtype", None))
                if key not in verdicts:
                    verdicts[key] = fusable(child)
                if verdicts[key] and isinstance(getattr(child, "variance_epsilon", None), float):
                    places.append((parent, name, child))
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
        for parent, name, norm, _ in self._places:
            setattr(parent, name, norm)
        self.active = False
