"""The verifier rules: which of DeepScaleR's and math-verify's verdicts make a response correct
(paper Appendix B: "the official verification functions from both DeepScaleR and Math-Verify";
docs/grading.md has the sources).

* ``either`` (the default): correct when either verifier accepts, each on the last boxed answer as
  it extracts it: DeepScaleR's ``grade_answer_mathd or grade_answer_sympy``
  (``aspo_lit.rewards.deepscaler``), or math-verify's ``verify`` (``aspo_lit.rewards.math``).
* ``released``: the authors' ``RewardMathFn`` as released (Archer2.0
  ``rewards/general_reward.py``): DeepScaleR's verdict on the last box, else math-verify's
  ``parse`` of the whole answer text with its default extraction, correct only when the extracted
  string equals the gold string; its ``math_verify.verify`` fallback builds a result it never
  returns, so it never counts.
* ``math_verify``: math-verify alone. ``deepscaler``: DeepScaleR alone.

Every rule grades the text after the last ``think_end_token`` (Archer2.0 splits at the first;
the two differ only for a response that closes its thinking twice), and, with ``fast_path``,
scores 1 without a verifier when the last boxed answer equals the gold after a light,
meaning-preserving normalisation. Time: each verifier's step gets ``timeout_s`` (whole seconds,
``signal.alarm``, main thread only), and no step starts past ``timeout_s`` from the call's start.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Literal

from aspo_lit.rewards import deepscaler
from aspo_lit.rewards.math import (
    _outer_timer_kept,
    _quick_score,
    _verify,
    extract_answer,
    gold_answer,
    load_math_verify,
)

__all__ = ["VERIFIERS", "Verifier", "grade", "load_verifiers", "quick_score"]

Verifier = Literal["either", "released", "math_verify", "deepscaler"]
VERIFIERS: tuple[str, ...] = ("either", "released", "math_verify", "deepscaler")


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
    ours = extract_answer(solution, None)
    if verifier == "math_verify":
        return _quick_score(ours, gold_content, fast_path)
    theirs = deepscaler.extract_boxed(solution)
    if verifier == "deepscaler":
        return _quick_score(theirs, gold_content, fast_path)
    read = (ours, theirs) if verifier == "either" else (theirs,)  # each rule's own extraction(s)
    if fast_path and any(a is not None and _quick_score(a, gold_content, True) == 1.0 for a in read):
        return 1.0
    if verifier == "either" and ours is None and theirs is None:
        return 0.0
    return None


def _seconds_left(deadline: float) -> int | None:
    """Whole seconds for the next step's alarm (None outside the main thread: no signals)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return max(1, math.ceil(deadline - time.monotonic()))


def _string_match(solution: str, gold: str, seconds: int | None) -> bool:
    """Archer2.0's ``RewardMathFn`` after DeepScaleR: math-verify's default ``parse`` of the whole
    solution; correct when its extracted string is the gold string (no ``verify``: see module doc)."""
    mv, _, timeout_exception = load_math_verify()
    try:
        parsed = mv.parse(solution, parsing_timeout=seconds, raise_on_error=True)
    except (Exception, timeout_exception):  # noqa: BLE001 - malformed or timed out: no match
        return False
    return len(parsed) >= 2 and parsed[1] == gold


def grade(solution_str: str, ground_truth: str, verifier: str = "either", timeout_s: float = 5.0,
          think_end_token: str | None = "</think>", fast_path: bool = True) -> float:
    """1.0 if ``verifier`` accepts the response's final answer against the gold, else 0.0; never
    raises. Run it in a main thread (signals bound each step) or in ``GradingPool`` workers."""
    if verifier not in VERIFIERS:
        raise ValueError(f"verifier must be one of {VERIFIERS}, got {verifier!r}")
    quick = quick_score(solution_str, ground_truth, verifier, think_end_token, fast_path)
    if quick is not None:
        return quick
    if threading.current_thread() is not threading.main_thread():
        return _grade(solution_str, ground_truth, verifier, timeout_s, think_end_token)
    with _outer_timer_kept():
        return _grade(solution_str, ground_truth, verifier, timeout_s, think_end_token)


def _grade(solution_str: str, ground_truth: str, verifier: str, timeout_s: float,
           think_end_token: str | None) -> float:
    """The verifiers' part of ``grade``, one step after the other within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    solution = _after_thinking(solution_str, think_end_token)
    gold = gold_answer(ground_truth)
    if verifier in ("either", "released", "deepscaler"):
        if deepscaler.deepscaler_correct(deepscaler.extract_boxed(solution), gold, _seconds_left(deadline)):
            return 1.0
        if verifier == "deepscaler" or time.monotonic() >= deadline:
            return 0.0
    if verifier == "released":
        return float(_string_match(solution, str(ground_truth), _seconds_left(deadline)))
    answer = extract_answer(solution, None)
    if answer is None or _quick_score(answer, gold, fast_path=False) is not None:
        return 0.0  # no box, or one too large to read (math.py's guards)
    return _verify(gold, answer, _seconds_left(deadline))


def load_verifiers(verifier: str = "either") -> None:
    """Import what ``verifier`` needs (slow); pool workers call it before taking items."""
    if verifier != "deepscaler":
        load_math_verify()
    if verifier != "math_verify":
        deepscaler.load_deepscaler()
