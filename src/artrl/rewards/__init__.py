"""Rewards computed after the rollouts: a relative LLM judge (`ruler_score_group`) for groups of
trajectories. Light like `artrl` itself (no torch)."""

from artrl.rewards.judge_prompt import (
    DEFAULT_RUBRIC,
    JudgeOutputError,
    build_judge_messages,
    cache_key,
    common_prefix,
    parse_scores,
    render_messages,
)
from artrl.rewards.ruler import JudgeCache, JudgeError, ruler_score_group, ruler_scores, trajectory_ids

__all__ = [
    "DEFAULT_RUBRIC",
    "JudgeCache",
    "JudgeError",
    "JudgeOutputError",
    "build_judge_messages",
    "cache_key",
    "common_prefix",
    "parse_scores",
    "render_messages",
    "ruler_score_group",
    "ruler_scores",
    "trajectory_ids",
]
