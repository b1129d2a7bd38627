"""The checkpoint lifecycle: which checkpoints retention keeps (pure selection, then on a real run, once and
after every step), resume after deletions, and `name@step` served names that move with training."""

from __future__ import annotations

import openai
import pytest
import torch
from scored_rollouts import PROMPT, rollouts

import artrl
from artrl.config import CheckpointRetention
from artrl.retention import checkpoints_to_keep, metric_by_step
from artrl.storage import checkpoint_steps

LR = artrl.TrainConfig(learning_rate=1e-2)


# ---------------------------------------------------------------- pure selection (retention.py)
def val(step: int, value, split: str = "val", name: str = "reward_mean") -> dict:
    return {"step": step, "split": split, name: value}


def keep(steps, history, **settings) -> set[int]:
    return checkpoints_to_keep(steps, history, CheckpointRetention(**settings))


def test_nothing_asked_keeps_everything_and_no_steps_keep_nothing():
    assert keep([1, 2, 3], []) == {1, 2, 3}
    assert keep([], [val(1, 0.5)], keep_last=1, keep_best="val/reward_mean") == set()


def test_keep_last_keeps_the_newest_and_the_latest_always():
    assert keep([3, 1, 2, 5], [], keep_last=2) == {3, 5}
    assert keep([1, 2], [], keep_last=10) == {1, 2}
    # only a best metric asked, and none logged yet: the latest alone
    assert keep([1, 2, 3], [], keep_best="val/reward_mean") == {3}


def test_keep_best_max_and_min():
    history = [val(1, 0.2), val(2, 0.9), val(3, 0.5), val(4, 0.1)]
    steps = [1, 2, 3, 4, 5]
    assert keep(steps, history, keep_last=1, keep_best="val/reward_mean") == {2, 5}
    assert keep(steps, history, keep_last=1, keep_best="val/reward_mean", best_mode="min") == {4, 5}
    assert keep(steps, history, keep_last=2, keep_best="val/reward_mean") == {2, 4, 5}


def test_ties_go_to_the_later_step_in_both_modes():
    history = [val(1, 0.9), val(2, 0.9), val(3, 0.1), val(4, 0.1)]
    assert keep([1, 2, 3, 4, 5], history, keep_last=1, keep_best="val/reward_mean") == {2, 5}
    assert keep([1, 2, 3, 4, 5], history, keep_last=1, keep_best="val/reward_mean", best_mode="min") == {4, 5}


def test_missing_deleted_or_odd_values_are_left_out():
    history = [
        val(1, 0.99, split="train"),  # another split's metric of the same name
        val(2, 0.8, name="accuracy_mean"),  # another metric
        val(3, float("nan")),
        val(4, True),
        val(5, "high"),
        {"split": "val", "reward_mean": 5.0},  # no step
        val(6, 0.3),
        val(7, 0.7),  # its checkpoint is gone: the best of those on disk is kept
    ]
    assert metric_by_step(history, "val/reward_mean") == {6: 0.3, 7: 0.7}
    assert keep([1, 2, 3, 4, 5, 6, 8], history, keep_last=1, keep_best="val/reward_mean") == {6, 8}
    assert keep([1, 2, 8], history, keep_last=1, keep_best="test/reward_mean") == {8}  # not logged yet


def test_a_misspelt_best_metric_is_an_error_not_a_silent_deletion():
    with pytest.raises(
        ValueError, match=r"'val' rows of history.jsonl have no 'reward' \(they have: reward_mean\)"
    ):
        keep([1, 2, 3], [val(1, 0.5), val(2, 0.7)], keep_last=1, keep_best="val/reward")


def test_a_re_run_evaluation_replaces_the_earlier_one():
    history = [val(1, 0.9), val(2, 0.5), val(1, 0.1)]
    assert keep([1, 2, 3], history, keep_last=1, keep_best="val/reward_mean") == {2, 3}


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="split/metric"):
        CheckpointRetention(keep_best="reward_mean")
    with pytest.raises(ValueError):
        CheckpointRetention(keep_last=0)
    with pytest.raises(ValueError):
        CheckpointRetention(best_mode="biggest")  # type: ignore[arg-type]


# ---------------------------------------------------------------- on a real run


def evaluation(reward: float) -> list[artrl.TrajectoryGroup]:
    """A validation result with a chosen mean reward (model.log records it at the current step)."""
    turn = {"role": "assistant", "content": "sunny"}
    return [artrl.TrajectoryGroup([artrl.Trajectory(messages_and_choices=[*PROMPT, turn], reward=reward)])]


def weights(backend: artrl.LocalBackend, model: artrl.TrainableModel) -> dict[str, torch.Tensor]:
    params = backend.service(model).model.named_parameters()
    return {n: p.detach().clone() for n, p in params if "lora_" in n}


