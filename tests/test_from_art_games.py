"""ART's game examples, tic-tac-toe and 2048 (examples/from_art/, ported as docs/from-art.md lists), run as
published: their `base_model="meta-llama/..."` / `"Qwen/..."` hub ids are answered offline from a Hugging Face
hub cache that holds artrl's tiny model under that id, so artrl loads them through transformers and
huggingface_hub as it loads any hub model. The tiny model's moves are mostly not moves at all: ART's game
code scores them, and these tests check that the loop runs, scores and steps, not that it wins."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_cache import cache_model

EXAMPLES = Path(__file__).parent.parent / "examples" / "from_art"


def run_ported(script: Path, repo_id: str, model_dir: Path, tmp_path: Path, **sizes: int) -> None:
    env = {
        **os.environ,
        **cache_model(model_dir, repo_id, tmp_path / "hub"),
        **{k: str(v) for k, v in sizes.items()},
    }
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # a step's checkpoint asks the hub nothing (PEFT's save would look up the base's config.json each step)
    assert "Could not find a config file" not in done.stderr


def run_folder(tmp_path: Path, project: str, name: str, repo_id: str, steps: int, group: int) -> Path:
    """The run's folder, after checking its history: one training row per step, each of one group of
    `group` trajectories, on the hub id's model."""
    folder = tmp_path / ".artrl" / project / name
    assert json.loads((folder / "model.json").read_text())["base_model"] == repo_id
    rows = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
    assert [(r["split"], r["step"]) for r in rows] == [("train", s) for s in range(1, steps + 1)]
    assert [(r["groups"], r["trajectories"]) for r in rows] == [(1, group)] * steps
    return folder


def trained_on(folder: Path, step: int) -> list[dict]:
    """The trajectories step `step` trained on, as the run saved them."""
    (record,) = [
        json.loads(line) for line in (folder / "trajectories" / "train" / f"{step:04d}.jsonl").open()
    ]
    assert record["exceptions"] == []
    return record["trajectories"]


@pytest.mark.slow
def test_arts_tic_tac_toe_runs_ported(tiny_model_dir, tmp_path):
    repo_id = "meta-llama/Meta-Llama-3.1-8B-Instruct"
    run_ported(
        EXAMPLES / "tic_tac_toe" / "tic-tac-toe.py", repo_id, tiny_model_dir, tmp_path, STEPS=2, GROUP=3
    )
    folder = run_folder(tmp_path, "tic-tac-toe", "llama-8b-007", repo_id, steps=2, group=3)
    for step in (1, 2):
        for t in trained_on(folder, step):  # scored by ART's rollout: an invalid move, or the game's result
            moves = t["metrics"]["num_moves"]
            if t["metrics"]["invalid_move"]:
                assert t["reward"] == pytest.approx(-100 + math.log(moves + 1) / math.log(100))
            else:
                assert t["reward"] == t["metrics"]["win"] in (0, 0.5, 1)
            assert t["messages_and_choices"][1]["content"].startswith("   1   2   3\nA  ")  # the board


@pytest.mark.slow
def test_arts_2048_runs_ported(tiny_model_dir, tmp_path):
    repo_id = "Qwen/Qwen2.5-7B-Instruct"
    run_ported(EXAMPLES / "game_2048" / "2048.py", repo_id, tiny_model_dir, tmp_path, STEPS=2, GROUP=3)
    folder = run_folder(tmp_path, "2048", "003", repo_id, steps=2, group=3)
    for step in (1, 2):
        for t in trained_on(folder, step):  # scored by ART's rollout: -1 for an invalid move, else the board
            assert t["reward"] == -1 or {"max_value", "board_value", "num_moves"} <= t["metrics"].keys()
            assert t["messages_and_choices"][1]["content"].count("\n") == 4  # the board's four rows
