"""GRPO training end to end on the tiny model: rollouts through the gateway → train → the served model
changes; checkpoints, history, resume, bad input."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch
from scored_rollouts import PROMPT, rollouts

import artrl
import artrl.storage
from artrl.local.train.rows import UntrackedTurnsError


@pytest.fixture
async def trained(tiny_model_dir, tmp_path):
    """A fresh backend + model per test (training changes weights); yields (model, backend)."""
    backend = artrl.LocalBackend(path=tmp_path / "artrl")
    model = artrl.TrainableModel(name="tiny", project="train", base_model=str(tiny_model_dir))
    await model.register(backend)
    yield model, backend
    await backend.close()


def trainable(backend, model) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone() for n, p in backend.service(model).model.named_parameters() if p.requires_grad
    }


async def test_one_step_updates_the_adapter_and_the_served_model(trained):
    model, backend = trained
    client = model.openai_client()
    probe = {"model": model.name, "messages": PROMPT, "max_tokens": 6, "temperature": 0.0}
    before_probe = (await client.chat.completions.create(**probe)).choices[0]
    before = trainable(backend, model)
    assert before and all("lora_" in n for n in before)
    result = await model.train(
        [await rollouts(model, [1, 0, 0, 1])], config=artrl.TrainConfig(learning_rate=1e-2)
    )
    assert result.step == 1 and await model.get_step() == 1
    assert result.metrics["optimizer_steps"] == 1 and result.metrics["rows"] == 4
    after = trainable(backend, model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    # LoRA starts with B = 0, so ∂L/∂A = Bᵀ·(…) = 0 on the very first step: every B moves, every A cannot yet
    assert changed == {n for n in before if "lora_B" in n}
    await model.train([await rollouts(model, [0, 1, 1, 0])], config=artrl.TrainConfig(learning_rate=1e-2))
    final = trainable(backend, model)
    assert all(not torch.equal(before[n], final[n]) for n in before), "every LoRA parameter changed by step 2"
    # the very next request is served by the updated weights
    after_probe = (await client.chat.completions.create(**probe)).choices[0]
    assert after_probe.token_ids != before_probe.token_ids or after_probe.token_logprobs != pytest.approx(
        before_probe.token_logprobs, abs=1e-6
    )


async def test_equal_rewards_change_nothing_but_the_step_is_recorded(trained):
    model, backend = trained
    before = trainable(backend, model)
    result = await model.train([await rollouts(model, [0.5, 0.5, 0.5])])
    assert result.step == 1 and result.metrics["groups_zero_variance"] == 1 and result.metrics["rows"] == 0
    after = trainable(backend, model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    directory = backend.directory(model)
    assert (directory / "checkpoints" / "0001" / "adapter_model.safetensors").exists()
    assert (directory / "trajectories" / "train" / "0001.jsonl").exists()
    history = [json.loads(line) for line in (directory / "history.jsonl").read_text().splitlines()]
    assert history[-1]["step"] == 1 and history[-1]["split"] == "train"


async def test_files_resume_and_peft_loading(tiny_model_dir, tmp_path):
    path = tmp_path / "artrl"
    async with artrl.LocalBackend(path=path) as backend:
        model = artrl.TrainableModel(name="tiny", project="resume", base_model=str(tiny_model_dir))
        await model.register(backend)
        await model.train([await rollouts(model, [1, 0])], config=artrl.TrainConfig(learning_rate=1e-2))
        await model.train([await rollouts(model, [0, 1])], config=artrl.TrainConfig(learning_rate=1e-2))
        saved = trainable(backend, model)
        await model.log([await rollouts(model, [1, 0])], split="val")
    async with artrl.LocalBackend(path=path) as backend:
        again = artrl.TrainableModel(name="tiny", project="resume", base_model=str(tiny_model_dir))
        await again.register(backend)
        assert await again.get_step() == 2
        restored = trainable(backend, again)
        assert all(torch.equal(saved[n], restored[n]) for n in saved)
        assert backend.service(again).trainer.optimizer.state, "optimizer state restored"
        result = await again.train([await rollouts(again, [1, 0])])
        assert result.step == 3
    directory = path / "resume" / "tiny"
    history = [json.loads(line) for line in (directory / "history.jsonl").read_text().splitlines()]
    assert [(h["step"], h["split"]) for h in history] == [
        (1, "train"),
        (2, "train"),
        (2, "val"),
        (3, "train"),
    ]
    assert (directory / "trajectories" / "val" / "0002.jsonl").exists()
    group = artrl.TrajectoryGroup.model_validate_json(
        (directory / "trajectories/train/0001.jsonl").read_text()
    )
    assert group.trajectories[0].choices()[0].token_ids  # ids survive on disk

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), directory / "checkpoints/0002"
    )
    loaded = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[n], saved[n]) for n in saved)


async def test_full_finetuning_changes_every_parameter(tiny_model_dir, tmp_path):
    async with artrl.LocalBackend(path=tmp_path) as backend:
        model = artrl.TrainableModel(name="full", project="t", base_model=str(tiny_model_dir), lora=None)
        await model.register(backend)
        before = trainable(backend, model)
        await model.train([await rollouts(model, [1, 0, 1, 0])], config=artrl.TrainConfig(learning_rate=1e-3))
        after = trainable(backend, model)
        assert len(before) == len(list(backend.service(model).model.parameters()))
        assert all(not torch.equal(before[n], after[n]) for n in before)
    async with artrl.LocalBackend(path=tmp_path) as backend:
        again = artrl.TrainableModel(name="full", project="t", base_model=str(tiny_model_dir), lora=None)
        await again.register(backend)
        assert all(torch.equal(after[n], p) for n, p in trainable(backend, again).items())


async def test_kl_penalty_and_cispo_run(trained):
    """A fresh LoRA is the base model (KL exactly 0 whether or not the KL path is wired): measure KL after
    a step has moved the adapter, where it must be positive."""
    model, _ = trained
    first = await model.train([await rollouts(model, [1, 0])], config=artrl.TrainConfig(learning_rate=1e-2))
    assert first.metrics["kl"] == 0.0  # not asked for: not computed
    kl = await model.train(
        [await rollouts(model, [1, 0])], config=artrl.TrainConfig(learning_rate=1e-2, kl_coef=0.1)
    )
    assert kl.metrics["kl"] > 0
    cispo = await model.train(
        [await rollouts(model, [1, 0])], config=artrl.TrainConfig(loss="cispo", tis_cap=2.0)
    )
    assert cispo.step == 3 and cispo.metrics["logprob_mismatch_mean"] < 1e-3


async def test_rollouts_keep_running_while_training(trained):
    model, _ = trained
    group = await rollouts(model, [1, 0, 1, 0])
    busy = asyncio.create_task(rollouts(model, [0] * 8, max_tokens=64))
    await model.train([group], config=artrl.TrainConfig(learning_rate=1e-2))
    assert len(await busy) == 8


async def test_bad_input_is_an_error_before_anything_is_written(trained):
    model, backend = trained
    with pytest.raises(ValueError, match="no groups"):
        await model.train([])
    with pytest.raises(ValueError, match="finite"):
        await model.train([await rollouts(model, [1.0, float("nan")])])
    foreign = artrl.TrajectoryGroup(
        [
            artrl.Trajectory(messages_and_choices=[*PROMPT, {"role": "assistant", "content": "x"}], reward=r)
            for r in (0, 1)
        ]
    )
    with pytest.raises(UntrackedTurnsError):
        await model.train([foreign])
    assert await model.get_step() == 0
    assert not (backend.directory(model) / "trajectories").exists()
    # a group of one carries no signal: skipped and counted, the step still happens
    result = await model.train([await rollouts(model, [1.0]), await rollouts(model, [1, 0])])
    assert result.metrics["groups_skipped_too_small"] == 1 and result.metrics["rows"] == 2
    # opting in trains re-rendered turns
    opted = await model.train([foreign], config=artrl.TrainConfig(allow_rendered_turns=True))
    assert opted.metrics["rows"] == 2


async def test_rows_longer_than_the_context_are_skipped(tiny_model_dir, tmp_path):
    backend = artrl.LocalBackend(path=tmp_path, engine=artrl.EngineConfig(max_context=64))
    async with backend:
        model = artrl.TrainableModel(name="short", project="t", base_model=str(tiny_model_dir))
        await model.register(backend)
        group = await rollouts(model, [1, 0], max_tokens=8)
        long_choice = group.trajectories[0].choices()[0].model_copy()
        long_choice.prompt_token_ids = list(range(10, 100))  # type: ignore[attr-defined]
        group.trajectories[0].messages_and_choices[-1] = long_choice
        result = await model.train([group])
        assert result.metrics["rows_skipped_too_long"] == 1 and result.metrics["rows"] == 1


async def test_a_history_row_lost_in_a_crash_is_restored_from_the_checkpoint(tiny_model_dir, tmp_path):
    async with artrl.LocalBackend(path=tmp_path) as backend:
        model = artrl.TrainableModel(name="h", project="t", base_model=str(tiny_model_dir))
        await model.register(backend)
        result = await model.train([await rollouts(model, [1, 0])])
    history = tmp_path / "t" / "h" / "history.jsonl"
    history.write_text(history.read_text()[:-20])  # a torn last line, as a kill mid-append leaves it
    async with artrl.LocalBackend(path=tmp_path) as backend:
        await artrl.TrainableModel(name="h", project="t", base_model=str(tiny_model_dir)).register(backend)
    rows = artrl.storage.read_history(tmp_path / "t" / "h")
    assert [(r["step"], r["split"]) for r in rows] == [(1, "train")]
    assert rows[0]["rows"] == result.metrics["rows"]


def test_chunked_logprobs_equal_full_logits(tiny_model_dir):
    """The lm_head runs in chunks under checkpointing: values and gradients equal the plain computation."""
    from transformers import AutoModelForCausalLM

    from artrl.local.train.adapters import attach_adapter
    from artrl.local.train.logprobs import token_logprobs
    from artrl.local.train.pack import collate
    from artrl.local.train.rows import Row

    model = attach_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), artrl.LoraConfig())
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # a non-trivial adapter
    rows = [
        Row(list(range(5, 40)), [0] * 10 + [1] * 25, [0.0] * 35, advantage=1.0),
        Row(list(range(50, 70)), [0] * 5 + [1] * 15, [0.0] * 20, advantage=-1.0),
    ]
    batch = collate(rows, torch.device("cpu"))
    results = []
    for chunk in (7, 10_000):
        model.zero_grad()
        lp, _ = token_logprobs(model, batch, chunk)  # (B, T-1)
        (lp * batch.mask).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results.append((lp.detach(), grads))
    logits = model(input_ids=batch.ids, attention_mask=batch.attention).logits[:, :-1]  # (B, T-1, V)
    reference = torch.log_softmax(logits, -1).gather(-1, batch.ids[:, 1:, None])[..., 0]
    trained = batch.mask.bool()
    assert torch.allclose(results[0][0][trained], reference[trained], atol=1e-5)
    assert (results[0][0][~trained] == 0).all()  # only trainable positions go through the lm_head
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    # same math, another fp32 summation order (chunks): equal up to rounding, relative to the gradient's size
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()) + 1e-7)


def test_a_bf16_base_trains_its_fp32_adapter_under_autocast(tiny_model_dir):
    """bf16 base weights: the forward runs under bf16 autocast, so the fp32 LoRA's products run in bf16 too
    (the skinny fp32 products were ~40% of a bf16 step on a CPU); its weights and gradients stay fp32, the
    logprobs stay fp32 and within bf16 rounding of the products in fp32, and chunks change nothing."""
    from transformers import AutoModelForCausalLM

    from artrl.local.train.adapters import attach_adapter
    from artrl.local.train.logprobs import token_logprobs
    from artrl.local.train.pack import collate
    from artrl.local.train.rows import Row

    def build(dtype: torch.dtype):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
        model = attach_adapter(model, artrl.LoraConfig())
        torch.manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        return model

    half = build(torch.bfloat16)
    seen: list[torch.dtype] = []
    lora_a = next(m for n, m in half.named_modules() if n.endswith("q_proj.lora_A.default"))
    lora_a.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    rows = [Row(list(range(5, 40)), [0] * 10 + [1] * 25, [0.0] * 35, advantage=1.0)]
    batch = collate(rows, torch.device("cpu"))
    lp, _ = token_logprobs(half, batch, 10_000)  # (B, T-1)
    (lp * batch.mask).sum().backward()
    assert seen == [torch.bfloat16] and lp.dtype == torch.float32
    adapter = [p for p in half.parameters() if p.requires_grad]
    assert all(
        p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32 for p in adapter
    )
    assert any(float(p.grad.abs().max()) > 0 for p in adapter)
    # the same bf16 weights without autocast (the adapter's products in fp32): equal up to bf16 rounding
    with torch.no_grad():
        logits = half(input_ids=batch.ids, attention_mask=batch.attention).logits[:, :-1].float()
    reference = torch.log_softmax(logits, -1).gather(-1, batch.ids[:, 1:, None])[..., 0]  # (B, T-1)
    trained = batch.mask.bool()
    difference = (lp.detach() - reference)[trained].abs()
    assert float(difference.mean()) < 0.01 and float(difference.max()) < 0.05  # nats (seen: 0.002, 0.005)
    chunked, _ = token_logprobs(half, batch, 7)
    # the head's product in chunks of 7 rows may take another kernel (another summation order) than all rows
    # at once; accumulated in fp32 and rounded once to bf16, a logit then differs by at most one bf16 ulp
    # (2^-7 relative), the logprob (the logit minus the log-sum-exp of all of them) by at most two
    ulp = 2.0**-7 * float(logits.abs().max())
    assert torch.allclose(chunked[trained], lp.detach()[trained], atol=2 * ulp)


async def test_models_registered_at_once_all_load(tiny_model_dir, tmp_path):
    """Three `register` calls gathered on one backend: each model loads (transformers' meta-device loading is
    process-wide, so loads take turns) and serves."""
    async with artrl.LocalBackend(path=tmp_path / "artrl") as backend:
        models = [
            artrl.TrainableModel(name=f"m{i}", project="p", base_model=str(tiny_model_dir)) for i in range(3)
        ]
        await asyncio.gather(*(m.register(backend) for m in models))
        groups = await asyncio.gather(*(rollouts(m, [1.0, 0.0], max_tokens=4) for m in models))
        assert all(len(g.trajectories) == 2 for g in groups)


@pytest.mark.parametrize("architecture", ["qwen3", "mistral_sliding", "gpt_oss", "gemma2"])
def test_right_padded_rows_train_without_a_mask_and_give_the_masked_results(architecture):
    """`collate` pads rows on the right, so token_logprobs hands the decoder no mask (causal attention alone):
    logprobs and gradients equal a forward with the padding mask, for sliding windows and attention sinks
    too; a batch padded on the left keeps its mask."""
    import transformers as tf

    from artrl.local.kernels.cpu_attention import use_cpu_attention
    from artrl.local.train.logprobs import _padding_mask, token_logprobs
    from artrl.local.train.pack import collate
    from artrl.local.train.rows import Row

    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    shape |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    config, cls = {
        "qwen3": (tf.Qwen3Config(**shape), tf.Qwen3ForCausalLM),
        "mistral_sliding": (tf.MistralConfig(**shape, sliding_window=8), tf.MistralForCausalLM),
        "gpt_oss": (
            tf.GptOssConfig(**shape, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
            tf.GptOssForCausalLM,
        ),
        "gemma2": (tf.Gemma2Config(**shape, sliding_window=8), tf.Gemma2ForCausalLM),
    }[architecture]
    torch.manual_seed(0)
    model = cls(config)
    use_cpu_attention(model)
    rows = [
        Row(list(range(5, 40)), [0] * 10 + [1] * 25, [0.0] * 35, advantage=1.0),
        Row(list(range(50, 70)), [0] * 5 + [1] * 15, [0.0] * 20, advantage=-1.0),
    ]
    batch = collate(rows, torch.device("cpu"))
    assert _padding_mask(batch.attention) is None
    lp, _ = token_logprobs(model, batch, None)  # (B, T-1)
    (lp * batch.mask).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=batch.ids, attention_mask=batch.attention).logits[:, :-1]  # (B, T-1, V)
    reference = torch.log_softmax(logits.float(), -1).gather(-1, batch.ids[:, 1:, None])[..., 0]
    (reference * batch.mask).sum().backward()
    trained = batch.mask.bool()
    assert torch.allclose(lp[trained], reference[trained], atol=1e-5)
    for mine, theirs in zip(grads, (p.grad for p in model.parameters()), strict=True):
        if theirs is not None:
            assert torch.allclose(mine, theirs, atol=1e-5 * float(theirs.abs().max()) + 1e-8)
    left = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert _padding_mask(left) is left and _padding_mask(torch.tensor([[1, 0, 1]])) is not None


@pytest.mark.parametrize("architecture", ["gemma2", "cohere", "granite"])
def test_the_trainers_logprobs_are_the_models_own_after_its_head_transform(architecture):
    """token_logprobs calls the lm_head itself: the model's soft-capping (Gemma) or logit scaling (Cohere,
    Granite) is applied as its forward does, so the trainer's logprobs are those the engine samples from."""
    import transformers as tf

    from artrl.local.train.logprobs import token_logprobs
    from artrl.local.train.pack import collate
    from artrl.local.train.rows import Row

    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    shape |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    config, cls = {
        "gemma2": (tf.Gemma2Config(**shape, final_logit_softcapping=2.0), tf.Gemma2ForCausalLM),
        "cohere": (tf.CohereConfig(**shape, logit_scale=0.25), tf.CohereForCausalLM),
        "granite": (tf.GraniteConfig(**shape, logits_scaling=4.0), tf.GraniteForCausalLM),
    }[architecture]
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # logits large enough for the transform to matter
        model.get_output_embeddings().weight.mul_(50.0)
    batch = collate([Row(list(range(5, 40)), [0] * 10 + [1] * 25, [0.0] * 35)], torch.device("cpu"))
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch, None)  # (1, T-1)
        logits = model(input_ids=batch.ids).logits[:, :-1].float()  # (1, T-1, V)
    reference = torch.log_softmax(logits, -1).gather(-1, batch.ids[:, 1:, None])[..., 0]
    plain = torch.log_softmax(
        model.get_output_embeddings()(model.model(batch.ids).last_hidden_state[:, :-1]), -1
    )
    plain = plain.gather(-1, batch.ids[:, 1:, None])[..., 0]
    trained = batch.mask.bool()
    assert torch.allclose(lp[trained], reference[trained], atol=1e-4)
    assert not torch.allclose(plain[trained], reference[trained], atol=1e-2)  # (the transform matters here)


