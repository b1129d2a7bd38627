"""Rows that share a prompt train with it computed once (TrainerConfig.share_prompts): the same logprobs,
gradients and updates as the rows computed whole, for full and sliding-window attention, attention sinks,
LoRA (fused) and bf16; the packing that groups such rows; where sharing stops."""

from __future__ import annotations

import random

import pytest
import torch
from tolerances import assert_same_adamw_update

import artrl
from artrl.local.train.adapters import attach_adapter
from artrl.local.train.batch import TrainingBatch
from artrl.local.train.logprobs import shares_prefixes, token_logprobs
from artrl.local.train.pack import collate, pack, pack_by_prompt, shared_prompt
from artrl.local.train.rows import Row
from artrl.local.train.trainer import Trainer

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
SHAPE |= dict(num_key_value_heads=2, head_dim=32, max_position_embeddings=512)


def _model(architecture: str, dtype: torch.dtype = torch.float32):
    import transformers as tf

    config, cls = {
        "qwen3": (tf.Qwen3Config(**SHAPE), tf.Qwen3ForCausalLM),
        "llama": (tf.LlamaConfig(**SHAPE, attention_bias=True), tf.LlamaForCausalLM),
        "mistral_sliding": (tf.MistralConfig(**SHAPE, sliding_window=16), tf.MistralForCausalLM),
        "gpt_oss": (
            tf.GptOssConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
            tf.GptOssForCausalLM,
        ),
    }[architecture]
    torch.manual_seed(0)
    model = attach_adapter(cls(config).to(dtype), artrl.LoraConfig(rank=4, alpha=8))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    from artrl.local.kernels.cpu_attention import use_cpu_attention

    use_cpu_attention(model)
    return model


def group_rows(n: int = 4, prompt: int = 100, seed: int = 0) -> list[Row]:
    """A group's rows: one prompt (mask 0), then each row's own turns (sampled, a tool result, sampled)."""
    rng = random.Random(seed)
    shared = [rng.randrange(300) for _ in range(prompt)]
    rows = []
    for k in range(n):
        row = Row(advantage=(-1.0) ** k * (k + 1) / n, weight=1.0 / (1 + k % 2))
        row.extend(shared, sampled=False)
        for _turn in range(1 + k % 2):
            length = rng.randrange(5, 30)
            row.extend(
                [rng.randrange(300) for _ in range(length)], True, [-rng.random() * 3 for _ in range(length)]
            )
            row.extend([rng.randrange(300) for _ in range(7)], sampled=False)
        rows.append(row)
    return rows


def logprobs_and_grads(model, rows: list[Row], shared: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    batch = collate(rows, torch.device("cpu"), shared=shared)
    lp, entropy = token_logprobs(model, batch, None)  # (B, T-1) each
    (lp * batch.mask * batch.advantages[:, None]).sum().backward()
    return torch.stack([lp.detach(), entropy]), [
        p.grad.clone() for p in model.parameters() if p.requires_grad
    ]


@pytest.mark.parametrize("architecture", ["qwen3", "llama", "mistral_sliding", "gpt_oss"])
def test_a_prompt_computed_once_gives_the_whole_rows_logprobs_and_gradients(architecture):
    model = _model(architecture)
    model.train()
    rows = group_rows()
    shared = shared_prompt(rows)
    assert shared == 100  # the prompt, up to the first sampled token
    whole, whole_grads = logprobs_and_grads(model, rows, 0)
    once, once_grads = logprobs_and_grads(model, rows, shared)
    assert torch.allclose(once, whole, atol=2e-5)
    batch = collate(rows, torch.device("cpu"))  # (and both are the model's own logprobs)
    with torch.no_grad():
        logits = model(input_ids=batch.ids, attention_mask=batch.attention).logits[:, :-1]  # (B, T-1, V)
    reference = torch.log_softmax(logits, -1).gather(-1, batch.ids[:, 1:, None])[..., 0]
    trained = batch.mask.bool()
    assert torch.allclose(once[0][trained], reference[trained], atol=2e-5)
    for a, b in zip(once_grads, whole_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()) + 1e-8)


def test_bf16_with_a_shared_prompt_stays_within_bf16_rounding():
    model = _model("qwen3", torch.bfloat16)
    model.train()
    rows = group_rows()
    whole, whole_grads = logprobs_and_grads(model, rows, 0)
    once, once_grads = logprobs_and_grads(model, rows, shared_prompt(rows))
    trained = collate(rows, torch.device("cpu")).mask.bool()
    assert float((once[0] - whole[0])[trained].abs().max()) < 0.05
    for a, b in zip(once_grads, whole_grads, strict=True):
        assert float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)) > 0.99


def test_sharing_stops_at_the_first_trained_target_and_is_checked():
    rows = group_rows(n=8)
    rows[2].mask[60] = 1  # a row with a sampled token inside the others' prompt
    assert shared_prompt(rows) == 60
    assert shared_prompt(rows[:1]) == 0  # (one row: nothing to share)
    assert shared_prompt(group_rows(prompt=20)) == 0  # (too little saved to be worth a pass of its own)
    with pytest.raises(ValueError, match="do not all begin with the same 61 ids"):
        collate(rows, torch.device("cpu"), shared=61)


