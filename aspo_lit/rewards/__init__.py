"""Rewards: math correctness (``MathReward``: DeepScaleR's and math-verify's verifiers combined by
a rule, ``verifiers``; its grading pool, ``pool``; gold answers as a model writes them,
``golds``), the sandboxed execution reward (code, ``aspo_lit.rewards.code``), and DAPO's overlong
penalty (``shaping``)."""

from aspo_lit.rewards.code import CodeReward, SandboxUnavailable, code_gold, extract_code
from aspo_lit.rewards.golds import normalize_gold
from aspo_lit.rewards.math import (
    RewardFn,
    compute_score,
    extract_answer,
    gold_answer,
    last_boxed_only_string,
    normalize_answer,
    remove_boxed,
)
from aspo_lit.rewards.reward import MathReward, MathVerifyReward
from aspo_lit.rewards.shaping import overlong_penalty
from aspo_lit.rewards.verifiers import VERIFIERS

__all__ = [
    "CodeReward",
    "SandboxUnavailable",
    "code_gold",
    "extract_code",
    "MathReward",
    "MathVerifyReward",
    "RewardFn",
    "VERIFIERS",
    "compute_score",
    "extract_answer",
    "gold_answer",
    "last_boxed_only_string",
    "normalize_answer",
    "normalize_gold",
    "overlong_penalty",
    "remove_boxed",
]
