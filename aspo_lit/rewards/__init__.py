"""Rewards: math-verify correctness (math; its grading pool, ``pool``), the sandboxed execution
reward (code, ``aspo_lit.rewards.code``), and DAPO's overlong penalty (``shaping``)."""

from aspo_lit.rewards.math import (
    MathVerifyReward,
    RewardFn,
    compute_score,
    extract_answer,
    gold_answer,
    last_boxed_only_string,
    normalize_answer,
    remove_boxed,
)
from aspo_lit.rewards.code import CodeReward, SandboxUnavailable, code_gold, extract_code
from aspo_lit.rewards.shaping import overlong_penalty

__all__ = [
    "CodeReward",
    "SandboxUnavailable",
    "code_gold",
    "extract_code",
    "MathVerifyReward",
    "RewardFn",
    "compute_score",
    "extract_answer",
    "gold_answer",
    "last_boxed_only_string",
    "normalize_answer",
    "overlong_penalty",
    "remove_boxed",
]
