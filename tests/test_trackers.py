"""Experiment trackers with each library's real local writer: the tiny model trains, and W&B (offline),
TensorBoard and trackio each hold history.jsonl's metrics, read back with the library's own reader. A
tracker that fails to import, start or log only warns once and is dropped; training goes on."""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from scored_rollouts import rollouts

import artrl
from artrl.history.trackers import Trackers, open_trackers, tracker_metrics, wandb_run_id
from artrl.storage import model_dir, read_history

ALL = ("wandb", "tensorboard", "trackio")


def tracker_env(root: Path) -> dict[str, str]:
    """W&B offline and every tracker's files under `root`: nothing reaches the network or the home folder."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        **{
            f"WANDB_{k}_DIR": str(root / f"wandb-{k.lower()}")
            for k in ("CONFIG", "CACHE", "DATA", "ARTIFACT")
        },
        "TRACKIO_DIR": str(root / "trackio"),
    }


@pytest.fixture(scope="module")
def trackio_dir(tmp_path_factory: pytest.TempPathFactory):
    """The env of `tracker_env` for this module's tests (set before trackio is first imported: it reads
    TRACKIO_DIR once, at import)."""
    root = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in tracker_env(root).items():
            patch.setenv(key, value)
        if "trackio" in sys.modules:
            from trackio.utils import TRACKIO_DIR

            assert root / "trackio" == TRACKIO_DIR, "trackio was imported before this module set TRACKIO_DIR"
        yield root / "trackio"


# --- each library's own reader: {(tag, step): value} ---


def expected_metrics(history: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    return {
        (f"{row['split']}/{key}", row["step"]): float(value)
        for row in history
        for key, value in row.items()
        if key not in ("step", "split", "time") and isinstance(value, int | float) and math.isfinite(value)
    }


def tensorboard_metrics(logdir: Path) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    events = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    return {
        (tag, event.step): float(tensor_util.make_ndarray(event.tensor_proto))
        for tag in events.Tags()[event_accumulator.TENSORS]
        for event in events.Tensors(tag)
    }


def wandb_records(path: Path) -> list[Any]:
    """The records of an offline run's `.wandb` file: wandb's own protobuf `Record`s, framed in 32 KiB blocks
    of chunks (crc32 4 bytes, length 2, kind 1: full, first, middle, last) after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    data, records, parts = path.read_bytes(), [], []
    assert data[:4] == b":W&B", data[:7]
    pos = 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is zero padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def wandb_runs(directory: Path) -> list[tuple[Any, dict[tuple[str, int], float]]]:
    """(run record, metrics) of each offline run of the model (a resumed model adds a run, same id)."""
    runs = []
    for path in sorted(directory.glob("wandb/offline-run-*/run-*.wandb")):
        records = wandb_records(path)
        metrics = {}
        for record in (r for r in records if r.WhichOneof("record_type") == "history"):
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            metrics.update({(k, items["_step"]): float(v) for k, v in items.items() if not k.startswith("_")})
        runs.append((next(r.run for r in records if r.WhichOneof("record_type") == "run"), metrics))
    return runs


