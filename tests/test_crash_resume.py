"""kill -9 at arbitrary moments during training, 10 times: every completed step stays readable and resumable."""

from __future__ import annotations

import json
import os
import random
import signal
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


@pytest.fixture
def trainers():
    """Starts trainers (tests/train_forever.py) that the test kills: forked by a process that imported what
    they need once (`train_forever.py --fork`), each a process of its own."""
    script = Path(__file__).with_name("train_forever.py")
    server = subprocess.Popen(
        [sys.executable, str(script), "--fork"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    yield server
    server.kill()
    server.wait(30)


def run_until_killed(
    trainers: subprocess.Popen, base_model: Path, path: Path, min_step: int, delay: float
) -> None:
    assert trainers.stdin is not None and trainers.stdout is not None
    trainers.stdin.write(json.dumps([str(base_model), str(path)]) + "\n")
    trainers.stdin.flush()
    word, pid = trainers.stdout.readline().split()
    assert word == "pid"
    ended = False
    try:
        deadline = time.monotonic() + 240
        for line in trainers.stdout:
            word, value = line.split()
            ended = word == "ended"
            assert not ended, f"the trainer ended before step {min_step}"
            if int(value) >= min_step:
                break
            assert time.monotonic() < deadline, "training made no progress"
        time.sleep(delay)  # lands anywhere in the next rollouts / training step / checkpoint write
    finally:
        if not ended:
            os.kill(int(pid), signal.SIGKILL)
            for line in trainers.stdout:  # (the steps it printed meanwhile) until it is gone
                if line.split()[0] == "ended":
                    break


async def test_kill_9_then_resume(tiny_model_dir, tmp_path, trainers):
    path = tmp_path / "artrl"
    rng = random.Random(0)
    last = 0
    kills = []
    for round_ in range(10):
        delay = rng.uniform(0.0, 1.5)
        run_until_killed(trainers, tiny_model_dir, path, last + 1, delay)
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
