"""The verifier rules: which of DeepScaleR's and math-verify's verdicts make a response correct
(paper Appendix B: "the official verification functions from both DeepScaleR and Math-Verify,
following the protocol in [8]", [8] being Skywork-OR1; docs/grading.md has the sources).

The authors' released grader (Archer2.0 ``rewards/general_reward.py``, ``RewardMathFn.__call__``)
runs DeepScaleR's ``grade_answer_mathd or grade_answer_sympy`` on the last box, then Skywork-OR1's
math-verify step (``verl/utils/reward_score/livecodebench/compute_score.py``,
``math_verify_reward_function``): math-verify's default ``parse`` of the whole answer text, correct
when its extracted string is the gold string, else when ``math_verify.verify`` accepts the parsed
gold and answer. In the Archer2.0 copy that last branch builds a ``RewardOutput`` without
returning it, so it never counts.

* ``either`` (the default): DeepScaleR's verdict, or Skywork-OR1's math-verify step in full: the
  rule the paper states, as Skywork-OR1 runs its part (the released grader with its ``return``).
* ``released``: the released grader as it runs: DeepScaleR's verdict, or the string match alone.
* ``math_verify``: this package's math-verify grading alone (``aspo_lit.rewards.math``: the last
  box, parsed with boxed answers first). ``deepscaler``: DeepScaleR's verdict alone.

Every rule grades the text after the last ``think_end_token`` (Archer2.0 splits at the first;
the two differ only for a response that closes its thinking twice), and, with ``fast_path``,
scores 1 without a verifier when the last boxed answer (as the rule's first verifier reads it)
equals the gold after a light, meaning-preserving normalisation. Time: the whole call is bounded
by ``timeout_s`` in a main thread (``aspo_lit.rewards.math.grading_deadline``), and no step starts
past ``timeout_s`` from the call's start.
"""

from __future__ import annotations

import functools
import time
from typing import Literal, get_args

from aspo_lit.rewards import deepscaler
from aspo_lit.rewards.math import (
    bounded_in_main_thread,
    extract_answer,
    gold_answer,
    load_math_verify,
    math_verify_score,
    shortcut_score,
)

__all__ = ["VERIFIERS", "Verifier", "grade", "load_verifiers", "quick_score"]

Verifier = Literal["either", "released", "math_verify", "deepscaler"]
VERIFIERS: tuple[str, ...] = get_args(Verifier)


def _after_thinking(text: str, think_end_token: str | None) -> str:
    if think_end_token and think_end_token in text:
        return text.rsplit(think_end_token, 1)[1]
    return text


def quick_score(text: str, gold: str, verifier: str, think_end_token: str | None = "</think>",
                fast_path: bool = True) -> float | None:
    """The score when it needs no verifier (nothing to grade, an exact match, an answer too
    large to read); None when a verifier must decide."""
    solution = _after_thinking(text, think_end_token)
    gold_content = gold_answer(gold)
    if verifier == "math_verify":
        return shortcut_score(extract_answer(solution, None), gold_content, fast_path)
    boxed = deepscaler.extract_boxed(solution)
    if verifier == "deepscaler":
        return shortcut_score(boxed, gold_content, fast_path)
    if fast_path and boxed is not None and shortcut_score(boxed, gold_content, True) == 1.0:
        return 1.0
    return None if solution.strip() else 0.0  # math-verify's step reads unboxed answers too


def skywork_math_verify(solution: str, gold: str, semantic: bool = True) -> bool:
    """Skywork-OR1's ``math_verify_reward_function``: math-verify's default ``parse`` of the whole
    ``solution``; correct when the extracted string is ``gold``, else (``semantic``) when
    ``verify(parse("\\\\boxed{gold}"), parsed)`` holds. Never raises; a timeout is not correct."""
    mv, _, timeout_exception = load_math_verify()
    try:
        parsed = mv.parse(solution, parsing_timeout=None, raise_on_error=True)
        if len(parsed) < 2:
            return False
        if parsed[1] == gold:
            return True
        if not semantic:
            return False
        return bool(mv.verify(list(_skywork_gold(gold)), parsed, timeout_seconds=None, raise_on_error=True))
    except (Exception, timeout_exception):  # noqa: BLE001 - malformed or timed out: not correct
        return False


@functools.lru_cache(maxsize=4096)
def _skywork_gold(gold: str) -> tuple:
    """math-verify's default ``parse`` of ``\\boxed{gold}``, cached (a group's samples share one
    gold); a timeout raises through it, so it is never cached."""
    mv, _, _ = load_math_verify()
    return tuple(mv.parse(f"\\boxed{{{gold}}}", parsing_timeout=None, raise_on_error=True))


def grade(solution_str: str, ground_truth: str, verifier: Verifier = "either", timeout_s: float = 5.0,
          think_end_token: str | None = "</think>", fast_path: bool = True) -> float:
    """1.0 if ``verifier`` accepts the response's final answer against the gold, else 0.0; never
    raises on any text. Run it in a main thread (signals bound each step) or in ``GradingPool``
    workers. ``verifier`` is taken as checked (``MathReward`` checks it once, when it is built)."""
    quick = quick_score(solution_str, ground_truth, verifier, think_end_token, fast_path)
    if quick is not None:
        return quick
    return bounded_in_main_thread(_grade, timeout_s, solution_str, ground_truth, verifier, timeout_s,
                                  think_end_token)


def _grade(solution_str: str, ground_truth: str, verifier: str, timeout_s: float,
           think_end_token: str | None) -> float:
    """The verifiers' part of ``grade``, one step after the other; no step starts past
    ``timeout_s`` (the steps set no alarm of their own: ``grading_deadline`` bounds them all)."""
    deadline = time.monotonic() + timeout_s
    solution = _after_thinking(solution_str, think_end_token)
    gold = gold_answer(ground_truth)
    if verifier == "math_verify":
        return math_verify_score(gold, extract_answer(solution, None))
    if deepscaler.deepscaler_correct(deepscaler.extract_boxed(solution), gold):
        return 1.0
    if verifier == "deepscaler" or time.monotonic() >= deadline:
        return 0.0
    return float(skywork_math_verify(solution, str(ground_truth), semantic=verifier == "either"))


def load_verifiers(verifier: str = "either") -> None:
    """Import what ``verifier`` needs (slow); pool workers call it before taking items."""
    if verifier != "deepscaler":
        load_math_verify()
    if verifier != "math_verify":
        deepscaler.load_deepscaler()