async def served_ids(model: artrl.TrainableModel) -> list[str]:
    return [m.id for m in (await model.openai_client().models.list()).data]


async def resume_equals(path, model: artrl.TrainableModel, saved: dict[str, torch.Tensor], step: int) -> None:
    """A new backend on the same folder continues from `step` with the latest checkpoint's weights."""
    async with artrl.LocalBackend(path=path) as backend:
        again = artrl.TrainableModel.model_validate(model.model_dump())  # the same model, unregistered
        await again.register(backend)
        assert await again.get_step() == step
        assert await served_ids(again) == [again.name, f"{again.name}@{step}"]
        restored = weights(backend, again)
        assert restored.keys() == saved.keys() and all(torch.equal(saved[n], restored[n]) for n in saved)
        assert (await again.train([await rollouts(again, [1, 0], max_tokens=6)], config=LR)).step == step + 1


async def test_delete_checkpoints_keeps_the_newest_and_the_best_then_resume(tiny_model_dir, tmp_path):
    path = tmp_path / "artrl"
    model = artrl.TrainableModel(name="once", project="life", base_model=str(tiny_model_dir))
    async with artrl.LocalBackend(path=path) as backend:
        await model.register(backend)
        directory = backend.directory(model)
        for reward in (0.2, 0.9, 0.5, 0.1, 0.3):
            await model.train([await rollouts(model, [1, 0], max_tokens=6)], config=LR)
            await model.log(evaluation(reward), split="val")
        assert checkpoint_steps(directory) == [1, 2, 3, 4, 5]
        with pytest.raises(ValueError, match="no checkpoint was deleted"):
            await model.delete_checkpoints(keep_last=1, keep_best="val/reward")
        assert checkpoint_steps(directory) == [1, 2, 3, 4, 5]
        assert await model.delete_checkpoints(keep_last=2, keep_best="val/reward_mean") == [1, 3]
        assert checkpoint_steps(directory) == [2, 4, 5]
        assert await model.delete_checkpoints(keep_last=1, keep_best="val/reward_mean", best_mode="min") == [
            2
        ]
        assert await model.delete_checkpoints() == [4]  # keep_last=1 by default
        assert await model.delete_checkpoints(keep_last=None) == []  # nothing asked: nothing deleted
        assert sorted(p.name for p in (directory / "checkpoints").iterdir()) == ["0005"]  # no leftovers
        saved = weights(backend, model)
    await resume_equals(path, model, saved, 5)


async def test_retention_after_every_step_and_served_names_follow(tiny_model_dir, tmp_path):
    path = tmp_path / "artrl"
    retention = CheckpointRetention(keep_last=2, keep_best="val/reward_mean")
    model = artrl.TrainableModel(
        name="auto", project="life", base_model=str(tiny_model_dir), retention=retention
    )
    # after training step s, with evaluations logged after steps 1..s-1 (values below)
    expected = {1: [1], 2: [1, 2], 3: [2, 3], 4: [2, 3, 4], 5: [2, 4, 5]}
    async with artrl.LocalBackend(path=path) as backend:
        await model.register(backend)
        assert await served_ids(model) == ["auto", "auto@0"]
        for step, reward in zip(range(1, 6), (0.5, 0.9, 0.1, 0.3, 0.2), strict=True):
            result = await model.train([await rollouts(model, [1, 0], max_tokens=6)], config=LR)
            assert result.step == step
            assert checkpoint_steps(backend.directory(model)) == expected[step]
            assert await served_ids(model) == ["auto", f"auto@{step}"]
            await model.log(evaluation(reward), split="val")
        saved = weights(backend, model)
    await resume_equals(path, model, saved, 5)


async def test_a_request_pins_the_served_step(fresh_model):
    client = fresh_model.openai_client(max_retries=0)
    ask = {"messages": PROMPT, "max_tokens": 4, "temperature": 0.0}
    pinned = await client.chat.completions.create(model="tiny@0", **ask)
    assert pinned.model == "tiny@0" and pinned.choices[0].token_ids
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="tiny@1", **ask)
    assert caught.value.code == "model_not_found"
    assert "serves step 0" in caught.value.message and "Step 1 is not trained yet" in caught.value.message
    await fresh_model.train([await rollouts(fresh_model, [1, 0], max_tokens=6)], config=LR)
    moved = await client.chat.completions.create(model="tiny@1", **ask)
    plain = await client.chat.completions.create(model="tiny", **ask)
    assert moved.choices[0].token_ids == plain.choices[0].token_ids
    for stale, says in (
        (
            "tiny@0",
            "serves step 1 (as 'tiny' or 'tiny@1'). To evaluate an older step, serve its checkpoint: "
            "`artrl serve RUN_DIR --step 0`",
        ),
        ("tiny@x", "a step is a number"),
        ("other@1", "available"),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model=stale, **ask)
        assert caught.value.status_code == 404 and says in caught.value.message
    await client.close()
