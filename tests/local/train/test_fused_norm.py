"""The fused RMS norm (local/train/fused_norm.py): the model's own output bit for bit, its gradients to rounding, in
fp32 and bf16; swapped in for a training call and back after it; a norm computing anything else left alone."""

from __future__ import annotations

import pytest
import torch

import artrl
from artrl.local.train.adapters import attach_adapter
from artrl.local.train.fused_norm import FusedNormTraining, FusedRMSNorm, fusable
from artrl.local.train.logprobs import token_logprobs
from artrl.local.train.pack import collate
from artrl.local.train.rows import Row
from artrl.local.train.trainer import Trainer


def qwen3_norm(hidden: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, hidden))
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 7, 64), (2, 7, 3, 32)])
def test_output_equal_and_gradients_close_to_the_models_own(dtype, shape):
    norm = qwen3_norm(shape[-1], dtype)
    x = (3 * torch.randn(*shape)).to(dtype).requires_grad_(True)
    grad = torch.randn(*shape).to(dtype)
    results = []
    for forward in (norm, FusedRMSNorm(norm)):
        x.grad = norm.weight.grad = None
        y = forward(x)
        y.backward(grad)
        results.append((y.detach(), x.grad.float(), norm.weight.grad.float()))
    (y_own, gx_own, gw_own), (y_fused, gx_fused, gw_fused) = results
    assert y_fused.dtype == y_own.dtype and torch.equal(y_fused, y_own)
    # bf16: the model's own backward rounds each of its dozen steps to bf16, the closed form once
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(gx_fused, gx_own, rtol=tol, atol=tol * gx_own.abs().max())
    assert torch.allclose(gw_fused, gw_own, rtol=tol, atol=tol * gw_own.abs().max())


class InputDtypeRMSNorm(torch.nn.Module):
    """An RMS norm computed in the input's dtype (no fp32): not the fused formula in bf16."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, hidden))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_only_norms_computing_the_formula_are_fused():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    for cls in (LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm):
        assert fusable(cls(64).to(torch.bfloat16)) and fusable(cls(64)), cls.__name__
    assert not fusable(Gemma3RMSNorm(64))  # (1 + w), its own epsilon attribute
    assert not fusable(InputDtypeRMSNorm(64).to(torch.bfloat16))
    assert not fusable(torch.nn.LayerNorm(64))


def model_and_rows(folder, dtype, lora: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    torch.manual_seed(0)
    with torch.no_grad():  # (norm weights off 1, so that a wrong weight gradient shows)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    if lora:
        model = attach_adapter(model, artrl.LoraConfig())
    rows = [
        Row(list(range(5, 40)), [0] * 10 + [1] * 25, [0.0] * 35, advantage=1.0),
        Row(list(range(50, 70)), [0] * 5 + [1] * 15, [0.0] * 20, advantage=-1.0),
    ]
    return model, rows


@pytest.mark.parametrize(
    ("dtype", "lora"), [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)]
)
def test_a_models_logprobs_equal_and_gradients_close(tiny_model_dir, dtype, lora):
    model, rows = model_and_rows(tiny_model_dir, dtype, lora)
    swap = FusedNormTraining.of(model)
    assert swap is not None and len(swap._places) == 2 * 4 + 1  # per layer: 2 + query/key norms; the final
    batch = collate(rows, torch.device("cpu"))
    results = []
    for fused in (False, True):
        model.zero_grad()
        if fused:
            swap.fuse()
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                lp, _ = token_logprobs(model, batch, None)  # (B, T-1)
            (lp * batch.mask * torch.tensor([1.0, -0.5])[:, None]).sum().backward()
        finally:
            swap.restore()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((lp.detach(), grads))
    (lp_own, own), (lp_fused, fused_grads) = results
    assert torch.equal(lp_fused, lp_own)  # the forward is the model's own, bit for bit
    assert own.keys() == fused_grads.keys()
    if not lora:
        assert any("norm" in n for n in own)  # (full fine-tuning: the norms' weights train too)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for name, grad in own.items():
        assert torch.allclose(fused_grads[name], grad, rtol=tol, atol=tol * grad.abs().max()), name


def test_a_training_call_uses_the_fused_norms_and_puts_the_models_own_back(tiny_model_dir):
    from artrl.local.train.batch import TrainingBatch

    model, rows = model_and_rows(tiny_model_dir, torch.float32, lora=True)
    types = [type(m) for m in model.modules()]
    trainer = Trainer(model, pad_id=0, fused_lora=True, fused_norms=True)
    trainer.ready()
    final = next(m for n, m in model.named_modules() if n.endswith("model.norm"))
    calls: list[str] = []
    final.register_forward_hook(lambda m, _i, _o: calls.append("own"))
    rows = [Row(r.ids, r.mask, [-3.0] * len(r.ids), advantage=r.advantage) for r in rows]
    metrics = trainer.step(TrainingBatch(rows=rows), artrl.TrainConfig(learning_rate=1e-3))
    assert metrics["optimizer_steps"] == 1 and metrics["grad_norm"] > 0
    assert calls == []  # the model's own norm never ran in the step
    assert [type(m) for m in model.modules()] == types  # and it is back
    assert not any(isinstance(m, FusedRMSNorm) for m in model.modules())
    assert Trainer(model, pad_id=0)._norms is None  # (off unless asked; TrainerConfig.fused_norms is on)
    assert artrl.TrainerConfig().fused_norms
