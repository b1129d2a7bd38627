"""A Tinker training client's steps as history rows of its hosted model (split `tinker`), so that `artrl
history`, the dashboard and the model's trackers show them as they show `model.train`'s: each `optim_step`
is a step, its row the sums of the `forward_backward` calls before it (loss, datums, tokens), the step's
learning rate and gradient norm."""

from __future__ import annotations

from typing import Any

SPLIT = "tinker"


class StepRows:
    def __init__(self) -> None:
        self._since_step: dict[str, dict[str, float]] = {}  # model id -> its forward_backward sums
        self._steps: dict[str, int] = {}  # model id -> its optim_steps so far

    def forward_backward(self, model_id: str, metrics: dict[str, float], data: list[Any]) -> None:
        """Count a forward_backward call's loss and data towards the model's next step (its calls run in
        order, one at a time)."""
        sums = self._since_step.setdefault(model_id, {"loss_sum": 0.0, "datums": 0.0, "tokens": 0.0})
        sums["loss_sum"] += float(metrics["loss:sum"])
        sums["datums"] += len(data)
        sums["tokens"] += sum(len(d.input_ids) for d in data)

    def step(
        self, model_id: str, learning_rate: float, metrics: dict[str, float]
    ) -> tuple[int, dict[str, float]]:
        """The model's next step number and its row's metrics (the sums since the last step, then cleared)."""
        step = self._steps[model_id] = self._steps.get(model_id, 0) + 1
        row = {**self._since_step.pop(model_id, {}), "learning_rate": learning_rate}
        row["grad_norm"] = float(metrics["grad_norm:mean"])
        return step, row
