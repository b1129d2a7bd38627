"""Experiment trackers with each library's real local writer: the tiny model trains, and W&B (offline),
TensorBoard and trackio each hold history.jsonl's metrics, read back with the library's own reader; a run's
rows sent to the trackers directly reach each at its step. A tracker that fails to import, start or log
only warns once and is dropped; training goes on."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any

import pytest
from scored_rollouts import rollouts
from tracker_readers import expected_metrics, tensorboard_metrics, tracker_env, trackio_metrics, wandb_runs

import artrl
from artrl.history.trackers import Trackers, open_trackers, tracker_metrics, wandb_run_id
from artrl.storage import model_dir, read_history

ALL = ("wandb", "tensorboard", "trackio")


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


def test_every_row_of_a_run_reaches_each_tracker_at_its_step(tmp_path, trackio_dir):
    """A run's rows as a training script logs them, sent through the trackers directly (no model, no
    training): validation before the first step (step 0) and every 4 steps with a trajectory metric
    (success_mean), a train row at every step; a non-finite loss and a text are left out. Each tracker
    holds every number at its own step."""
    rows: list[dict[str, Any]] = [
        {"step": 0, "split": "val", "time": 100.0, "reward_mean": 0.1, "success_mean": 0.0}
    ]
    for step in range(1, 9):
        loss = float("nan") if step == 3 else 0.5 / step
        rows.append(
            {
                "step": step,
                "split": "train",
                "time": 100.0 + step,
                "reward_mean": step / 10,
                "rows": 4 + step,
                "loss": loss,
                "note": "text",
            }
        )
        if step % 4 == 0:
            rows.append(
                {
                    "step": step,
                    "split": "val",
                    "time": 100.5 + step,
                    "reward_mean": step / 8,
                    "success_mean": step / 16,
                }
            )
    trackers = open_trackers(ALL, tmp_path, "rows", "run-1", {"learning_rate": 1e-2})
    assert trackers.names == list(ALL)
    for row in rows:
        trackers.log(row)
    trackers.close()

    expected = expected_metrics(rows)
    assert sorted(s for tag, s in expected if tag == "train/reward_mean") == list(range(1, 9))
    assert sorted(s for tag, s in expected if tag == "val/success_mean") == [0, 4, 8]
    assert ("train/loss", 3) not in expected and ("train/loss", 4) in expected
    assert tensorboard_metrics(tmp_path / "tensorboard") == pytest.approx(expected, rel=1e-6)  # float32
    ((run, metrics),) = wandb_runs(tmp_path)
    assert (run.project, run.display_name) == ("rows", "run-1") and metrics == expected
    assert trackio_metrics(trackio_dir, "rows", "run-1") == expected


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


def test_a_tracker_whose_close_hangs_is_left_behind_with_a_warning(caplog):
    """W&B's finish() may wait forever on its service: the model's close goes on without it."""
    release = threading.Event()
    hanging, good = FakeTracker("hanging"), FakeTracker("good")
    hanging.close = lambda: release.wait(60)  # type: ignore[method-assign]
    trackers = Trackers([hanging, good], close_timeout_s=0.2)
    started = time.monotonic()
    try:
        trackers.close()
        assert time.monotonic() - started < 10 and good.closed == 1  # the next tracker still closes
    finally:
        release.set()
    warnings = [r.getMessage() for r in caplog.records if r.name == "artrl.history.trackers"]
    assert len(warnings) == 1 and "'hanging' did not finish its run within 0.2 s" in warnings[0]


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
