"""Rewards for RL on math: math-verify correctness, DAPO overlong penalty."""

from aspo_lit.rewards.math_verify import (
    GradingTimeout,
    MathVerifyReward,
    OverlongBuffer,
    RewardFn,
    compute_score,
    extract_answer,
    gold_answer,
    last_boxed_only_string,
    normalize_answer,
    overlong_penalty,
    remove_boxed,
)

__all__ = [
    "GradingTimeout",
    "MathVerifyReward",
    "OverlongBuffer",
    "RewardFn",
    "compute_score",
    "extract_answer",
    "gold_answer",
    "last_boxed_only_string",
    "normalize_answer",
    "overlong_penalty",
    "remove_boxed",
]
