"""The embedded engine's fast inference paths: its decode attention and the merged-LoRA weights."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from artrl.local.kernels.chunked_attention import chunked_attention
from artrl.local.kernels.cpu_attention import NAME, cpu_attention, decode_attention, use_cpu_attention
from artrl.local.kernels.merged_lora import MergedLora


class _Heads(torch.nn.Module):
    num_key_value_groups = 4
    is_causal = True


def _attention_inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, dim = 3, 8, 2, 40, 32
    buffer = torch.randn(batch, kv_heads, length + 24, dim, generator=g).to(
        dtype
    )  # room to grow, as the cache
    key, value = buffer[:, :, :length], torch.randn(batch, kv_heads, length, dim, generator=g).to(dtype)
    query = torch.randn(batch, heads, 1, dim, generator=g).to(dtype)
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    mask[1, ..., :15] = False  # a left-padded row
    mask[2, ..., :-8] = False  # a sliding window of 8
    return query, key, value, mask


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_decode_attention_equals_sdpa(dtype, tolerance):
    query, key, value, mask = _attention_inputs(dtype)
    with torch.inference_mode():
        ours, _ = cpu_attention(_Heads(), query, key, value, mask, scaling=0.2)
        reference, _ = sdpa_attention_forward(
            _Heads(), query.float(), key.float(), value.float(), mask, scaling=0.2
        )
        unmasked, _ = cpu_attention(_Heads(), query, key, value, None)
        unmasked_ref, _ = sdpa_attention_forward(_Heads(), query.float(), key.float(), value.float(), None)
    assert ours.shape == reference.shape == (3, 1, 8, 32) and ours.dtype == dtype
    assert torch.allclose(ours.float(), reference, atol=tolerance)
    assert torch.allclose(unmasked.float(), unmasked_ref, atol=tolerance)
    with torch.inference_mode():  # the products themselves (fp32 steps keep sdpa)
        direct = decode_attention(query, key, value, mask, 0.2)
    assert torch.allclose(direct.float(), reference, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_gives_sdpas_numbers_and_training_keeps_gradients(dtype):
    """A prefill (several queries) with a mask shares each key/value head in the kernel instead of repeating
    it as transformers' sdpa path does: the very same numbers, padded query rows included."""
    query, key, value, mask = _attention_inputs(dtype)
    long_query = torch.randn(3, 8, 5, 32).to(dtype)
    long_mask = torch.ones(5, 40, dtype=torch.bool).tril(35).expand(3, 1, 5, 40).clone()  # causal, 35 cached
    long_mask[1, ..., :20] = False  # a left-padded row
    long_mask[2, :, :2] = False  # two padding queries (a row with fewer new tokens): nothing to attend
    with torch.inference_mode():
        ours, _ = cpu_attention(_Heads(), long_query, key, value, long_mask)
        reference, _ = sdpa_attention_forward(_Heads(), long_query, key, value, long_mask)
        causal, _ = cpu_attention(_Heads(), long_query, key, value, None)  # (no mask: sdpa's own way)
        causal_reference, _ = sdpa_attention_forward(_Heads(), long_query, key, value, None)
    assert ours.shape == (3, 5, 8, 32) and ours.is_contiguous()
    assert torch.equal(ours, reference)
    assert torch.equal(causal, causal_reference)
    query, key, value, mask = _attention_inputs(torch.float32)
    query.requires_grad_(True)
    out, _ = cpu_attention(_Heads(), query, key, value, mask)
    out.sum().backward()
    assert query.grad is not None


@pytest.mark.parametrize("padded", [False, True])
def test_training_attention_equals_sdpa_with_its_gradients(padded):
    g = torch.Generator().manual_seed(2)
    query = torch.randn(2, 8, 12, 32, generator=g, requires_grad=True)
    key = torch.randn(2, 2, 12, 32, generator=g, requires_grad=True)
    value = torch.randn(2, 2, 12, 32, generator=g, requires_grad=True)
    mask = None
    if padded:  # causal, and the second row's first 3 keys are padding
        mask = torch.ones(12, 12, dtype=torch.bool).tril().expand(2, 1, 12, 12).clone()
        mask[1, :, :, :3] = False
    ours = chunked_attention(query, key, value, mask, 0.3)  # what cpu_attention trains with
    ours.sum().backward()
    grads = [t.grad.clone() for t in (query, key, value)]
    for t in (query, key, value):
        t.grad = None
    reference, _ = sdpa_attention_forward(_Heads(), query, key, value, mask, scaling=0.3)
    reference.sum().backward()
    rows = (
        slice(None) if not padded else (slice(None), slice(3, None))
    )  # sdpa gives NaN where nothing is seen
    assert torch.allclose(ours[rows], reference[rows], atol=1e-5)
    if not padded:
        assert all(
            torch.allclose(a, t.grad, atol=1e-4) for a, t in zip(grads, (query, key, value), strict=True)
        )
    half = [t.detach().bfloat16().requires_grad_(True) for t in (query, key, value)]
    out, _ = cpu_attention(_Heads(), *half, mask, scaling=0.3)  # bf16 with gradients: the same math
    assert torch.allclose(out[rows].float(), reference[rows], atol=5e-2)


def test_a_model_switches_to_the_decode_attention_and_generates_the_same(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([list(range(10, 60))])
    with torch.inference_mode():
        before = model.generate(prompt, max_new_tokens=12, do_sample=False)
        assert use_cpu_attention(model) and model.config._attn_implementation == NAME
        after = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(before, after)
    assert not use_cpu_attention(model)  # only from sdpa


def _lora_model(tiny_model_dir, dtype=torch.float32):
    from fakes import adapted
    from transformers import AutoModelForCausalLM

    return adapted(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype))


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])
def test_merged_lora_gives_the_adapters_outputs_and_gives_back_the_weights(tiny_model_dir, dtype, tolerance):
    model = _lora_model(tiny_model_dir, dtype)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    ids = torch.randint(10, 1000, (2, 30), generator=torch.Generator().manual_seed(0))
    lora = MergedLora.of(model)
    assert lora is not None
    with torch.no_grad():
        adapter = model(input_ids=ids).logits.float()
        lora.merge()
        merged = model(input_ids=ids).logits.float()
        assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
        lora.unmerge()
        again = model(input_ids=ids).logits.float()
    assert torch.allclose(merged, adapter, atol=tolerance) and not torch.equal(merged, adapter)
    assert torch.equal(again, adapter)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if "base_layer" in n)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable


def test_merging_again_takes_the_adapters_new_weights(tiny_model_dir):
    model = _lora_model(tiny_model_dir)
    lora = MergedLora.of(model)
    ids = torch.randint(10, 1000, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lora.merge()
        lora.unmerge()
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.mul_(2.0)  # a training step
        adapter = model(input_ids=ids).logits
        lora.merge()
        merged = model(input_ids=ids).logits
    assert torch.allclose(merged, adapter, atol=1e-4)


def test_no_merge_for_a_plain_model_or_a_lora_variant(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    assert MergedLora.of(AutoModelForCausalLM.from_pretrained(tiny_model_dir)) is None
    dora = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True),
    )
    assert MergedLora.of(dora) is None
