"""Group-relative advantages (GRPO): each trajectory is compared with the others of its group.

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)      scale_rewards=True  (GRPO)
    A_i =  r_i - mean(r_group)                               scale_rewards=False (Dr.GRPO)

std is the population standard deviation. A group whose rewards are all equal has A = 0 for every member:
it carries no signal and is counted in the metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: list[list[float]]  # per group, per trajectory
    zero_variance_groups: int


def group_advantages(
    rewards: list[list[float]], scale_rewards: bool = True, eps: float = 1e-6
) -> GroupAdvantages:
    out: list[list[float]] = []
    flat = 0
    for group in rewards:
        for r in group:
            if not math.isfinite(r):
                raise ValueError(f"reward {r} is not a finite number; fix the reward function")
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        if max(group) == min(group):
            flat += 1
            out.append([0.0] * len(group))
            continue
        out.append([(r - mean) / (std + eps) if scale_rewards else r - mean for r in group])
    return GroupAdvantages(out, flat)
