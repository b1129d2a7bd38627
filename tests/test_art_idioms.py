"""ART's idioms with `import artrl as art` (docs/from-art.md): groups of awaitables, ART's names for settings,
a prompted `art.Model`, RULER named as ART names it, and ART's temporal-clue loop ported (run end to end)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

import artrl as art
from artrl.art_names import history_metric, lora_config, train_config
from artrl.rewards.ruler import judge_endpoint

EXAMPLE = Path(__file__).parent.parent / "examples" / "from_art" / "temporal_clue.py"


async def rollout(reward: float, fail: bool = False, delay: float = 0.0) -> art.Trajectory:
    await asyncio.sleep(delay)
    if fail:
        raise ValueError("tool timed out")
    return art.Trajectory(reward=reward)


async def test_a_group_of_awaitables_is_gathered_as_in_art():
    groups = (  # a generator of groups, each a generator of coroutines: ART's canonical loop
        art.TrajectoryGroup((rollout(s, delay=0.01 * (3 - i)) for i in range(3)), metadata={"scenario": s})
        for s in range(4)
    )
    out = await art.gather_trajectory_groups(groups, pbar_desc="train", pbar=False)
    assert [[t.reward for t in g] for g in out] == [[s] * 3 for s in range(4)]
    assert [g.metadata for g in out] == [{"scenario": s} for s in range(4)]


async def test_failures_count_against_the_budget_and_are_recorded_on_their_group():
    group = art.TrajectoryGroup(rollout(1.0, fail=i == 1) for i in range(3))
    (out,) = await art.gather_trajectory_groups([group], max_exceptions=1, pbar=False)
    assert len(out) == 2 and out.exceptions == ["ValueError: tool timed out"]
    with pytest.raises(art.GatherError):
        await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(1.0, fail=True) for _ in range(2))], pbar=False
        )


async def test_a_group_of_awaitables_can_be_awaited_alone_once():
    group = art.TrajectoryGroup(rollout(float(i)) for i in range(3))
    assert isinstance(group, art.PendingGroup) and len(group) == 3
    assert [t.reward for t in await group] == [0.0, 1.0, 2.0]
    with pytest.raises(RuntimeError, match="already run"):
        await group


def test_results_and_exceptions_make_a_group_and_anything_else_is_a_clear_error():
    group = art.TrajectoryGroup(x for x in [art.Trajectory(reward=1.0), TimeoutError("slow")])
    assert len(group) == 1 and group.exceptions == ["TimeoutError: slow"]
    with pytest.raises(TypeError, match="item 0 is of type int"):
        art.TrajectoryGroup([1, 2])
    with pytest.raises(TypeError, match="not awaitable, unlike the others"):
        art.TrajectoryGroup([rollout(1.0), art.Trajectory()])
    with pytest.raises(TypeError, match="not str"):
        art.TrajectoryGroup("abc")
    assert art.TrajectoryGroup.model_validate(group.model_dump()).exceptions == ["TimeoutError: slow"]


async def test_a_subclass_stays_itself_and_unknown_keywords_are_refused():
    class Scored(art.TrajectoryGroup):
        pass

    (out,) = await art.gather_trajectory_groups([Scored(rollout(1.0) for _ in range(2))], pbar=False)
    assert type(out) is Scored and type(await Scored(rollout(1.0) for _ in range(2))) is Scored
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        art.TrajectoryGroup((rollout(1.0) for _ in range(2)), logs=["x"])
    with pytest.raises(ValueError, match="logs"):
        art.TrajectoryGroup([art.Trajectory()], logs=["x"])


def test_art_training_settings_map_onto_train_config():
    config = train_config(None, {"learning_rate": 5e-6, "beta": 0.1, "epsilon": 0.3, "epsilon_high": 0.4})
    assert (config.learning_rate, config.kl_coef, config.clip_low, config.clip_high) == (5e-6, 0.1, 0.3, 0.4)
    base = art.TrainConfig(steps_per_call=2)
    config = train_config(base, {"logprob_calculation_chunk_size": 64, "verbose": True})
    assert config.steps_per_call == 2 and config.logprob_chunk_size == 64
    with pytest.raises(TypeError, match="no training setting 'plot_tensors'"):
        train_config(None, {"plot_tensors": True})
    assert (
        history_metric("val/reward") == "val/reward_mean" and history_metric("val/acc_mean") == "val/acc_mean"
    )


def test_lora_config_takes_peft_names_or_artrl_names():
    model = art.TrainableModel(name="m", project="p", base_model="x", lora_config={"r": 16, "lora_alpha": 32})
    assert (model.lora.rank, model.lora.alpha) == (16, 32)
    assert lora_config(art.LoraConfig(rank=4)).rank == 4 and lora_config(None) is None
    with pytest.raises(ValueError, match="not both"):
        art.TrainableModel(name="m", project="p", base_model="x", lora=None, lora_config={"r": 4})
    with pytest.raises(ValueError, match="no setting 'fan_in_fan_out'"):
        art.TrainableModel(name="m", project="p", base_model="x", lora_config={"fan_in_fan_out": True})
    with pytest.raises(ValueError, match="plain LoRA: bias"):  # (bias="none", PEFT's default, is accepted)
        art.TrainableModel(name="m", project="p", base_model="x", lora_config={"bias": "all"})


def test_a_prompted_model_names_its_endpoint(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    baseline = art.Model(
        name="gpt", project="p", inference_base_url="http://judge.test/v1", inference_model_name="o3"
    )
    assert not baseline.trainable and baseline.get_inference_name() == "o3"
    with pytest.raises(ValueError, match="no API key"):
        baseline.openai_client()
    baseline = baseline.model_copy(update={"inference_api_key": "k"})
    client = baseline.openai_client()
    assert str(client.base_url) == "http://judge.test/v1/" and client.api_key == "k"
    assert baseline.litellm_completion_params()["model"] == "openai/o3"
    with pytest.raises(ValueError, match="no step 3"):
        baseline.get_inference_name(3)


def test_ruler_judge_named_as_in_art():
    judge = art.Model(name="j", project="p", inference_base_url="http://judge.test/v1", inference_api_key="k")
    client, name, calls = judge_endpoint(judge, {"temperature": 0.0})
    assert str(client.base_url) == "http://judge.test/v1/" and name == "j" and calls == {"temperature": 0.0}
    client, name, _ = judge_endpoint("openai/o3", {"api_base": "http://proxy.test/v1", "api_key": "k"})
    assert str(client.base_url) == "http://proxy.test/v1/" and name == "o3"
    assert (
        judge_endpoint("hosted_vllm/Qwen/Qwen3-32B", {"api_base": "http://x.test/v1"})[1] == "Qwen/Qwen3-32B"
    )
    assert judge_endpoint("Qwen/Qwen3-32B", {"api_base": "http://x.test/v1"})[1] == "Qwen/Qwen3-32B"
    with pytest.raises(ValueError, match="speaks the OpenAI API"):
        judge_endpoint("anthropic/claude-x", None)
    with pytest.raises(TypeError, match="not used by artrl's judge"):
        judge_endpoint("openai/o3", {"api_key": "k", "num_retries": 3})


@pytest.mark.slow
async def test_art_names_on_a_served_model(tiny_model_dir, tmp_path):
    backend = art.LocalBackend(path=tmp_path / "art")
    model = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_config={"r": 4})
    await model.register(backend)
    try:
        client = model.openai_client()
        ask = [{"role": "user", "content": "hi"}]

        async def one(seed: int) -> art.Trajectory:
            reply = await client.chat.completions.create(
                model=model.get_inference_name(0), messages=ask, max_tokens=8, seed=seed
            )
            return art.Trajectory(messages_and_choices=[*ask, reply.choices[0]], reward=float(seed % 2))

        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(one(s) for s in range(4))], pbar=False
        )
        result = await backend.train(model, groups, learning_rate=1e-3)  # ART's new-style call
        assert result.step == 1 and result.metrics["optimizer_steps"] == 1
        await client.chat.completions.create(model=model.get_inference_name(1), messages=ask, max_tokens=2)
        with pytest.raises(openai.NotFoundError):  # the step the gateway no longer serves
            await client.chat.completions.create(
                model=model.get_inference_name(0), messages=ask, max_tokens=2
            )

        await model.log(groups[0].trajectories, split="val")  # trajectories: one group, as in ART
        await model.log(metrics={"pass_rate": 0.5}, split="val", step=1)
        rows = [
            json.loads(line) for line in (backend.directory(model) / "history.jsonl").read_text().splitlines()
        ]
        val = [r for r in rows if r["split"] == "val"]
        assert val[0]["trajectories"] == 4 and val[1] == {**val[1], "pass_rate": 0.5, "step": 1}
        await model.delete_checkpoints(best_checkpoint_metric="val/reward")

        baseline = art.Model(  # a prompted baseline: here the same gateway, as any OpenAI-compatible endpoint
            name="baseline",
            project="p",
            inference_base_url=model.inference_base_url,
            inference_api_key=model.inference_api_key,
            inference_model_name=model.name,
        )
        await baseline.register(backend)
        reply = await baseline.openai_client().chat.completions.create(
            model=baseline.get_inference_name(), messages=ask, max_tokens=2
        )
        trajectory = art.Trajectory(messages_and_choices=[*ask, reply.choices[0]], reward=1.0)
        await baseline.log([trajectory], split="val")
        assert (backend.directory(baseline) / "history.jsonl").exists()
    finally:
        await backend.close()


@pytest.mark.slow
def test_arts_temporal_clue_loop_runs_ported(tiny_model_dir, tmp_path):
    env = {**os.environ, "BASE_MODEL": str(tiny_model_dir), "VAL": "2", "GROUP": "2", "STEPS": "1"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    history = tmp_path / ".artrl" / "temporal-clue" / "001" / "history.jsonl"
    rows = [json.loads(line) for line in history.read_text().splitlines()]
    assert [(r["split"], r["step"]) for r in rows] == [("val", 0), ("train", 1)]
    assert rows[0]["trajectories"] == 4 and rows[1]["groups"] == 4


def test_arts_other_names_for_the_same_settings():
    """Code written for ART passes these names; each means what it means there (docs/from-art.md)."""
    assert art.TrainConfig(beta=0.1).kl_coef == 0.1 and art.TrainConfig(kl_coef=0.2).kl_coef == 0.2
    assert art.LoRAConfig is art.LoraConfig and art.TrainSFTConfig is art.SFTConfig
    config = train_config(None, {"loss_fn": "cispo", "kl_penalty_coef": 0.05, "normalize_advantages": False})
    assert (config.loss, config.kl_coef, config.scale_rewards) == ("cispo", 0.05, False)

    seen_art, seen_artrl, calls = [], [], []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError(f"attempt {len(calls)}")
        return "ok"

    arts = art.retry(
        delay=0, backoff_factor=3.0, on_retry=lambda exc, attempt: seen_art.append((str(exc), attempt))
    )
    assert arts(flaky)() == "ok" and seen_art == [("attempt 1", 1), ("attempt 2", 2)]
    calls.clear()
    ours = art.retry(
        initial_delay=0, on_retry=lambda attempt, exc, delay: seen_artrl.append((attempt, delay))
    )
    assert ours(flaky)() == "ok" and seen_artrl == [(1, 0.0), (2, 0.0)]


def test_arts_typed_model_config():
    """ART's flagship example types its model's settings: `art.TrainableModel[Cfg](..., config=Cfg(...))`,
    read back as `model.config.x`; a dict becomes the config class; art.Model takes one too."""
    from pydantic import BaseModel

    class PolicyConfig(BaseModel):
        max_turns: int = 10
        use_tools: bool = True

    model = art.TrainableModel[PolicyConfig](
        name="agent", project="p", base_model="m", config=PolicyConfig(max_turns=3)
    )
    assert model.config.max_turns == 3 and isinstance(model, art.TrainableModel)
    assert art.TrainableModel[PolicyConfig](
        name="a", project="p", base_model="m", config={"max_turns": 4}
    ).config == (PolicyConfig(max_turns=4))
    assert art.TrainableModel(name="a", project="p", base_model="m", config=PolicyConfig()).config.use_tools
    assert art.TrainableModel(name="a", project="p", base_model="m").config is None
    assert (
        art.Model[PolicyConfig](name="judge", project="p", config=PolicyConfig(max_turns=1)).config.max_turns
        == 1
    )


async def test_a_typed_config_is_kept_with_the_run(tiny_model_dir, tmp_path):
    from pydantic import BaseModel

    class PolicyConfig(BaseModel):
        max_turns: int = 10

    backend = art.LocalBackend(path=tmp_path / "runs")
    model = art.TrainableModel[PolicyConfig](
        name="typed", project="p", base_model=str(tiny_model_dir), config=PolicyConfig(max_turns=7)
    )
    await model.register(backend)
    try:
        saved = json.loads((tmp_path / "runs" / "p" / "typed" / "model.json").read_text())
        assert saved["config"] == {"max_turns": 7}
    finally:
        await backend.close()


async def test_arts_current_trajectory_api():
    """ART's current rollout idiom: the rollout fills `art.current_trajectory()`; `art.trajectory(...)` and
    `art.trajectory_group(...)` give what it filled; `with art.Trajectory() as t:` opens one."""

    async def rollout(reward: float, fail: bool = False) -> None:
        t = art.current_trajectory()
        t.messages_and_choices.append({"role": "user", "content": f"q{reward}"})
        await asyncio.sleep(0)
        if fail:
            raise ValueError("tool timed out")
        t.reward = reward

    traj = await art.trajectory(rollout(0.5))
    assert traj.reward == 0.5 and traj.messages_and_choices == [{"role": "user", "content": "q0.5"}]
    group = await art.trajectory_group([rollout(1.0), rollout(0.0), rollout(0.0, fail=True)])
    assert [t.reward for t in group.trajectories] == [1.0, 0.0]  # (each its own, concurrently)
    assert group.exceptions == ["ValueError: tool timed out"]
    with pytest.raises(ValueError, match="tool timed out"):
        await art.trajectory_group([rollout(1.0, fail=True)], return_exceptions=False)

    async def returns_its_own() -> art.Trajectory:
        return art.Trajectory(reward=2.0)

    assert (await art.trajectory(returns_its_own())).reward == 2.0
    with art.Trajectory() as t:
        assert art.current_trajectory() is t
    with pytest.raises(RuntimeError, match="no trajectory is being recorded"):
        art.current_trajectory()


def test_report_to_as_one_string():
    assert art.TrainableModel(name="a", project="p", base_model="m", report_to="wandb").report_to == (
        "wandb",
    )
    assert art.TrainableModel(name="a", project="p", base_model="m", report_to="none").report_to == ()


def test_lora_in_pefts_words():
    """A peft.LoraConfig (or its names in a dict) passes through lora_config=; "all-linear" is artrl's
    default layers; what artrl's plain LoRA does not have (DoRA, rsLoRA, a bias, modules_to_save) is refused."""
    from peft import LoraConfig as PeftLoraConfig

    default = art.LoraConfig().target_modules
    assert lora_config(PeftLoraConfig(r=16, lora_alpha=32, target_modules="all-linear")) == art.LoraConfig(
        rank=16, alpha=32, target_modules=default
    )
    assert lora_config(
        PeftLoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"])
    ).target_modules == (
        "q_proj",
        "v_proj",
    )
    assert lora_config({"r": 8, "target_modules": "all-linear", "bias": "none"}).target_modules == default
    model = art.TrainableModel(
        name="a", project="p", base_model="m", lora_config=PeftLoraConfig(r=2, lora_alpha=4)
    )
    assert model.lora.rank == 2
    for unsupported in (
        PeftLoraConfig(r=4, use_dora=True),
        {"r": 4, "use_rslora": True},
        {"r": 4, "bias": "all"},
    ):
        with pytest.raises(ValueError, match="plain LoRA"):
            lora_config(unsupported)