def trackio_metrics(trackio_dir: Path, project: str, run: str) -> dict[tuple[str, int], float]:
    """Read with trackio's storage reader, in a process of its own (trackio fixes TRACKIO_DIR at import)."""
    code = (
        "import json, sys; from trackio.sqlite_storage import SQLiteStorage; "
        "print(json.dumps(SQLiteStorage.get_logs(sys.argv[1], sys.argv[2])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, project, run],
        env={**os.environ, "TRACKIO_DIR": str(trackio_dir)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    logs = json.loads(out.strip().splitlines()[-1])
    return {
        (key, log["step"]): float(value)
        for log in logs
        for key, value in log.items()
        if key not in ("step", "timestamp") and isinstance(value, int | float)
    }


# --- training with the three trackers ---


async def train_and_validate(backend: artrl.LocalBackend, model: artrl.TrainableModel) -> None:
    await model.register(backend)
    try:
        await model.train(
            [await rollouts(model, [1, 0, 0, 1], max_tokens=6)], config=artrl.TrainConfig(learning_rate=1e-2)
        )
        await model.log([await rollouts(model, [0.25, 0.75], max_tokens=6)], "val")
    finally:
        await backend.close()


async def test_each_tracker_receives_the_history_and_a_resumed_model_continues_its_run(
    tiny_model_dir, tmp_path, trackio_dir
):
    root = tmp_path / "artrl"
    model = artrl.TrainableModel(name="tiny", project="trk", base_model=str(tiny_model_dir), report_to=ALL)
    await train_and_validate(artrl.LocalBackend(path=root), model)
    directory = model_dir(root, "trk", "tiny")
    run_id = json.loads((directory / "trackers.json").read_text())["wandb_run_id"]
    # a second process would do the same: a new backend on the same folder resumes the model at step 1
    await train_and_validate(artrl.LocalBackend(path=root), model)

    history = read_history(directory)
    assert [(r["split"], r["step"]) for r in history] == [("train", 1), ("val", 1), ("train", 2), ("val", 2)]
    expected = expected_metrics(history)
    assert {"train/reward_mean", "train/rows", "val/reward_mean"} <= {tag for tag, _ in expected}

    assert tensorboard_metrics(directory / "tensorboard") == pytest.approx(expected, rel=1e-6)  # float32
    assert len(list((directory / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per process

    runs = wandb_runs(directory)
    assert [(r.run_id, r.project, r.display_name) for r, _ in runs] == [(run_id, "trk", "tiny")] * 2
    assert {k: v for _, metrics in runs for k, v in metrics.items()} == expected
    assert {step for _, step in runs[1][1]} == {2}  # the resumed run carries on at step 2

    assert trackio_metrics(trackio_dir, "trk", "tiny") == expected


async def test_failing_trackers_only_warn_and_training_goes_on(
    tiny_model_dir, tmp_path, trackio_dir, caplog, monkeypatch
):
    root = tmp_path / "artrl"
    directory = model_dir(root, "broken", "tiny")
    directory.mkdir(parents=True)
    (directory / "tensorboard").write_text("a file where the event folder should go")  # cannot start
    monkeypatch.setitem(sys.modules, "trackio", None)  # `import trackio` raises ImportError
    (directory / "trackers.json").mkdir()  # where the W&B run id is kept: wandb cannot start
    model = artrl.TrainableModel(name="tiny", project="broken", base_model=str(tiny_model_dir), report_to=ALL)
    with caplog.at_level(logging.WARNING, logger="artrl.history.trackers"):
        await train_and_validate(artrl.LocalBackend(path=root), model)
    assert [(r["split"], r["step"]) for r in read_history(directory)] == [("train", 1), ("val", 1)]
    warnings = [r.getMessage() for r in caplog.records if r.name == "artrl.history.trackers"]
    assert len(warnings) == 3, warnings
    assert "'wandb' failed to start (IsADirectoryError" in warnings[0] and "trackers.json" in warnings[0]
    assert "'tensorboard' failed to start" in warnings[1] and "tensorboard/" in warnings[1]
    assert "'trackio' failed to import" in warnings[2] and "pip install 'artrl[trackers]'" in warnings[2]
    assert all("training goes on" in w for w in warnings)


# --- the pieces, with fakes ---


class FakeTracker:
    def __init__(self, name: str, fail_log: bool = False, fail_close: bool = False) -> None:
        self.name, self.fail_log, self.fail_close = name, fail_log, fail_close
        self.logged: list[tuple[dict[str, float | int], int, float]] = []
        self.closed = 0

    def log(self, metrics: dict[str, float | int], step: int, wall_time: float) -> None:
        self.logged.append((metrics, step, wall_time))
        if self.fail_log:
            raise OSError("disk full")

    def close(self) -> None:
        self.closed += 1
        if self.fail_close:
            raise RuntimeError("cannot finish")


def test_a_tracker_that_raises_is_dropped_with_one_warning_and_the_others_go_on(caplog):
    broken, good = FakeTracker("broken", fail_log=True), FakeTracker("good")
    bad_close = FakeTracker("bc", fail_close=True)
    trackers = Trackers([broken, good, bad_close])
    for step in (1, 2, 3):
        trackers.log({"step": step, "split": "train", "time": 10.0 + step, "loss": 0.5})
    trackers.close()
    trackers.log({"step": 4, "split": "train", "time": 1.0, "loss": 0.5})  # after close: nothing, no error
    trackers.close()
    assert len(broken.logged) == 1 and broken.closed == 1  # dropped after its first failure
    assert good.logged == [({"train/loss": 0.5}, s, 10.0 + s) for s in (1, 2, 3)] and good.closed == 1
    assert bad_close.closed == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "artrl.history.trackers"]
    assert len(warnings) == 2
    assert "'broken' failed to log (OSError: disk full)" in warnings[0]
    assert "'bc' failed to close (RuntimeError: cannot finish)" in warnings[1]


def test_rows_become_split_prefixed_finite_numbers(caplog):
    row = {"step": 3, "split": "val", "time": 1.5, "reward_mean": 0.5, "rows": 4, "ok": True}
    row |= {"nan": float("nan"), "inf": float("-inf"), "note": "text", "none": None, "list": [1, 2]}
    assert tracker_metrics(row) == {"val/reward_mean": 0.5, "val/rows": 4, "val/ok": 1}
    fake = FakeTracker("fake")
    Trackers([fake]).log({"split": "train", "loss": 1.0})  # no step: a warning, nothing sent, nothing raised
    Trackers([fake]).log({"step": 1, "split": "train", "note": "text"})  # no numbers: nothing sent
    assert fake.logged == [] and "not sent to the experiment trackers" in caplog.records[-1].getMessage()


def test_unknown_tracker_warns_and_wandb_run_id_is_stable(tmp_path, caplog):
    assert open_trackers(["mlflow"], tmp_path, "p", "n", {}).names == []
    assert "'mlflow' failed to start (ValueError: unknown tracker)" in caplog.records[-1].getMessage()
    first = wandb_run_id(tmp_path)
    assert wandb_run_id(tmp_path) == first and len(first) == 12
    (tmp_path / "trackers.json").write_text("{not json")
    assert wandb_run_id(tmp_path) != first  # a broken file: a new run rather than no run
