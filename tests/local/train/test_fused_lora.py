"""The fused LoRA linear (local/train/fused_lora.py): the same logprobs and gradients as PEFT's layer forward, in
fp32 and in bf16 under autocast; PEFT's modules back after every training call; PEFT's state followed."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_same_adamw_update

import artrl
from artrl.local.train.adapters import attach_adapter
from artrl.local.train.fused_lora import FusedLoraLinear, FusedLoraTraining, fusable
from artrl.local.train.logprobs import token_logprobs
from artrl.local.train.pack import collate
from artrl.local.train.rows import Row
from artrl.local.train.trainer import Trainer


def lora_model(folder, dtype: torch.dtype = torch.float32, lora: artrl.LoraConfig | None = None):
    from transformers import AutoModelForCausalLM

    model = attach_adapter(
        AutoModelForCausalLM.from_pretrained(folder, dtype=dtype), lora or artrl.LoraConfig()
    )
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # a non-trivial adapter (PEFT starts B at zero)
    return model


ROWS = [
    Row(list(range(5, 40)), [0] * 10 + [1] * 25, [0.0] * 35, advantage=1.0),
    Row(list(range(50, 70)), [0] * 5 + [1] * 15, [0.0] * 20, advantage=-1.0),
]


def logprobs_and_grads(model, fused: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = collate(ROWS, torch.device("cpu"))
    swap = FusedLoraTraining.of(model) if fused else None
    model.zero_grad()
    if swap is not None:
        swap.fuse()
    try:
        lp, _ = token_logprobs(model, batch, None)  # (B, T-1)
        (lp * batch.mask * torch.tensor([1.0, -0.5])[:, None]).sum().backward()
    finally:
        if swap is not None:
            swap.restore()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return lp.detach(), grads


def test_fp32_logprobs_and_gradients_equal_peft(tiny_model_dir):
    model = lora_model(tiny_model_dir)
    swap = FusedLoraTraining.of(model)
    assert swap is not None and len(swap._places) == 2 * 7  # every adapted linear of both layers
    peft_lp, peft_grads = logprobs_and_grads(model, fused=False)
    fused_lp, fused_grads = logprobs_and_grads(model, fused=True)
    assert torch.allclose(fused_lp, peft_lp, atol=1e-5)
    assert peft_grads.keys() == fused_grads.keys() and len(peft_grads) == 2 * 7 * 2
    for name, grad in peft_grads.items():
        scale = float(grad.abs().max())
        assert scale > 0, name
        assert torch.allclose(fused_grads[name], grad, rtol=1e-4, atol=1e-5 * scale), name


def test_bf16_under_autocast_stays_within_bf16_rounding_of_peft(tiny_model_dir):
    """bf16 base weights: the fused products run in bf16 (as PEFT's do under autocast), the adapter's weights
    and gradients stay fp32."""
    model = lora_model(tiny_model_dir, torch.bfloat16)
    peft_lp, peft_grads = logprobs_and_grads(model, fused=False)
    fused_lp, fused_grads = logprobs_and_grads(model, fused=True)
    trained = collate(ROWS, torch.device("cpu")).mask.bool()
    difference = (fused_lp - peft_lp)[trained].abs()
    assert float(difference.mean()) < 0.01 and float(difference.max()) < 0.05  # nats
    for name, grad in peft_grads.items():
        assert fused_grads[name].dtype == torch.float32
        cosine = torch.nn.functional.cosine_similarity(fused_grads[name].flatten(), grad.flatten(), dim=0)
        assert float(cosine) > 0.99, (name, float(cosine))


def test_the_function_alone_matches_autograd_in_fp64():
    """_LoraLinear's hand-written backward against autograd through the plain expression (gradcheck)."""
    from artrl.local.train.fused_lora import _LoraLinear

    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    w, bias = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    a = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, a, b: _LoraLinear.apply(x, w, bias, a, b, 0.7, torch.float64), (x, a, b)
    )
    expected = x @ w.t() + bias + (x @ a.t()) @ b.t() * 0.7
    assert torch.allclose(_LoraLinear.apply(x, w, bias, a, b, 0.7, torch.float64), expected)


