"""kill -9 at arbitrary moments during training, 10 times: every completed step stays readable and resumable."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import artrl
import artrl.storage

pytestmark = pytest.mark.slow


def run_until_killed(base_model: Path, path: Path, min_step: int, delay: float) -> None:
    script = Path(__file__).with_name("train_forever.py")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(base_model), str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        assert proc.stdout is not None
        for line in proc.stdout:
            if int(line.split()[1]) >= min_step:
                break
            assert time.monotonic() < deadline, "training made no progress"
        time.sleep(delay)  # lands anywhere in the next rollouts / training step / checkpoint write
    finally:
        proc.kill()  # SIGKILL
        proc.wait(30)


async def test_kill_9_then_resume(tiny_model_dir, tmp_path):
    path = tmp_path / "artrl"
    rng = random.Random(0)
    last = 0
    kills = []
    for round_ in range(10):
        delay = rng.uniform(0.0, 1.5)
        run_until_killed(tiny_model_dir, path, last + 1, delay)
        directory = path / "t" / "crash"
        steps = sorted(int(p.name) for p in (directory / "checkpoints").iterdir() if p.name.isdigit())
        assert steps == list(range(1, steps[-1] + 1)), f"round {round_}: checkpoints {steps}"
        for step in steps:  # every published checkpoint is complete and readable
            folder = directory / "checkpoints" / f"{step:04d}"
            assert load_file(folder / "adapter_model.safetensors")
            assert json.loads((folder / "adapter_config.json").read_text())["r"] == 8
            assert torch.load(folder / "optimizer.pt", weights_only=True)["state"]
        async with artrl.LocalBackend(path=path) as backend:
            model = artrl.TrainableModel(name="crash", project="t", base_model=str(tiny_model_dir))
            await model.register(backend)
            assert await model.get_step() == steps[-1]
            restored = {n: p for n, p in backend.service(model).model.named_parameters() if p.requires_grad}
            saved = load_file(directory / "checkpoints" / f"{steps[-1]:04d}" / "adapter_model.safetensors")
            assert len(saved) == len(restored)
        # registering restored any history row a kill cut off between checkpoint and history append
        history = artrl.storage.read_history(directory)
        assert sorted(h["step"] for h in history if h["split"] == "train") == steps
        kills.append((round(delay, 2), steps[-1]))
        last = steps[-1]
    print(f"\nCRASH FIGURES: 10 kill -9 (delay after a step, last complete step): {kills}")
