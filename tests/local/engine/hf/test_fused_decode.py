"""The embedded engine's fused decode step gives the transformers forward's logits and keys/values, for every
layout it accepts (Llama with biases and llama3 rope scaling, Qwen2, Qwen3, Mistral), with or without a
LoRA, in fp32 and bf16; it follows the weights through a training step; other layouts keep the forward."""

from __future__ import annotations

import asyncio
import inspect
import logging

import pytest
import torch
from transformers import DynamicCache

from artrl.config import EngineConfig
from artrl.local.engine.hf.engine import HFEngine
from artrl.local.engine.hf.fused_decode import FusedDecode
from artrl.local.engine.hf.kv_cache import BatchCache
from artrl.local.engine.hf.sampling import SamplingParams
from artrl.local.kernels.cpu_attention import use_cpu_attention
from artrl.local.kernels.merged_lora import MergedLora

SHAPE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
)


def _model(architecture: str, dtype: torch.dtype):
    import transformers as tf

    if architecture == "llama":  # biases everywhere, llama3 rope scaling, untied head
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}
        rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        config = tf.LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True, rope_parameters=rope)
        cls = tf.LlamaForCausalLM
    elif architecture == "qwen2":  # q/k/v biases, tied head
        config = tf.Qwen2Config(**SHAPE, tie_word_embeddings=True)
        cls = tf.Qwen2ForCausalLM
    elif architecture == "qwen3":  # q/k norms
        config = tf.Qwen3Config(**SHAPE)
        cls = tf.Qwen3ForCausalLM
    else:
        config = tf.MistralConfig(**SHAPE, sliding_window=None)
        cls = tf.MistralForCausalLM
    torch.manual_seed(0)
    model = cls(config).to(dtype).eval()
    with torch.no_grad():  # biases and norm weights away from their 0/1 initialisation
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    use_cpu_attention(model)
    return model


def _lora(model):
    from fakes import adapted

    return adapted(model, rank=4, alpha=8)


def _cache(model, dtype, rows: int, length: int) -> BatchCache:
    config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    g = torch.Generator().manual_seed(1)
    shape = (rows, config.num_key_value_heads, length, config.head_dim)
    states = [
        [torch.randn(shape, generator=g).to(dtype) for _ in range(config.num_hidden_layers)] for _ in "kv"
    ]
    return BatchCache.from_states(*states)