def test_a_model_that_does_more_after_its_head_trains_on_its_own_forwards_logits(caplog):
    """HyperCLOVAX multiplies its logits by `logits_scaling` (Granite divides by a field of that name): the
    first training call sees that the head alone does not give the model's logits, says so, and takes them
    from the model's whole forward; the recorded trainer logprobs are then the model's own."""
    import transformers as tf

    from artrl.local.train.adapters import attach_adapter
    from artrl.local.train.batch import TrainingBatch
    from artrl.local.train.logprobs import head_is_the_models
    from artrl.local.train.pack import collate
    from artrl.local.train.rows import Row
    from artrl.local.train.trainer import Trainer

    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    shape |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    torch.manual_seed(0)
    plain = tf.Qwen3ForCausalLM(tf.Qwen3Config(**shape))
    assert head_is_the_models(plain)
    model = tf.HyperCLOVAXForCausalLM(tf.HyperCLOVAXConfig(**shape, logits_scaling=4.0))
    assert not head_is_the_models(model)
    trainer = Trainer(attach_adapter(model, artrl.LoraConfig()), pad_id=0, share_prompts=True)
    row = Row(list(range(5, 40)), [0] * 10 + [1] * 25, [-1.0] * 35, advantage=1.0)
    batch = TrainingBatch(rows=[row])
    with caplog.at_level("WARNING"):
        trainer.step(batch, artrl.TrainConfig(learning_rate=1e-9))
    assert "from the model's whole forward" in caplog.text and not trainer.share_prompts
    mb = collate([row], torch.device("cpu"))
    with torch.no_grad():
        logits = trainer.model(input_ids=mb.ids).logits[:, :-1].float()
    reference = torch.log_softmax(logits, -1).gather(-1, mb.ids[:, 1:, None])[0, :, 0]  # (T-1,)
    recorded = torch.tensor([math.nan if v is None else v for v in batch.trainer_logprobs[0][1:]])
    trained = mb.mask[0].bool()
    assert torch.allclose(recorded[trained], reference[trained], atol=1e-4)
