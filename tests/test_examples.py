"""The examples run end to end (short settings): agent code only through artrl's public API."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


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