def _hf_step(model, ids, positions, mask, cache: BatchCache) -> torch.Tensor:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{name: cache.cache()},
    )
    return out.logits[:, -1]


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("adapter", ["none", "lora", "merged lora"])
def test_the_fused_step_gives_the_forwards_logits_and_cache(architecture, dtype, tolerance, adapter):
    model = _model(architecture, dtype)
    if adapter != "none":
        model = _lora(model)
    if adapter == "merged lora":  # the engine's inference form
        merged = MergedLora.of(model)
        assert merged is not None
        merged.merge()
    fused = FusedDecode.of(model)
    assert fused is not None
    rows, length = 3, 20
    ids = torch.tensor([[5], [77], [299]])
    mask = torch.ones(rows, length + 1, dtype=torch.long)
    mask[1, :7] = 0  # a left-padded row
    positions = (mask.sum(1, keepdim=True) - 1) + torch.tensor([[0], [0], [90]])  # a row far ahead
    expected_cache, fused_cache = _cache(model, dtype, rows, length), _cache(model, dtype, rows, length)
    with torch.inference_mode():
        expected = _hf_step(model, ids, positions, mask, expected_cache).float()
        fused.build()
        got = fused(ids, positions, mask, fused_cache).float()
    assert got.shape == expected.shape == (rows, SHAPE["vocab_size"])
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= tolerance * scale, (got - expected).abs().max()
    for a, b in zip(expected_cache.layers, fused_cache.layers, strict=True):
        assert a.keys.shape == b.keys.shape == (rows, 2, length + 1, 32)
        torch.testing.assert_close(b.keys.float(), a.keys.float(), atol=tolerance * 4, rtol=tolerance)
        torch.testing.assert_close(b.values.float(), a.values.float(), atol=tolerance * 4, rtol=tolerance)


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("cached", [0, 12])
def test_the_fused_prefill_gives_the_forwards_logits_and_states(architecture, dtype, tolerance, cached):
    """S new tokens per row on top of P cached ones, as the running batch prefills: a row with its whole
    cached start, one with less (left padding among the cached columns), one with fewer new tokens than S
    (padding queries, which attend to nothing)."""
    model = _model(architecture, dtype)
    fused = FusedDecode.of(model)
    assert fused is not None
    rows, new = 3, 7
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, SHAPE["vocab_size"], (rows, new), generator=g)
    mask = torch.ones(rows, cached + new, dtype=torch.long)
    mask[1, : cached // 2] = 0  # fewer cached tokens
    mask[2, : cached + 3] = 0  # nothing cached and 4 new tokens: 3 padding queries
    ids[2, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, cached:]  # (R, S)
    past = _cache(model, dtype, rows, cached) if cached else None
    with torch.inference_mode():
        states = (
            [(k.clone(), v.clone()) for k, v in zip(past.key_states(), past.value_states(), strict=True)]
            if past
            else []
        )
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        cache = (
            DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in states])
            if states
            else DynamicCache()
        )
        expected = (
            model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{name: cache})
            .logits[:, -1]
            .float()
        )
        fused.build()
        got, keys, values = fused.prefill(ids, positions, mask, states)
    scale = expected.abs().max()
    assert (got.float() - expected).abs().max() <= tolerance * scale
    real = mask.bool()[:, None, :, None]  # (R, 1, P + S, 1) the rows' own tokens (padding may differ)
    for layer, k, v in zip(cache.layers, keys, values, strict=True):
        assert k.shape == v.shape == layer.keys.shape == (rows, 2, cached + new, 32)
        for ours, theirs in ((k, layer.keys), (v, layer.values)):
            torch.testing.assert_close(
                torch.where(real, ours, 0).float(), torch.where(real, theirs, 0).float(),
                atol=tolerance * 4, rtol=tolerance,
            )  # fmt: skip
            assert ours.isfinite().all()
            # tensors of their own (the prefix cache keeps them and counts their bytes), not views of more
            assert ours.untyped_storage().nbytes() == ours.numel() * ours.element_size()


def test_other_layouts_keep_the_transformers_forward(caplog):
    import transformers as tf

    sliding = tf.MistralForCausalLM(tf.MistralConfig(**SHAPE, sliding_window=16))
    gelu = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE, hidden_act="gelu"))
    gemma = tf.Gemma2ForCausalLM(tf.Gemma2Config(**SHAPE))
    with caplog.at_level(logging.INFO, logger="artrl.local.engine.hf.fused_decode"):
        assert [FusedDecode.of(m) for m in (sliding, gelu, gemma)] == [None, None, None]
    assert "sliding-window" in caplog.text and "activation 'gelu'" in caplog.text

    from fakes import LORA_TARGETS
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(
        _model("qwen3", torch.float32), LoraConfig(r=4, target_modules=LORA_TARGETS, use_dora=True)
    )
    fused = FusedDecode.of(dora)
    assert fused is not None
    with pytest.raises(TypeError, match="DoRA"):
        fused.build()  # (the engine then logs it and decodes through the forward)


async def _greedy(engine: HFEngine, prompts: list[list[int]]) -> list[list[int]]:
    async def one(prompt):
        stream = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0), 1)[0]
        return [c.token_id async for c in stream]

    return list(await asyncio.gather(*map(one, prompts)))


