"""Where a model's training call is, for whoever watches it from another thread (the training server
streams it to the client): plain attributes, each written by one thread and read whole."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TrainProgress:
    phase: str = "idle"  # "queued" (waiting for its turn), "training", "saving" (the checkpoint), "idle"
    rows_done: int = 0  # rows (trajectories' trained sequences) through forward and backward this call
    rows_total: int = 0
    optimizer_steps: int = 0

    def start(self, rows_total: int) -> None:
        self.rows_done, self.rows_total, self.optimizer_steps = 0, rows_total, 0
        self.phase = "training"

    def snapshot(self) -> dict[str, Any]:
        return asdict(self)
