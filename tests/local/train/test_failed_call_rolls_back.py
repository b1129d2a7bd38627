"""A training call that fails after one of its optimizer steps is rolled back (issue 43, item 5): the
served weights and the optimizer are those of the last committed step, and the next step takes its number."""

from __future__ import annotations

import json

import pytest
import torch
from scored_rollouts import PROMPT, rollouts

import artrl


class FailsOnSecondStep:
    """The trainer's optimizer, whose second `step` of a call updates the weights, then raises."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.steps = 0

    def step(self) -> None:
        self.optimizer.step()
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("injected: the second optimizer step failed")

    def __getattr__(self, name: str):
        return getattr(self.optimizer, name)


def trained_state(trainer) -> tuple[list[torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    parameters = [p.detach().clone() for p in trainer.parameters]
    state = {
        i: {k: v.detach().clone() for k, v in trainer.optimizer.state[p].items()}
        for i, p in enumerate(trainer.parameters)
        if p in trainer.optimizer.state
    }
    return parameters, state


async def test_a_call_failing_after_its_first_optimizer_step_is_rolled_back(tiny_model_dir, tmp_path):
    backend = artrl.LocalBackend(path=tmp_path / "artrl")
    model = artrl.TrainableModel(name="tiny", project="rollback", base_model=str(tiny_model_dir))
    await model.register(backend)
    try:
        client = model.openai_client()
        probe = {"model": model.name, "messages": PROMPT, "max_tokens": 6, "temperature": 0.0}
        config = artrl.TrainConfig(learning_rate=1e-2, steps_per_call=2)
        first = await model.train([await rollouts(model, [1, 0, 0, 1])], config=config)
        assert first.step == 1 and first.metrics["optimizer_steps"] == 2
        trainer = backend.service(model).trainer
        greedy = (await client.chat.completions.create(**probe)).choices[0]
        parameters, state = trained_state(trainer)
        assert state, "the optimizer has its moments after step 1"

        real = trainer.optimizer
        trainer.optimizer = FailsOnSecondStep(real)
        groups = [await rollouts(model, [0, 1, 1, 0])]
        with pytest.raises(RuntimeError, match="injected"):
            await model.train(groups, config=config)
        assert trainer.optimizer.steps == 2  # (both steps ran: the weights moved twice before the failure)
        trainer.optimizer = real

        after_parameters, after_state = trained_state(trainer)
        assert all(torch.equal(a, b) for a, b in zip(parameters, after_parameters, strict=True))
        assert after_state.keys() == state.keys()
        for i, moments in state.items():
            assert after_state[i].keys() == moments.keys()
            assert all(torch.equal(moments[k], after_state[i][k]) for k in moments)
        served = (await client.chat.completions.create(**probe)).choices[0]
        assert served.token_ids == greedy.token_ids
        assert served.token_logprobs == pytest.approx(greedy.token_logprobs, abs=1e-6)
        assert await model.get_step() == 1

        second = await model.train(groups, config=config)
        assert second.step == 2 and await model.get_step() == 2
        history = backend.directory(model) / "history.jsonl"
        steps = [json.loads(line)["step"] for line in history.read_text().splitlines()]
        assert steps == [1, 2]
    finally:
        await backend.close()


def conversation(i: int) -> artrl.Trajectory:
    return artrl.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": f"Count to {i}."},
            {"role": "assistant", "content": " ".join(str(k) for k in range(1, i + 2))},
        ]
    )


async def test_a_full_finetuning_sft_call_failing_after_its_first_step_is_rolled_back(
    tiny_model_dir, tmp_path
):
    """Multi-batch SFT with every weight trained: the first call ever, so no optimizer state before it."""
    async with artrl.LocalBackend(path=tmp_path) as backend:
        model = artrl.TrainableModel(name="full", project="t", base_model=str(tiny_model_dir), lora=None)
        await model.register(backend)
        trainer = backend.service(model).trainer
        parameters, state = trained_state(trainer)
        assert not state
        real = trainer.optimizer
        trainer.optimizer = FailsOnSecondStep(real)
        data = [conversation(i) for i in range(4)]
        config = artrl.SFTConfig(learning_rate=1e-3, batch_size=2)
        with pytest.raises(RuntimeError, match="injected"):
            await model.train_sft(data, config)
        trainer.optimizer = real
        after_parameters, after_state = trained_state(trainer)
        assert all(torch.equal(a, b) for a, b in zip(parameters, after_parameters, strict=True))
        assert not after_state and not trainer.optimizer.state
        result = await model.train_sft(data, config)
        assert result.step == 1 and result.metrics["optimizer_steps"] == 2
