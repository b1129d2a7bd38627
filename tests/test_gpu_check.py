"""`benchmarks/gpu_check.py --dry-run-cpu`: the GPU check's settings run end to end on the CPU (tiny shape),
so the command a GPU session runs is known to work before it spends device time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run_prints_one_row_per_setting(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run-cpu", "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    results = {r["setting"]: r for r in json.loads(out.read_text())["results"]}
    assert len(results) == 6
    for name in ("1.5B bf16 LoRA", "7B bf16 LoRA, ckpt", "1.5B bf16 LoRA, async"):  # ran: figures, a mismatch
        row = results[name]
        assert row["rollout_tok_s"] > 0 and row["train_s"] > 0 and row["mismatch"] >= 0, row
    for name in ("1.5B QLoRA", "7B QLoRA, ckpt"):  # refused where 4-bit cannot run, saying why
        assert "needs a CUDA GPU" in results[name]["error"]
    assert "skipped" in results["1.5B bf16 LoRA, vLLM sleep"]["error"]
    assert "| setting | params (trainable) | rollout tok/s |" in done.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_gpu_check_without_cuda_says_what_to_do():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--settings", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--dry-run-cpu" in done.stderr
