"""Re-publishing a folder (storage.publish_directory over an existing checkpoint or tokenizer): a crash at any
instant leaves the old folder or the new one, and a crash between its renames is put back on reopening."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from artrl.local.runs.run_folder import open_run
from artrl.storage import latest_step, lock_model_dir, publish_directory


def folder(path: Path, weights: str) -> Path:
    path.mkdir(parents=True)
    (path / "weights.bin").write_text(weights)
    return path


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run folder whose step 1 is being re-published: `checkpoints/0001` (old) and `.tmp-0001` (new)."""
    directory = tmp_path / "p" / "m"
    directory.mkdir(parents=True)
    (directory / "model.json").write_text(json.dumps({"name": "m", "base_model": "base"}))
    folder(directory / "checkpoints" / "0001", "old")
    folder(directory / "checkpoints" / ".tmp-0001", "new")
    return directory


def crash_before_the_new_folder_lands(monkeypatch, tmp: Path) -> None:
    """os.replace fails (the process dies there) for the rename of `tmp` into place, and only for it."""
    real = os.replace

    def replace(src, dst) -> None:
        if Path(src) == tmp:
            raise OSError(errno.EIO, "the process died here")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def test_a_republish_replaces_the_folder_and_leaves_nothing_aside(run):
    checkpoints = run / "checkpoints"
    publish_directory(checkpoints / ".tmp-0001", checkpoints / "0001")
    assert (checkpoints / "0001" / "weights.bin").read_text() == "new"
    assert [p.name for p in checkpoints.iterdir()] == ["0001"]


def test_a_crash_between_the_renames_of_a_republish_loses_no_step(run, monkeypatch):
    """Before: the old folder was deleted, then the new one renamed in; a crash between the two lost the
    step. Now the old one is moved aside and, the crash over, opening the run puts it back."""
    checkpoints = run / "checkpoints"
    crash_before_the_new_folder_lands(monkeypatch, checkpoints / ".tmp-0001")
    with pytest.raises(OSError, match="died here"):
        publish_directory(checkpoints / ".tmp-0001", checkpoints / "0001")
    monkeypatch.undo()
    step, path = open_run(run).checkpoint()
    assert step == 1 and (path / "weights.bin").read_text() == "old"
    assert latest_step(run) == 1 and not list(checkpoints.glob(".old-*"))


def test_a_folder_moved_aside_is_left_alone_while_a_process_has_the_run(run, monkeypatch):
    """The lock held: that process may be mid-publish this instant (its folder moved aside for a moment)."""
    checkpoints = run / "checkpoints"
    crash_before_the_new_folder_lands(monkeypatch, checkpoints / ".tmp-0001")
    with pytest.raises(OSError):
        publish_directory(checkpoints / ".tmp-0001", checkpoints / "0001")
    monkeypatch.undo()
    lock = lock_model_dir(run)
    try:
        open_run(run)
        assert (checkpoints / ".old-0001").is_dir() and not (checkpoints / "0001").exists()
    finally:
        lock.release()
    assert open_run(run).checkpoint()[0] == 1  # (free now: put back)


def test_a_crash_after_the_new_folder_landed_keeps_the_new_one(run, monkeypatch):
    """The crash came after both renames, before the old folder was removed: the new one stays."""
    import shutil

    checkpoints = run / "checkpoints"
    monkeypatch.setattr(shutil, "rmtree", lambda *args, **kwargs: None)  # (nothing removed: a crash)
    publish_directory(checkpoints / ".tmp-0001", checkpoints / "0001")
    monkeypatch.undo()
    assert (checkpoints / ".old-0001").is_dir()
    assert (open_run(run).checkpoint()[1] / "weights.bin").read_text() == "new"
    assert [p.name for p in checkpoints.iterdir()] == ["0001"]


CHILD = """
import sys
from pathlib import Path
from artrl.storage import publish_directory
directory = Path(sys.argv[1])
for i in range(10**9):
    tmp = directory / "checkpoints" / ".tmp-0001"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "weights.bin").write_text(f"version {i} " * 2000)
    publish_directory(tmp, directory / "checkpoints" / "0001")
    if i == 0:
        print("publishing", flush=True)
"""


@pytest.mark.slow  # (10 processes killed mid-loop: a few seconds)
def test_kill_9_during_republishes_always_leaves_a_whole_step(tmp_path):
    """A process re-publishing step 1 in a loop, killed with SIGKILL at 10 moments: each time the step is
    there, whole (one version's file), once what a kill between the renames left is put back."""
    import random
    import signal
    import subprocess
    import sys
    import time

    from artrl.storage import restore_interrupted_publishes

    directory = tmp_path / "p" / "m"
    rng = random.Random(0)
    restored = 0
    for _ in range(10):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(directory)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout.readline().strip() == "publishing"
        time.sleep(rng.uniform(0.0, 0.3))
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        restored += len(restore_interrupted_publishes(directory))
        text = (directory / "checkpoints" / "0001" / "weights.bin").read_text()
        version = text.split()[1]
        assert text == f"version {version} " * 2000  # (one version, whole)
        assert not list((directory / "checkpoints").glob(".old-*"))
    print(
        f"\nKILL-9 RE-PUBLISH: 10/10 left step 1 whole; {restored} restored from a kill between the renames"
    )
