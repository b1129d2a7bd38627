"""Experiment trackers: every history row (train, sft, val, ...) sent to W&B, TensorBoard or trackio.

Each tracker is an optional install imported only when a model asks for it (`report_to=`). A tracker that
fails — to import, to start, or to log — is reported with one warning and dropped: it never stops training.

A row `{"step": 3, "split": "val", "time": t, "reward_mean": 0.5}` becomes the metric `val/reward_mean` at
step 3. Only finite numbers are sent (bools as 0/1); anything else in a row stays in history.jsonl only.
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import numbers
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from artrl.storage import atomic_write_json

log = logging.getLogger(__name__)

INSTALL = "pip install 'artrl[trackers]'"
IDS_FILE = "trackers.json"  # in the model's folder: the W&B run id, so a resumed model continues its run
ROW_KEYS = ("step", "split", "time")
# how long one tracker's close may take (W&B's finish() waits on its service, which may hang: offline, a dead
# process); past it the close is left running on its daemon thread and the model's close goes on
CLOSE_TIMEOUT_S = 30.0


class Tracker(Protocol):
    """One started tracker run. `log` gets the metrics of one history row; both may raise."""

    name: str

    def log(self, metrics: dict[str, float | int], step: int, wall_time: float) -> None: ...

    def close(self) -> None: ...


def tracker_metrics(row: dict[str, Any]) -> dict[str, float | int]:
    """A history row's numbers as `{split}/{metric}`: non-numeric and non-finite values are left out."""
    split = str(row.get("split", "train"))
    out: dict[str, float | int] = {}
    for key, value in row.items():
        if key in ROW_KEYS:
            continue
        if isinstance(value, numbers.Integral):  # bools too, as 0/1
            out[f"{split}/{key}"] = int(value)
        elif isinstance(value, numbers.Real) and math.isfinite(float(value)):
            out[f"{split}/{key}"] = float(value)
    return out


class WandbTracker:
    """A W&B run with a stable id kept in the model's folder; WANDB_MODE=offline writes it only to disk."""

    name = "wandb"
    hint = (
        "run `wandb login`, or set WANDB_MODE=offline to keep the run on disk (`wandb sync` uploads it later)"
    )

    def __init__(self, directory: Path, project: str, name: str, config: dict[str, Any]) -> None:
        import wandb

        self._run = wandb.init(
            project=project,
            name=name,
            dir=str(directory),
            config=config,
            id=wandb_run_id(directory),
            resume="allow",
            reinit="create_new",  # one run per model, several models per process
            settings=wandb.Settings(console="off"),  # leave the process's stdout/stderr alone
        )

    def log(self, metrics: dict[str, float | int], step: int, wall_time: float) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


def wandb_run_id(directory: Path) -> str:
    """The model's W&B run id: read from `trackers.json` in its folder, or made and saved there."""
    path = directory / IDS_FILE
    try:
        saved = json.loads(path.read_text())
        if isinstance(saved, dict) and isinstance(saved.get("wandb_run_id"), str):
            return saved["wandb_run_id"]
    except (OSError, ValueError):
        saved = {}
    run_id = secrets.token_hex(6)
    atomic_write_json(path, {**(saved if isinstance(saved, dict) else {}), "wandb_run_id": run_id})
    return run_id


class TensorBoardTracker:
    """Scalars in event files under `{model folder}/tensorboard`, written with tensorboard's own writer
    (`tensorboard.summary.Writer`: numpy only, no torch or TensorFlow)."""

    name = "tensorboard"
    hint = "check that the tensorboard/ folder in the model's folder can be created and written"

    def __init__(self, directory: Path, project: str, name: str, config: dict[str, Any]) -> None:
        from tensorboard.summary import Writer

        (directory / "tensorboard").mkdir(parents=True, exist_ok=True)
        self._writer = Writer(str(directory / "tensorboard"))

    def log(self, metrics: dict[str, float | int], step: int, wall_time: float) -> None:
        for tag, value in metrics.items():
            self._writer.add_scalar(tag, value, step, wall_time=wall_time)
        self._writer.flush()  # one row per step: a live `tensorboard --logdir` sees it at once

    def close(self) -> None:
        self._writer.close()


