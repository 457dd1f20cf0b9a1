"""Rewards: math-verify correctness and the DAPO overlong penalty (math), and the sandboxed
execution reward (code, ``aspo_lit.rewards.code``)."""

from aspo_lit.rewards.math import (
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
from aspo_lit.rewards.code import CodeReward, SandboxUnavailable, code_gold, extract_code

__all__ = [
    "CodeReward",
    "SandboxUnavailable",
    "code_gold",
    "extract_code",
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
