"""Durability: a checkpoint that cannot be written (disk full) loses no step, nor does closing the model
before it is; checkpoints reach the disk before they are published, and one a crash left moved aside is put
back; a checkpoint is data, never code; model.log cannot overwrite a training step; model.export never writes
into a folder that holds files; training never shares the gateway's tokenizer."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import subprocess
from pathlib import Path

import pytest

import artrl
from artrl.local.service import step_commits
from artrl.local.service.checkpoints import save_checkpoint
from artrl.storage import latest_step, publish_directory, read_history


def group(model_name: str) -> artrl.TrajectoryGroup:
    from openai.types.chat.chat_completion import Choice

    def traj(reward: float, token: int) -> artrl.Trajectory:
        choice = Choice.model_validate(
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "x"},
                "prompt_token_ids": [1, 2, 3, 4],
                "token_ids": [token, 5],
                "token_logprobs": [-1.0, -1.0],
            }
        )
        return artrl.Trajectory(
            messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=reward
        )

    return artrl.TrajectoryGroup([traj(0.0, 7), traj(1.0, 8)])


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs: a disk that can really fill up."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        reason = f"cannot mount a tmpfs here ({done.stderr.decode().strip() or done.returncode}): needs root"
        if os.environ.get("CI"):  # (CI runs as root: a skip there would hide that the test never runs)
            pytest.fail(f"{reason}, and CI is set")
        pytest.skip(reason)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


async def test_a_full_disk_during_a_checkpoint_loses_no_step(tiny_model_dir, small_disk):
    filler = small_disk / "filler"
    async with artrl.LocalBackend(path=small_disk / "artrl") as backend:
        model = artrl.TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora=None)
        await model.register(backend)
        directory = small_disk / "artrl" / "p" / "m"
        config = artrl.TrainConfig(learning_rate=1e-3)
        assert (await model.train([group(model.name)], config)).step == 1
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        filler.write_bytes(b"\0" * (free - (256 << 10)))  # room for trajectories, not for a checkpoint
        with pytest.raises(artrl.CheckpointError, match="step 2's checkpoint could not be written") as exc:
            await model.train([group(model.name)], config)
        assert "No space left on device" in str(exc.value)
        assert latest_step(directory) == 1 and [r["step"] for r in read_history(directory)] == [1]
        assert not [p for p in (directory / "checkpoints").iterdir() if p.name.startswith(".tmp")]
        with pytest.raises(artrl.CheckpointError, match="still cannot be written"):
            await model.train([group(model.name)], config)  # still full: nothing trains
        filler.unlink()
        result = await model.train([group(model.name)], config)  # writes step 2 first, then trains step 3
        assert result.step == 3
        assert latest_step(directory) == 3 and [r["step"] for r in read_history(directory)] == [1, 2, 3]
        assert (directory / "checkpoints" / "0002" / "model.safetensors").exists()


async def test_a_full_disk_before_a_step_trains_nothing_and_loses_nothing(tiny_model_dir, small_disk):
    """A disk too full for even the step's trajectories: the call fails before any weight changes (the
    error says why), nothing is half-written, and once there is room the next call is the same step."""
    filler = small_disk / "filler"
    async with artrl.LocalBackend(path=small_disk / "artrl") as backend:
        model = artrl.TrainableModel(name="m", project="p", base_model=str(tiny_model_dir))
        await model.register(backend)
        directory = small_disk / "artrl" / "p" / "m"
        config = artrl.TrainConfig(learning_rate=1e-3)
        assert (await model.train([group(model.name)], config)).step == 1
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        filler.write_bytes(b"\0" * free)  # (no room at all)
        with pytest.raises(OSError, match="No space left on device"):
            await model.train([group(model.name)], config)
        assert latest_step(directory) == 1 and [r["step"] for r in read_history(directory)] == [1]
        filler.unlink()
        assert (await model.train([group(model.name)], config)).step == 2
        assert latest_step(directory) == 2 and [r["step"] for r in read_history(directory)] == [1, 2]


def test_a_published_checkpoint_is_on_disk_first(tmp_path, monkeypatch):
    """Every file, the directory and the rename are fsynced (before: only the history line was)."""
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    tmp, final = tmp_path / ".tmp-0001", tmp_path / "0001"
    tmp.mkdir()
    (tmp / "weights.bin").write_bytes(b"w")
    (tmp / "optimizer.pt").write_bytes(b"o")
    publish_directory(tmp, final)
    assert {str(tmp / "weights.bin"), str(tmp / "optimizer.pt"), str(tmp), str(tmp_path)} <= set(synced)


def test_an_optimizer_state_is_loaded_as_data_only(tiny_model_dir, tmp_path):
    """optimizer.pt is loaded with weights_only: a pickle that would run code is refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from artrl.config import LoraConfig
    from artrl.local.train.adapters import attach_adapter
    from artrl.local.train.trainer import Trainer

    trainer = Trainer(attach_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig()), 0)
    trainer.save(str(tmp_path))
    trainer.load(str(tmp_path))  # a real checkpoint loads
    marker = tmp_path / "code-ran"
    torch.save(_Evil(str(marker)), tmp_path / "optimizer.pt")
    with pytest.raises(ValueError, match="not a plain optimizer state"):
        trainer.load(str(tmp_path))
    assert not marker.exists()


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


