"""Experiment trackers' files read back with each library's own reader, as {(tag, step): value}, and the
environment that keeps every tracker's files under one folder (W&B offline: nothing reaches the network)."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any


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
