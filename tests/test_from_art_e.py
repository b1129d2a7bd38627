"""ART·E, ART's flagship example (OpenPipe/ART examples/art-e), ported: ART's own rollout, tools, reward, judge
and training loop (examples/from_art/art_e) run on artrl's tiny model, with ART·E's data made offline from
artrl's synthetic inbox (examples/from_art/art_e_data.py). The diff against ART's files is in
docs/from-art.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FROM_ART = Path(__file__).parent.parent / "examples" / "from_art"
SRC = Path(__file__).parent.parent / "src"


def art_e_env(data: Path, **sizes: str) -> dict[str, str]:
    """What points ART·E's code at the local data (and keeps datasets and litellm off the network)."""
    return {
        "ART_E_EMAILS": str(data / "emails"),
        "ART_E_QUESTIONS": str(data / "questions"),
        "ART_E_DB": str(data / "enron_emails.db"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(data / "datasets-cache"),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # (else litellm's import fetches its price list, 3 tries)
        **sizes,
    }


def write_data(data: Path) -> dict[str, int]:
    sys.path.insert(0, str(FROM_ART))
    try:
        import art_e_data
    finally:
        sys.path.remove(str(FROM_ART))
    return art_e_data.write(data, n_messages=100)  # 4 questions a split


@pytest.mark.slow
def test_arts_art_e_trains_ported(tiny_model_dir, tmp_path):
    """ART's train.py as ART runs it (RUN_ID picks one of its agents: 008 uses tools), 2 steps of 2 questions
    x 2 rollouts, validated at step 0 and at the end on the 4 test questions (ART's benchmark_model)."""
    assert write_data(tmp_path / "data") == {"train": 4, "test": 4}
    sizes = {"MAX_TURNS": "2", "MAX_TOKENS": "16", "TRAJECTORIES_PER_GROUP": "2", "GROUPS_PER_STEP": "2"}
    sizes |= {"TRAINING_DATASET_SIZE": "4", "NUM_EPOCHS": "1"}
    env = {
        **os.environ,
        **art_e_env(tmp_path / "data", **sizes),
        "RUN_ID": "008",
        "BASE_MODEL": str(tiny_model_dir),
    }
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(FROM_ART), env.get("PYTHONPATH", "")])
    env.pop("OPENPIPE_API_KEY", None)  # (ART·E reports to OpenPipe when it is set: openpipe is not installed)
    done = subprocess.run(
        [sys.executable, str(FROM_ART / "art_e" / "train.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Training finished." in done.stdout
    history = tmp_path / ".artrl" / "email_agent" / "email-agent-008" / "history.jsonl"
    rows = [json.loads(line) for line in history.read_text().splitlines()]
    assert [(r["split"], r["step"]) for r in rows] == [("val", 0), ("train", 1), ("train", 2), ("val", 2)]
    for row in rows:  # ART·E's rubric, as trajectory metrics (FinalRubric.to_metrics), in every row
        assert {"answer_correct_mean", "sources_correct_mean", "num_turns_mean", "duration_mean"} <= set(row)
        assert row["trajectories"] == 4 and row.get("exception_rate", 0.0) == 0.0
    assert [r["groups"] for r in rows if r["split"] == "train"] == [2, 2]
    model_json = json.loads((history.parent / "model.json").read_text())
    assert "max_turns" in json.dumps(model_json)  # ART's typed config, recorded with the run


@pytest.mark.slow
async def test_arts_rollout_trains_on_the_tokens_sampled_through_litellm(
    tiny_model_dir, tmp_path, monkeypatch
):
    """ART's rollout calls the model with litellm and keeps `convert_litellm_choice_to_openai(choice)`: the
    gateway's token ids survive both, and a train step uses exactly them. ART's judge, pointed by
    configuration only (litellm's OpenAI environment variables) at the served model, answers (a smoke run:
    the tiny model is no judge)."""
    import artrl as art

    write_data(tmp_path / "data")
    for key, value in art_e_env(tmp_path / "data").items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(FROM_ART))
    monkeypatch.chdir(tmp_path)
    from art_e.data.local_email_db import generate_database
    from art_e.data.query_iterators import load_synthetic_queries
    from art_e.project_types import ProjectPolicyConfig
    from art_e.rollout import determine_if_answer_is_correct, rollout

    generate_database()
    scenario = load_synthetic_queries(split="train", limit=1)[0]
    backend = art.LocalBackend(path=tmp_path / ".artrl")
    model = art.TrainableModel[ProjectPolicyConfig](
        name="agent",
        project="art-e",
        base_model=str(tiny_model_dir),
        config=ProjectPolicyConfig(max_tokens=12),
    )
    try:
        await model.register(backend)
        trajectories = [await rollout(model, scenario) for _ in range(2)]
        sampled = 0
        for traj in trajectories:  # (at most 12 tokens each: the tiny model may sample a stop token sooner)
            (choice,) = traj.choices()
            assert 1 <= len(choice.model_extra["token_ids"]) == traj.metrics["completion_tokens"] <= 12
            assert len(choice.model_extra["prompt_token_ids"]) == traj.metrics["prompt_tokens"]
            sampled += len(choice.model_extra["token_ids"])
        # the tiny model never calls a tool, so both score alike: set them apart for GRPO to have a gradient
        trajectories[0].reward, trajectories[1].reward = 0.0, 1.0
        result = await model.train([art.TrajectoryGroup(trajectories)])  # (rendered turns are refused)
        assert result.metrics["optimizer_steps"] == 1 and result.metrics["trainable_tokens"] == sampled

        monkeypatch.setenv("JUDGE_MODEL", f"openai/{model.get_inference_name()}")
        monkeypatch.setenv("OPENAI_API_BASE", model.inference_base_url)
        monkeypatch.setenv("OPENAI_API_KEY", model.inference_api_key)
        assert isinstance(await determine_if_answer_is_correct(scenario.answer, scenario), bool)
    finally:
        await backend.close()
