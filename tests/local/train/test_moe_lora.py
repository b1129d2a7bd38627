"""A mixture-of-experts base (transformers 5 keeps each layer's experts as fused 3-D weights, not Linear
modules): artrl's default LoRA adapts the experts too (PEFT maps gate_proj/up_proj/down_proj onto the fused
gate_up_proj/down_proj), never the router, trains them, serves what it trains and resumes it."""

from __future__ import annotations

import shutil

import pytest
import torch

import artrl

ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny_moe_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("moe") / "tiny-moe"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    config = AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=64,
        intermediate_size=192,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=2048,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


async def test_the_default_lora_of_a_moe_adapts_attention_and_experts_not_the_router(tiny_moe_dir, tmp_path):
    path = tmp_path / "runs"
    async with artrl.LocalBackend(path=path) as backend:
        model = artrl.TrainableModel(name="moe", project="p", base_model=str(tiny_moe_dir))
        await model.register(backend)
        trained = {n for n, p in backend.service(model).model.named_parameters() if p.requires_grad}
        layer = [n.split("layers.0.")[1] for n in trained if "layers.0." in n]
        assert {n.split(".lora_")[0] for n in layer} == {
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.experts",  # the two fused expert weights (gate_up_proj, down_proj):
            "mlp.experts.base_layer",  # PEFT wraps one inside the other
        }
        assert not [n for n in trained if ".mlp.gate." in n]  # the router stays the base's
        client = model.openai_client()
        choices = [
            (await client.chat.completions.create(model="moe", messages=ASK, max_tokens=6, seed=i)).choices[0]
            for i in range(4)
        ]
        group = artrl.TrajectoryGroup(
            artrl.Trajectory(messages_and_choices=[*ASK, c], reward=float(i % 2))
            for i, c in enumerate(choices)
        )
        before = {
            n: p.detach().clone() for n, p in backend.service(model).model.named_parameters() if n in trained
        }
        result = await model.train([group], config=artrl.TrainConfig(learning_rate=1e-2))
        assert result.metrics["logprob_mismatch_max"] < 1e-3  # the engine served the adapter it trains
        moved = {
            n
            for n, p in backend.service(model).model.named_parameters()
            if n in trained and not torch.equal(p, before[n])
        }
        assert any(".mlp.experts.lora_B" in n for n in moved) and any("base_layer.lora_B" in n for n in moved)
        after = (
            await client.chat.completions.create(model="moe", messages=ASK, max_tokens=6, temperature=0)
        ).choices[0]
    async with artrl.LocalBackend(path=path) as backend:
        again = artrl.TrainableModel(name="moe", project="p", base_model=str(tiny_moe_dir))
        await again.register(backend)
        resumed = (
            await again.openai_client().chat.completions.create(
                model="moe", messages=ASK, max_tokens=6, temperature=0
            )
        ).choices[0]
        assert resumed.model_extra["token_ids"] == after.model_extra["token_ids"]
        assert resumed.model_extra["token_logprobs"] == pytest.approx(
            after.model_extra["token_logprobs"], abs=1e-4
        )
