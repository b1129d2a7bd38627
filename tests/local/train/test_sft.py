"""Supervised warm start: `model.train_sft` on assistant tokens only, same rows and storage as RL."""

from __future__ import annotations

import random

import pytest
import torch

import artrl
import artrl.storage
from artrl.local.train.pack import collate
from artrl.local.train.rows import trajectory_rows

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"item": {"type": "string"}}},
        },
    }
]
ITEMS = ["apple", "pear", "fig", "plum", "kiwi", "lime", "date"]


def transcript(item: str, i: int) -> artrl.Trajectory:
    call = {
        "id": f"c{i}",
        "type": "function",
        "function": {"name": "lookup", "arguments": f'{{"item": "{item}"}}'},
    }
    return artrl.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": f"How many {item}s?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"{item}: {i}"},
            {"role": "assistant", "content": f"There are {i}."},
        ],
        tools=TOOLS,
    )


def dataset(n: int) -> list[artrl.Trajectory]:
    return [transcript(random.Random(i).choice(ITEMS), i % 50) for i in range(n)]


def mean_assistant_logprob(service, trajectories) -> float:
    rows = [r for i, t in enumerate(trajectories) for r in trajectory_rows(t, i, service.chat_format, True)]
    batch = collate(rows, torch.device("cpu"), service.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = service.model(input_ids=batch.ids, attention_mask=batch.attention).logits[:, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, batch.ids[:, 1:, None])[..., 0]  # (B, T-1)
    return float((lp * batch.mask).sum() / batch.mask.sum())


async def test_sft_raises_the_likelihood_of_assistant_tokens_and_is_a_step(tiny_model_dir, tmp_path):
    async with artrl.LocalBackend(path=tmp_path) as backend:
        model = artrl.TrainableModel(name="sft", project="t", base_model=str(tiny_model_dir), lora=None)
        await model.register(backend)
        data = dataset(64)
        before = mean_assistant_logprob(backend.service(model), data[:8])
        prompt_weights = backend.service(model).model.get_input_embeddings().weight.detach().clone()
        result = await model.train_sft(data, artrl.SFTConfig(learning_rate=3e-3, epochs=2, batch_size=16))
        after = mean_assistant_logprob(backend.service(model), data[:8])
        assert result.step == 1 and result.metrics["optimizer_steps"] == 8
        assert after > before + 1.0, (before, after)
        assert not torch.equal(prompt_weights, backend.service(model).model.get_input_embeddings().weight)
        history = artrl.storage.read_history(tmp_path / "t" / "sft")
        assert [(h["step"], h["split"]) for h in history] == [(1, "sft")]
        assert (tmp_path / "t" / "sft" / "trajectories" / "sft" / "0001.jsonl").exists()
        assert (tmp_path / "t" / "sft" / "checkpoints" / "0001" / "model.safetensors").exists()


@pytest.mark.slow
async def test_warm_started_tiny_model_calls_the_tool(tiny_model_dir, tmp_path):
    async with artrl.LocalBackend(path=tmp_path) as backend:
        model = artrl.TrainableModel(name="warm", project="t", base_model=str(tiny_model_dir), lora=None)
        await model.register(backend)
        await model.train_sft(dataset(256), artrl.SFTConfig(learning_rate=3e-3, epochs=4, batch_size=16))
        client = model.openai_client()
        for item in ("apple", "kiwi"):
            response = await client.chat.completions.create(
                model=model.name,
                messages=[{"role": "user", "content": f"How many {item}s?"}],
                tools=TOOLS,
                temperature=0,
                max_tokens=40,
            )
            choice = response.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.tool_calls[0].function.arguments == f'{{"item": "{item}"}}'


def test_final_lr_fraction_decays_the_learning_rate_linearly_over_the_call(tiny_model_dir):
    """SFTConfig(final_lr_fraction=f): the first optimizer step at learning_rate, the last at f of it, linear
    between (an empty step keeps its place); the default is constant. The next call starts again from the
    top."""
    from transformers import AutoModelForCausalLM

    from artrl.local.train.rows import Row
    from artrl.local.train.trainer import Trainer

    class RecordingTrainer(Trainer):  # the learning rate each optimizer step ran with
        lrs: list[float]

        def _optimizer_step(self, max_grad_norm):
            self.lrs.append(self.optimizer.param_groups[0]["lr"])
            return super()._optimizer_step(max_grad_norm)

    trainer = RecordingTrainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir), pad_id=0)
    rng = random.Random(0)

    def rows() -> list[Row]:
        ids = [rng.randrange(2048) for _ in range(12)]
        return [Row(ids=ids, mask=[0] * 6 + [1] * 6, logprobs=[float("nan")] * 12)]

    steps = [rows(), rows(), [], rows(), rows(), rows()]
    for fraction, expected in (
        (0.1, [1.0, 0.82, 0.46, 0.28, 0.1]),
        (1.0, [1.0] * 5),
        (0.5, [1.0, 0.9, 0.7, 0.6, 0.5]),
    ):
        trainer.lrs = []
        trainer.sft(steps, artrl.SFTConfig(learning_rate=2e-3, final_lr_fraction=fraction))
        assert trainer.lrs == pytest.approx([2e-3 * e for e in expected]), fraction
    with pytest.raises(ValueError, match="final_lr_fraction"):
        artrl.SFTConfig(final_lr_fraction=0.0)