async def test_log_cannot_overwrite_a_training_steps_trajectories(fresh_model):
    for split in ("train", "sft"):
        with pytest.raises(ValueError, match="log evaluations under another name"):
            await fresh_model.log([group(fresh_model.name)], split=split)
    assert (await fresh_model.log([group(fresh_model.name)], split="val"))["trajectories"] == 2


async def test_a_cancelled_train_call_still_saves_and_records_its_step(fresh_model, tmp_path):
    """Cancelling `model.train` (a timeout around it, Ctrl-C) once its step has begun: the step is trained,
    checkpointed and recorded before the caller sees the cancellation, so no weights change unrecorded and
    the next call trains the next step (before, the weights moved and the step was never written)."""
    directory = tmp_path / "artrl" / "fresh" / "tiny"
    config = artrl.TrainConfig(learning_rate=1e-3)
    trajectories = group(fresh_model.name).trajectories
    for step, split, train in (
        (1, "train", lambda: fresh_model.train([group(fresh_model.name)], config)),
        (2, "sft", lambda: fresh_model.train_sft(trajectories, artrl.SFTConfig(batch_size=2))),
    ):
        task = asyncio.ensure_future(train())
        deadline = asyncio.get_running_loop().time() + 60
        while not (directory / "trajectories" / split / f"{step:04d}.jsonl").exists():
            assert asyncio.get_running_loop().time() < deadline and not task.done(), f"no step {step} began"
            # (the call goes on up to its next wait: once that file is written, that wait is the step's)
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert latest_step(directory) == 2
    assert [(r["step"], r["split"]) for r in read_history(directory)] == [(1, "train"), (2, "sft")]
    assert (await fresh_model.train([group(fresh_model.name)], config)).step == 3


async def test_a_step_whose_trained_rows_cannot_be_written_is_still_saved_and_recorded(fresh_model, tmp_path):
    """The rows file (what the step trained, for the dashboard) is written after the weights changed: a
    failure there left the step trained but never checkpointed or recorded, and the next call reused its
    number. Now the step is saved and recorded, the rows' failure logged and counted in its metrics."""
    directory = tmp_path / "artrl" / "fresh" / "tiny"
    (directory / "trajectories" / "train" / "0001.rows.jsonl.gz").mkdir(
        parents=True
    )  # (it cannot be written)
    result = await fresh_model.train([group(fresh_model.name)], artrl.TrainConfig(learning_rate=1e-3))
    assert result.step == 1 and result.metrics["rows_saved"] == 0
    assert latest_step(directory) == 1
    assert [(r["step"], r["split"]) for r in read_history(directory)] == [(1, "train")]
    assert (await fresh_model.train([group(fresh_model.name)], artrl.TrainConfig())).step == 2


class FailingSaves:
    """save_checkpoint whose first `failures` calls fail as on a full disk; the later ones write."""

    def __init__(self, failures: int) -> None:
        self.failures = failures

    def __call__(self, *args):
        if self.failures:
            self.failures -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return save_checkpoint(*args)


async def test_a_step_whose_checkpoint_failed_is_written_at_close(tiny_model_dir, tmp_path, monkeypatch):
    """Before, only the next train call wrote it: closing the backend first lost the step silently."""
    monkeypatch.setattr(step_commits, "save_checkpoint", FailingSaves(1))
    backend = artrl.LocalBackend(path=tmp_path / "artrl")
    model = artrl.TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora=None)
    await model.register(backend)
    with pytest.raises(artrl.CheckpointError, match="step 1's checkpoint could not be written"):
        await model.train([group(model.name)], artrl.TrainConfig(learning_rate=1e-3))
    directory = tmp_path / "artrl" / "p" / "m"
    assert latest_step(directory) == 0
    await backend.close()
    assert latest_step(directory) == 1 and [r["step"] for r in read_history(directory)] == [1]


