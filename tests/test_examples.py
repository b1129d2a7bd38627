"""The examples run end to end (short settings): agent code only through artrl's public API."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import maze_env  # noqa: E402


def test_maze_splits_are_disjoint_and_cover_every_path():
    assert not set(maze_env.TRAIN_PATHS) & set(maze_env.VAL_PATHS)
    assert len(maze_env.TRAIN_PATHS) + len(maze_env.VAL_PATHS) == 4**maze_env.PATH_LENGTH
    assert all(s.path in maze_env.VAL_PATHS for s in maze_env.scenarios("val", 50, 0))
    assert maze_env.scenarios("train", 5, 1) == maze_env.scenarios("train", 5, 1)


def test_maze_walk_follows_the_breeze_and_rewards_fewer_turns():
    scenario = maze_env.Scenario(("north", "east", "east", "south"))
    assert json.loads(scenario.question().split(": ", 1)[1]) == {"breeze": "north"}
    walk = maze_env.Walk(scenario)
    assert json.loads(walk.move('{"direction": "west"}')) == {"result": "wall", "breeze": "north"}
    assert json.loads(walk.move('{"direction": "north"}')) == {"result": "moved", "breeze": "east"}
    assert "error" in json.loads(walk.move('{"direction": "up"}'))
    assert walk.reward() == 0.5 * 1 / 4  # partial credit, never below giving up (0)
    for direction in ("east", "east", "south"):
        result = json.loads(walk.move(json.dumps({"direction": direction})))
    assert result == {"result": "exit"} and walk.out
    assert walk.reward() == pytest.approx(1.0 - 0.1 * 2)  # two wasted moves
    perfect = maze_env.Walk(scenario)
    for direction in scenario.path:
        perfect.move(json.dumps({"direction": direction}))
    assert perfect.reward() == 1.0


def test_maze_weak_transcripts_are_well_formed_tool_conversations():
    import random

    rng = random.Random(0)
    for i, scenario in enumerate(maze_env.scenarios("train", 20, 0)):
        traj = maze_env.weak_transcript(scenario, rng, i, skill=1.0)
        calls = [m for m in traj.messages() if m["role"] == "assistant"]
        assert len(calls) == maze_env.PATH_LENGTH  # skill 1 walks straight out
        assert json.loads(traj.messages()[-1]["content"]) == {"result": "exit"}


@pytest.mark.slow
def test_tool_agent_demo(tmp_path):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "tool_agent.py"), "--path", str(tmp_path), "--rollouts", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "token-exact continuations" in out and "rollout 1" in out


@pytest.mark.slow
def test_train_agent_runs_warm_start_grpo_validation_and_plot(tmp_path):
    args = [
        "--path",
        str(tmp_path / "artrl"),
        "--out",
        str(tmp_path / "out"),
        "--steps",
        "2",
        "--val-size",
        "8",
        "--sft-examples",
        "64",
        "--sft-epochs",
        "1",
        "--eval-every",
        "1",
        "--groups-per-step",
        "2",
    ]
    subprocess.run(
        [sys.executable, str(EXAMPLES / "train_agent.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    summary = json.loads((tmp_path / "out" / "summary_seed0.json").read_text())
    assert len(summary["history"]) == 2 and [p[0] for p in summary["val_points"]] == [0, 1, 2]
    assert (tmp_path / "out" / "reward_curve_seed0.png").stat().st_size > 10_000
    assert set(summary["timings"]) == {"warm_start", "validation", "rollouts", "training"}