async def test_the_engine_decodes_the_same_and_follows_a_weight_change(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    def load():
        model = _lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
        use_cpu_attention(model)
        return model

    prompts = [list(range(10, 40)), [5, 17, 300, 42], list(range(200, 260))]
    fused = HFEngine(load(), max_context=512, config=EngineConfig())
    plain = HFEngine(load(), max_context=512, config=EngineConfig(fused_decode=False))
    assert fused._fused is not None and plain._fused is None

    def train(model):  # a "training step": the adapter's weights change
        def step():
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.add_(0.5)

        return step

    try:
        before = await _greedy(fused, prompts)
        assert before == await _greedy(plain, prompts)
        assert fused._fused is not None and fused._fused.ready  # it decoded them
        await fused.run_exclusive(train(fused.model))
        await plain.run_exclusive(train(plain.model))
        after = await _greedy(fused, prompts)
        assert after == await _greedy(plain, prompts)
        assert after != before  # the new weights, not the fused copy of the old ones
    finally:
        await fused.close()
        await plain.close()


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 512])  # (512: weights large enough to be packed for oneDNN)
def test_the_scripted_layers_give_the_eager_steps(architecture, dtype, hidden):
    """scripted_layers (one TorchScript call per step) against the eager layers, step after step, past the
    buffers' room (they grow): the same logits and the same cache."""
    global SHAPE
    saved = SHAPE
    SHAPE = {**SHAPE, "hidden_size": hidden, "intermediate_size": 3 * hidden}
    try:
        model = _model(architecture, dtype)
    finally:
        SHAPE = saved
    scripted, eager = FusedDecode.of(model), FusedDecode(model, script=False)
    assert scripted is not None
    rows, length = 3, 20
    caches = _cache(model, dtype, rows, length), _cache(model, dtype, rows, length)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, :7] = 0  # a left-padded row
    with torch.inference_mode():
        scripted.build()
        eager.build()
        assert scripted._flat is not None and eager._flat is not None
        assert isinstance(scripted._flat.decode, torch.jit.ScriptFunction)
        assert not isinstance(eager._flat.decode, torch.jit.ScriptFunction)  # (the same function, eagerly)
        if hidden == 512 and scripted._pack:
            assert any(scripted._flat.packed)  # (packed products in the scripted calls)
        ids = torch.tensor([[5], [77], [299]])
        for _ in range(70):  # (the buffers' room is 64 columns: they grow on the way)
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
            positions = mask.sum(1, keepdim=True) - 1
            got = scripted(ids, positions, mask, caches[0])
            want = eager(ids, positions, mask, caches[1])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            ids = got.argmax(-1, keepdim=True)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert a.length == b.length == length + 70
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
        assert not a.key_buffer[:rows, :, a.length :].any()  # (the room stays zeros)
    # a prefill of 9 new tokens per row on top of the cached ones (the second row left-padded)
    new = torch.randint(10, 290, (rows, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.cat([mask, mask.new_ones(rows, 9)], dim=1)
    positions = mask.sum(1, keepdim=True) - 9 + torch.arange(9)
    past = list(zip(caches[0].key_states(), caches[0].value_states(), strict=True))
    with torch.inference_mode():
        got, want = scripted.prefill(new, positions, mask, past), eager.prefill(new, positions, mask, past)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(got[1] + got[2], want[1] + want[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_failed_scripted_step_leaves_the_cache_as_it_was():
    model = _model("qwen3", torch.float32)
    fused = FusedDecode.of(model)
    assert fused is not None
    rows, length = 2, 10
    cache = _cache(model, torch.float32, rows, length)
    before = [layer.key_buffer.clone() for layer in cache.layers]
    wrong = torch.ones(
        rows, length + 2, dtype=torch.long
    )  # one column too many: the first layer's attention fails
    with torch.inference_mode():
        fused.build()
        with pytest.raises(RuntimeError):
            fused(torch.tensor([[5], [6]]), torch.tensor([[10], [10]]), wrong, cache)
    for layer, old in zip(cache.layers, before, strict=True):
        assert layer.length == length
        assert torch.equal(layer.key_buffer, old)  # (the column the first layer wrote is zeros again)


def test_a_step_failing_in_a_later_layer_leaves_every_layer_as_it_was():
    model = _model("llama", torch.bfloat16)
    fused = FusedDecode.of(model)
    assert fused is not None
    rows, length = 2, 10
    cache = _cache(model, torch.bfloat16, rows, length)
    before = [(layer.key_buffer.clone(), layer.value_buffer.clone()) for layer in cache.layers]
    with torch.inference_mode():
        fused.build()
        assert isinstance(fused._flat.decode, torch.jit.ScriptFunction)
        weights = list(fused._flat.weights)
        weights[5] = weights[5][:, :-1]  # the second layer's o product no longer fits its input
        fused._flat = fused._flat._replace(weights=weights)
        mask = torch.ones(rows, length + 1, dtype=torch.long)
        with pytest.raises(RuntimeError):
            fused(torch.tensor([[5], [6]]), torch.tensor([[10], [10]]), mask, cache)
    for layer, (keys, values) in zip(cache.layers, before, strict=True):
        assert layer.length == length
        assert torch.equal(layer.key_buffer, keys) and torch.equal(layer.value_buffer, values)