def test_pack_by_prompt_puts_each_groups_rows_together_within_the_budget():
    groups = [group_rows(n=8, prompt=120, seed=s) for s in range(3)]
    loners = [Row(list(range(s, s + 40)), [0] * 10 + [1] * 30, [0.0] * 40) for s in range(5)]
    rows = [r for g in groups for r in g] + loners
    random.Random(0).shuffle(rows)
    group_of = {id(r): k for k, g in enumerate(groups) for r in g}
    batches = pack_by_prompt(rows, max_tokens=700)
    assert sorted(i for b in batches for i in b) == list(range(len(rows)))
    for batch in batches:
        members = [rows[i] for i in batch]
        kinds = {group_of.get(id(r), "loner") for r in members}
        assert len(kinds) == 1  # never two prompts, nor a group's row with a loner
        if kinds != {"loner"}:
            shared = shared_prompt(members)
            own = max(len(r.ids) for r in members) - shared
            assert shared >= 120 or len(members) == 1
            assert len(members) == 1 or shared + len(members) * own <= 700
    # rows sharing nothing are packed exactly as `pack` packs them
    assert pack_by_prompt(loners, 700) == pack(loners, 700)


def test_a_training_step_with_shared_prompts_equals_one_without():
    """Trainer(share_prompts=True) against False on the same weights: the same metrics and the same update."""
    results = []
    for share in (False, True):
        model = _model("qwen3")
        trainer = Trainer(model, pad_id=0, fused_lora=True, share_prompts=share)
        assert trainer.share_prompts is share
        rows = group_rows(n=6, seed=1) + group_rows(n=6, seed=2)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        config = artrl.TrainConfig(learning_rate=1e-3)
        micro = trainer._micro_batches(rows, config)
        assert [trainer._collate([rows[i] for i in m], config).shared for m in micro] == (
            [100, 100] if share else [0] * len(micro)
        )
        metrics = trainer.step(TrainingBatch(rows=rows), config)
        after = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        results.append((metrics, {n: after[n] - before[n] for n in before}))
    (plain, plain_delta), (shared, shared_delta) = results
    for key in ("loss", "entropy", "ratio_mean", "logprob_mismatch_mean", "grad_norm", "clip_fraction"):
        assert shared[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    assert all(float(delta.abs().max()) > 0 for delta in plain_delta.values())
    assert_same_adamw_update(plain_delta, shared_delta, lr=1e-3)  # (another summation order: tolerances.py)


def test_models_with_recurrent_layers_keep_whole_rows():
    import transformers as tf

    config = tf.Qwen3Config(**SHAPE)
    model = tf.Qwen3ForCausalLM(config)
    assert shares_prefixes(model)
    config.layer_types = ["linear_attention", "full_attention"]
    assert not shares_prefixes(model)
    assert not Trainer(attach_adapter(model, artrl.LoraConfig()), pad_id=0, share_prompts=True).share_prompts


def test_under_gradient_checkpointing_rows_are_packed_and_trained_whole():
    """(activation checkpointing runs the decoder without its cache; the budget then counts whole rows)"""
    trainer = Trainer(_model("qwen3"), pad_id=0, share_prompts=True)
    rows = group_rows(n=8, prompt=120) + group_rows(n=8, prompt=120, seed=1)
    checkpointed = artrl.TrainConfig(gradient_checkpointing=True, max_tokens_per_microbatch=700)
    assert trainer._micro_batches(rows, checkpointed) == pack(rows, 700)
    assert trainer._collate(rows[:8], checkpointed).shared == 0
    plain = artrl.TrainConfig(max_tokens_per_microbatch=700)
    assert trainer._micro_batches(rows, plain) == pack_by_prompt(rows, 700)
    assert trainer._collate(rows[:8], plain).shared == 120
    metrics = trainer.step(TrainingBatch(rows=rows), checkpointed)
    assert metrics["optimizer_steps"] == 1


def test_a_row_sharing_only_a_header_does_not_break_a_groups_sharing():
    """(rows from one chat template all begin alike: a row that shares only that header with a group sorts
    next to it, and must not pull the group's shared prompt down to the header)"""
    group = group_rows(n=8, prompt=200)
    header = group[0].ids[:5]
    assert 0 < group[0].ids[5] < 299
    low, high = (
        Row(header + [t] * 60, [0] * 5 + [1] * 60, [0.0] * 65) for t in (0, 299)
    )  # sorted before, after
    for rows in (group, [low, *group], [*group, high], [high, *group, low]):
        batches = pack_by_prompt(rows, 4096)
        grouped = [b for b in batches if shared_prompt([rows[i] for i in b])]
        assert len(grouped) == 1 and shared_prompt([rows[i] for i in grouped[0]]) == 200, batches
        assert sorted(id(rows[i]) for i in grouped[0]) == sorted(id(r) for r in group)


def test_micro_batches_stay_within_the_budget_as_the_trainer_runs_them():
    """Fuzzed: each micro-batch costs at most max_tokens as trained (the prompt once where the trainer
    shares it, whole rows where it does not), or is a single row; every row in exactly one."""
    rng = random.Random(0)
    for case in range(300):
        rows = []
        for _group in range(rng.randrange(1, 4)):
            prompt_length = rng.choice([10, 100, 400])
            prompt = [rng.randrange(300) for _ in range(prompt_length)]
            for _ in range(rng.randrange(1, 10)):
                own = rng.randrange(1, 600)
                rows.append(
                    Row(prompt + [rng.randrange(300) for _ in range(own)], [0] * prompt_length + [1] * own)
                )
        budget = rng.choice([300, 700, 2000, 4096])
        batches = pack_by_prompt(rows, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(rows))), case
        for batch in batches:
            members = [rows[i] for i in batch]
            shared = shared_prompt(members)
            longest = max(len(r.ids) for r in members)
            cost = shared + len(members) * (longest - shared) if shared else len(members) * longest
            assert len(members) == 1 or cost <= budget, (case, budget, shared, [len(r.ids) for r in members])


def test_stateful_models_keep_whole_rows():
    """(RWKV's forward swallows a cache it does not use, xLSTM's fails on it: their state is recurrent)"""
    import transformers as tf

    rwkv = tf.RwkvForCausalLM(tf.RwkvConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2))
    assert not shares_prefixes(rwkv)