async def test_a_step_that_cannot_be_written_before_unregister_is_logged_as_lost(
    tiny_model_dir, tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(step_commits, "save_checkpoint", FailingSaves(100))
    backend = artrl.LocalBackend(path=tmp_path / "artrl")
    model = artrl.TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora=None)
    await model.register(backend)
    try:
        with pytest.raises(artrl.CheckpointError):
            await model.train([group(model.name)], artrl.TrainConfig(learning_rate=1e-3))
        with caplog.at_level(logging.ERROR, logger=step_commits.__name__):
            await backend._models.unregister(model)  # (a training server's: the model closed, no error)
    finally:
        await backend.close()
    lost = [r.getMessage() for r in caplog.records if r.name == step_commits.__name__]
    assert len(lost) == 1 and "model 'm'" in lost[0] and "step 1 is lost" in lost[0], lost


async def test_a_checkpoint_a_crash_left_moved_aside_is_restored_at_register(tiny_model_dir, tmp_path):
    """A crash between publish_directory's renames leaves the step's old folder as `.old-NNNN`; registering
    the model again (its folder's lock held) puts it back and resumes from it."""
    config = artrl.TrainConfig(learning_rate=1e-3)
    checkpoints = tmp_path / "artrl" / "p" / "m" / "checkpoints"
    async with artrl.LocalBackend(path=tmp_path / "artrl") as backend:
        model = artrl.TrainableModel(name="m", project="p", base_model=str(tiny_model_dir))
        await model.register(backend)
        await model.train([group(model.name)], config)
    os.replace(checkpoints / "0001", checkpoints / ".old-0001")  # (what the crash left)
    async with artrl.LocalBackend(path=tmp_path / "artrl") as backend:
        model = artrl.TrainableModel(name="m", project="p", base_model=str(tiny_model_dir))
        await model.register(backend)
        assert await model.get_step() == 1
        assert (await model.train([group(model.name)], config)).step == 2
    assert sorted(p.name for p in checkpoints.iterdir()) == ["0001", "0002"]


async def test_export_refuses_a_folder_that_holds_files(fresh_model, tmp_path):
    """Before, model.export wrote into any folder: exported into a base model's, it overwrote its files."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"mine": true}')
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        await fresh_model.export(base)
    assert [p.name for p in base.iterdir()] == ["config.json"]
    assert (base / "config.json").read_text() == '{"mine": true}'
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "nested"):  # an empty folder, a new one
        await fresh_model.export(out)
        assert (out / "adapter_config.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert not list(tmp_path.rglob(".tmp-export-*"))


async def test_a_failed_export_leaves_no_half_written_folder(fresh_model, tmp_path, monkeypatch):
    from artrl.local.service import service as service_module

    def full_disk(model, directory: str) -> None:  # (a first file written, then the disk is full)
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "adapter_config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(service_module, "save_weights", full_disk)
    with pytest.raises(OSError, match="No space left"):
        await fresh_model.export(tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-export-*"))


async def test_training_renders_rows_with_its_own_copy_of_the_tokenizer(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The gateway decodes with the service's chat format on its own thread while model.train/train_sft
    render rows on the caller's: with one fast tokenizer for both, a request in flight during a training
    call could fail ("Already borrowed") or corrupt it. Training gets its own copy."""
    from artrl.local.train import batch, row_renderer

    used = []

    def spy(real, position):
        def call(*args, **kwargs):
            used.append(args[position])
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(batch, "build_batch", spy(batch.build_batch, 1))
    monkeypatch.setattr(row_renderer, "sft_rows", spy(row_renderer.sft_rows, 1))
    async with artrl.LocalBackend(path=tmp_path / "artrl") as backend:
        model = artrl.TrainableModel(name="m", project="p", base_model=str(tiny_model_dir))
        await model.register(backend)
        await model.train([group(model.name)], artrl.TrainConfig(learning_rate=1e-3))
        await model.train_sft(group(model.name).trajectories, artrl.SFTConfig(batch_size=2))
        gateway = backend._models.service(model).chat_format
    assert len(used) == 2
    assert all(fmt is not gateway and fmt.tokenizer is not gateway.tokenizer for fmt in used)