def test_the_adapter_disabled_or_merged_runs_peft(tiny_model_dir):
    """A swapped layer follows PEFT's state: `disable_adapter()` (the KL reference) gives the base model."""
    model = lora_model(tiny_model_dir)
    batch = collate(ROWS, torch.device("cpu"))
    with torch.no_grad(), model.disable_adapter():
        base, _ = token_logprobs(model, batch, None)
    swap = FusedLoraTraining.of(model)
    swap.fuse()
    try:
        with torch.no_grad(), model.disable_adapter():
            fused_base, _ = token_logprobs(model, batch, None)
        with torch.no_grad():
            adapted, _ = token_logprobs(model, batch, None)
    finally:
        swap.restore()
    assert torch.equal(fused_base, base)
    assert not torch.allclose(adapted, base, atol=1e-3)


def test_a_training_call_leaves_peft_modules_and_changes_every_adapter_weight(tiny_model_dir):
    """Trainer(fused_lora=True): during the step the layers are FusedLoraLinear, after it PEFT's own again
    (same module tree, same state dict keys); every trainable parameter moved, and each by what PEFT's
    forward would have moved it (the same first AdamW step from the same gradients' signs)."""
    from artrl.local.train.batch import TrainingBatch

    results = {}
    for fused in (False, True):
        model = lora_model(tiny_model_dir)
        keys, types = list(model.state_dict()), [type(m) for m in model.modules()]
        trainer = Trainer(model, pad_id=0, fused_lora=fused)
        trainer.ready()  # (its one-time check runs the model once)
        seen: list[str] = []
        q_proj = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))
        q_proj.register_forward_hook(lambda m, _i, _o, seen=seen: seen.append(type(m).__name__))
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        rows = [Row(r.ids, r.mask, [-3.0] * len(r.ids), advantage=r.advantage) for r in ROWS]
        trainer.step(TrainingBatch(rows=rows), artrl.TrainConfig(learning_rate=1e-3))
        assert list(model.state_dict()) == keys and [type(m) for m in model.modules()] == types
        assert not any(isinstance(m, FusedLoraLinear) for m in model.modules())
        parent = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn"))
        assert parent.q_proj is q_proj
        assert seen == ([] if fused else ["Linear"])  # fused: PEFT's forward never ran
        after = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        assert all(not torch.equal(before[n], after[n]) for n in before)
        results[fused] = {n: after[n] - before[n] for n in before}
    assert_same_adamw_update(
        results[False], results[True], lr=1e-3
    )  # (another summation order: tolerances.py)


@pytest.mark.parametrize("lora", [artrl.LoraConfig(dropout=0.1)])
def test_layers_peft_computes_otherwise_are_left_to_peft(tiny_model_dir, lora):
    model = lora_model(tiny_model_dir, lora=lora)
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert layers and not any(fusable(m) for m in layers)
    assert FusedLoraTraining.of(model) is None
    assert Trainer(model, pad_id=0, fused_lora=True)._fused is None


def test_an_adapted_lm_head_trains_fused(tiny_model_dir):
    """A LoRA on the lm_head too: the trainer reads the head's weight (through the swapped module)."""
    from artrl.local.train.batch import TrainingBatch

    lora = artrl.LoraConfig(target_modules=("q_proj", "v_proj", "lm_head"))
    model = lora_model(tiny_model_dir, lora=lora)
    trainer = Trainer(model, pad_id=0, fused_lora=True)
    assert any(name == "lm_head" for _, name, _, _ in trainer._fused._places)
    rows = [Row(r.ids, r.mask, [-3.0] * len(r.ids), advantage=r.advantage) for r in ROWS]
    metrics = trainer.step(TrainingBatch(rows=rows), artrl.TrainConfig(learning_rate=1e-3))
    assert metrics["optimizer_steps"] == 1 and metrics["grad_norm"] > 0


def test_bf16_products_run_in_bf16(tiny_model_dir):
    """(the point of the fused function under bf16 autocast: the adapter's skinny products in bf16 too)"""
    model = lora_model(tiny_model_dir, torch.bfloat16)
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp.up_proj"))
    x = torch.randn(5, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = FusedLoraLinear(layer)(x)
    saved = y.grad_fn.saved_tensors  # x, x·Aᵀ, W, A, s·B as the products used them
    assert y.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in saved), [
        t.dtype for t in saved
    ]
