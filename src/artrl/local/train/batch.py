"""From scored groups to what one optimizer step trains on: rows, per-row advantages, and what was skipped."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from artrl.local.train.advantages import group_advantages
from artrl.local.train.rows import Row, trajectory_rows
from artrl.trajectory import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)


@dataclass
class TrainingBatch:
    rows: list[Row] = field(default_factory=list)  # each with its trajectory's advantage
    metrics: dict[str, float] = field(default_factory=dict)
    # for the record of the step (trajectories/train/NNNN.rows.jsonl.gz, read by the dashboard):
    locations: list[tuple[int, int]] = field(default_factory=list)  # row.trajectory -> (group, index in it)
    untrained: list[Row] = field(default_factory=list)  # rows of zero-advantage trajectories
    # filled by Trainer.step: the trainer's logprob of each token of rows[i] (None where not trained), and
    # whether it was computed before the call's first optimizer step (then it measures the sampler mismatch)
    trainer_logprobs: list[list[float | None]] = field(default_factory=list)
    before_update: list[bool] = field(default_factory=list)


def check_groups(groups: list[TrajectoryGroup]) -> None:
    """Errors a caller must fix before anything is trained or written."""
    if not groups:
        raise ValueError("train() got no groups: pass a non-empty list of TrajectoryGroup")
    for g, group in enumerate(groups):
        for t, traj in enumerate(group.trajectories):
            if not math.isfinite(traj.reward):
                raise ValueError(
                    f"group {g}, trajectory {t} has reward {traj.reward}: rewards must be finite numbers"
                )


def policy_step(traj: Trajectory) -> int | None:
    """The oldest policy step that sampled any of the trajectory's calls (the gateway's `policy_step` on each
    choice); None when no call says (choices from another server, or recorded before the field existed)."""
    return min(traj.policy_versions(), default=None)


def drop_stale(
    groups: list[TrajectoryGroup], current_step: int, max_staleness: int | None
) -> tuple[list[TrajectoryGroup], dict[str, float], list[list[int]]]:
    """The groups without trajectories sampled more than `max_staleness` steps before `current_step` (the
    step of the weights about to be updated; None keeps all), the staleness metrics of the call, and for
    each group the original places of the trajectories it kept."""
    staleness: list[int] = []
    kept_groups, origin, dropped = [], [], 0
    for group in groups:
        kept, places = [], []
        for t, traj in enumerate(group.trajectories):
            sampled = policy_step(traj)
            if sampled is not None:
                staleness.append(max(0, current_step - sampled))
                if max_staleness is not None and current_step - sampled > max_staleness:
                    dropped += 1
                    continue
            kept.append(traj)
            places.append(t)
        origin.append(places)
        kept_groups.append(
            group if len(kept) == len(group.trajectories) else group.model_copy(update={"trajectories": kept})
        )
    metrics = {
        "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "staleness_max": float(max(staleness, default=0)),
        "trajectories_dropped_stale": dropped,
    }
    return kept_groups, metrics, origin


def build_batch(
    groups: list[TrajectoryGroup],
    chat_format: Any,
    max_context: int,
    scale_rewards: bool,
    eps: float,
    allow_rendered: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> TrainingBatch:
    """The rows of one step (groups already checked with `check_groups`)."""
    usable = [g for g in groups if len(g.trajectories) >= 2]
    rewards = [[t.reward for t in g.trajectories] for g in usable]
    computed = group_advantages(rewards, scale_rewards=scale_rewards, eps=eps)
    batch = TrainingBatch()
    skipped_untrainable = skipped_long = 0
    index = 0
    usable_at = [g for g, group in enumerate(groups) if len(group.trajectories) >= 2]
    for g, group, advantages in zip(usable_at, usable, computed.advantages, strict=True):
        for t, (traj, advantage) in enumerate(zip(group.trajectories, advantages, strict=True)):
            rows = trajectory_rows(traj, index, chat_format, allow_rendered, template_kwargs)
            batch.locations.append((g, t))
            index += 1
            if not rows:
                skipped_untrainable += 1
                continue
            for row in rows:
                if len(row.ids) > max_context:
                    skipped_long += 1
                    log.warning(
                        "skipping a row of %d tokens: longer than the context (%d)", len(row.ids), max_context
                    )
                    continue
                if advantage != 0.0:
                    row.advantage = advantage
                    batch.rows.append(row)
                else:
                    batch.untrained.append(row)
    all_rewards = [r for group in rewards for r in group]
    singletons = len(groups) - len(usable)
    if singletons:
        log.warning("%d group(s) of fewer than 2 trajectories carry no relative signal: skipped", singletons)
    mean = sum(all_rewards) / len(all_rewards) if all_rewards else 0.0
    batch.metrics = {
        "groups": len(groups),
        "trajectories": sum(len(g.trajectories) for g in groups),
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in all_rewards) / len(all_rewards))
        if all_rewards
        else 0.0,
        "groups_skipped_too_small": singletons,
        "groups_zero_variance": computed.zero_variance_groups,
        "trajectories_without_trainable_turns": skipped_untrainable,
        "rows_skipped_too_long": skipped_long,
        "rows": len(batch.rows),
        "trainable_tokens": sum(r.trainable_tokens for r in batch.rows),
    }
    batch.metrics = {
        **rollout_metrics(groups, batch),
        **batch.metrics,
    }  # (a user's `reward` metric: not ours)
    return batch


def rollout_metrics(groups: list[TrajectoryGroup], batch: TrainingBatch) -> dict[str, float]:
    """What a training row says of the rollouts besides rewards: the rate of rollouts that raised (the
    groups' `exceptions`), the sampled tokens per trajectory, and the mean of each of the user's own
    trajectory metrics (`trajectory.metrics["win"]` -> `win_mean`, as `model.log` writes them)."""
    trajectories = [t for g in groups for t in g.trajectories]
    failed = sum(len(g.exceptions) for g in groups)
    sampled = {}
    for row in [*batch.rows, *batch.untrained]:
        sampled[row.trajectory] = sampled.get(row.trajectory, 0) + row.trainable_tokens
    out = {
        "exception_rate": failed / (failed + len(trajectories)) if failed + len(trajectories) else 0.0,
        "completion_tokens_mean": sum(sampled.values()) / len(sampled) if sampled else 0.0,
    }
    for name in sorted({k for t in trajectories for k in t.metrics}):
        values = [float(t.metrics[name]) for t in trajectories if name in t.metrics]
        out[f"{name}_mean"] = sum(values) / len(values)
    return out


def _rounded(values: list[float | None]) -> list[float | None]:
    return [None if v is None or math.isnan(v) else round(v, 4) for v in values]


def step_record(batch: TrainingBatch) -> list[dict[str, Any]]:
    """What one GRPO step trained, row by row and token by token (JSON-ready): ids, mask, the sampler's and
    the trainer's logprobs, the advantage and weight; rows of zero-advantage trajectories with trained=False."""
    records: list[dict[str, Any]] = []
    seen: dict[int, int] = {}  # rows so far per trajectory
    trained = [(r, i) for i, r in enumerate(batch.rows)] + [(r, None) for r in batch.untrained]
    for row, i in trained:
        group, position = batch.locations[row.trajectory]
        seen[row.trajectory] = seen.get(row.trajectory, -1) + 1
        has_trainer = i is not None and i < len(batch.trainer_logprobs) and batch.trainer_logprobs[i]
        records.append(
            {
                "group": group,
                "trajectory": position,
                "row": seen[row.trajectory],
                "trained": i is not None,
                "advantage": row.advantage,
                "weight": row.weight,
                "ids": row.ids,
                "mask": row.mask,
                "sampler_logprobs": _rounded(row.logprobs),
                "trainer_logprobs": _rounded(batch.trainer_logprobs[i]) if has_trainer else None,
                "before_update": bool(i is not None and has_trainer and batch.before_update[i]),
            }
        )
    records.sort(key=lambda r: (r["group"], r["trajectory"], r["row"]))
    return records