class TrackioTracker:
    """A trackio run in trackio's local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio)."""

    name = "trackio"
    hint = "check that TRACKIO_DIR (or ~/.cache/huggingface/trackio) is writable"

    def __init__(self, directory: Path, project: str, name: str, config: dict[str, Any]) -> None:
        import trackio

        # trackio.init finishes the "current" run of its context: starting ours in a copy of the context
        # keeps a second model's run (or the user's own trackio run) from being finished by this one
        self._run = contextvars.copy_context().run(
            trackio.init,
            project=project,
            name=name,
            config=config,
            resume="allow",
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    def log(self, metrics: dict[str, float | int], step: int, wall_time: float) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


TRACKERS: dict[str, Callable[[Path, str, str, dict[str, Any]], Tracker]] = {
    "wandb": WandbTracker,
    "tensorboard": TensorBoardTracker,
    "trackio": TrackioTracker,
}


def warn(tracker: str, action: str, exc: BaseException, hint: str) -> None:
    log.warning(
        "experiment tracker %r failed to %s (%s: %s); it is dropped and training goes on without it. %s",
        tracker,
        action,
        type(exc).__name__,
        exc,
        hint,
    )


class Trackers:
    """The trackers of one model; `log` and `close` never raise."""

    def __init__(self, trackers: list[Any], close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self._trackers: list[Tracker] = list(trackers)
        self._close_timeout_s = close_timeout_s
        self._lock = threading.Lock()  # rows may come from the event loop and from worker threads

    @property
    def names(self) -> list[str]:
        return [tracker.name for tracker in self._trackers]

    def log(self, row: dict[str, Any]) -> None:
        """One history row: {"step": int, "split": str, "time": float, metric: number, ...}."""
        if not self._trackers:
            return
        try:
            step = int(row["step"])
            wall_time = float(row.get("time") or time.time())
            metrics = tracker_metrics(row)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("history row not sent to the experiment trackers (%s): %r", exc, row)
            return
        if not metrics:
            return
        with self._lock:
            for tracker in list(self._trackers):
                try:
                    tracker.log(metrics, step, wall_time)
                except Exception as exc:
                    self._trackers.remove(tracker)
                    warn(tracker.name, "log", exc, getattr(tracker, "hint", ""))
                    quietly_close(tracker)

    def close(self) -> None:
        """Finish every tracker's run (flush its files)."""
        with self._lock:
            trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            try:
                finished = close_within(tracker, self._close_timeout_s)
            except Exception as exc:
                warn(tracker.name, "close", exc, getattr(tracker, "hint", ""))
                continue
            if not finished:
                log.warning(
                    "experiment tracker %r did not finish its run within %g s; it is left to finish in the "
                    "background (its last rows may be missing). %s",
                    tracker.name,
                    self._close_timeout_s,
                    getattr(tracker, "hint", ""),
                )


def close_within(tracker: Tracker, timeout_s: float) -> bool:
    """`tracker.close()` on a daemon thread (one that hangs never keeps the process from exiting): whether it
    returned within `timeout_s`; raises what it raised."""
    failure: list[BaseException] = []

    def close() -> None:
        try:
            tracker.close()
        except BaseException as exc:  # (handed to the caller's thread)
            failure.append(exc)

    thread = threading.Thread(target=close, name=f"artrl-close-{tracker.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return False
    if failure:
        raise failure[0]
    return True


def quietly_close(tracker: Tracker) -> None:
    try:
        tracker.close()
    except Exception:  # already reported as failed: its run may be half-closed
        log.debug("closing the dropped tracker %r failed too", tracker.name, exc_info=True)


def open_trackers(
    names: Sequence[str], directory: Path, project: str, name: str, config: dict[str, Any]
) -> Trackers:
    """Start the named trackers for the model whose files are in `directory` (resuming its earlier run
    where the tracker supports it)."""
    opened: list[Tracker] = []
    for tracker in dict.fromkeys(names):  # each once, in the order asked
        start = TRACKERS.get(tracker)
        if start is None:
            warn(tracker, "start", ValueError("unknown tracker"), f"known trackers: {', '.join(TRACKERS)}")
            continue
        try:
            opened.append(start(Path(directory), project, name, config))
        except ImportError as exc:
            warn(tracker, "import", exc, f"install it: {INSTALL}")
        except Exception as exc:
            warn(tracker, "start", exc, getattr(start, "hint", ""))
    return Trackers(opened)
