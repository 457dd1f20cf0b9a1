"""Rule-based math grading with math-verify: the last ``\\boxed{}`` after ``</think>``.

The extraction, the guards and math-verify's verdict that every verifier rule
(``aspo_lit.rewards.verifiers``) and the reward class (``aspo_lit.rewards.reward``) build on.

Pure-Python guards run first: an exact match after light normalisation scores 1 without
math-verify (``fast_path``), and answers that are too long or too deeply nested score 0 without
being parsed. The rest is graded by math-verify, bounded in time two ways:

* **In the calling thread** (the main thread, and every grading inside a pool worker):
  ``grading_deadline`` raises math-verify's timeout exception from ``timeout_s`` on, again every
  50 ms until the call returns, and a timeout scores 0 (a gold parse that times out is not
  cached). One alarm is not enough: its exception, raised while a garbage-collection callback
  or a finalizer runs, is swallowed there ("Exception ignored in ..."), and the parse went on for
  36-88 s past a 1 s bound (seen with math-verify's own ``signal.alarm``). Those swallowed
  deadlines are expected, so while the deadline is armed they do not reach
  ``sys.unraisablehook`` (whose own work, e.g. pytest formatting a traceback, the next alarm
  would interrupt).
* **In worker processes** (``MathReward.batch``, and any call from a non-main thread, where
  signals are unavailable): ``aspo_lit.rewards.pool.GradingPool`` kills and replaces a worker past
  a hard per-item deadline (e.g. stuck inside C code where the alarm cannot land); its item
  scores 0.

A pathological answer therefore scores 0; it never hangs or crashes the run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import signal
import sys
import threading
import time
from typing import Protocol, Sequence, runtime_checkable

logger = logging.getLogger(__name__)

__all__ = [
    "RewardFn",
    "compute_score",
    "extract_answer",
    "gold_answer",
    "last_boxed_only_string",
    "normalize_answer",
    "remove_boxed",
]

MAX_ANSWER_CHARS = 1000  # a boxed answer longer than this scores 0 unparsed
MAX_BRACE_DEPTH = 32  # deeper {..} nesting scores 0 unparsed (the LaTeX parser recurses)


# --------------------------------------------------------------------------- protocol


@runtime_checkable
class RewardFn(Protocol):
    """What the rollout DataModule and the evaluator need from a reward."""

    def __call__(self, response_text: str, gold: str) -> float:
        """Score one response against the gold answer."""
        ...

    def batch(self, texts: Sequence[str], golds: Sequence[str]) -> list[float]:
        """Score ``texts[i]`` against ``golds[i]`` for all i."""
        ...


# --------------------------------------------------------------------------- extraction

_BOX_CMDS = ("\\boxed", "\\fbox")


def _boxed_starts(text: str) -> list[int]:
    """Positions of every ``\\boxed`` / ``\\fbox`` command (not e.g. ``\\boxedx``)."""
    return [m.start() for m in re.finditer(r"\\(?:boxed|fbox)(?![A-Za-z])", text)]


def _boxed_at(text: str, start: int) -> str | None:
    """The full ``\\boxed{...}`` (or ``\\boxed 5``) command starting at ``start``; None if unbalanced."""
    cmd = next(c for c in _BOX_CMDS if text.startswith(c, start))
    i = start + len(cmd)
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] != "{":
        if i == start + len(cmd):  # "\boxed5": not a command argument we understand
            return None
        m = re.match(r"[^\s$]+", text[i:])
        return text[start : i + m.end()] if m else None
    depth = 0
    for j in range(i, len(text)):
        ch = text[j]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start : j + 1]
    return None


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text`` with balanced braces (verl's name).

    Returns None when there is none, or when the last one is unbalanced (a truncated answer).
    """
    starts = _boxed_starts(text)
    return _boxed_at(text, starts[-1]) if starts else None


def remove_boxed(s: str) -> str:
    """``\\boxed{x}`` / ``\\boxed {x}`` / ``\\boxed x`` / ``\\fbox{x}`` -> ``x``."""
    for cmd in _BOX_CMDS:
        if s.startswith(cmd):
            rest = s[len(cmd) :].lstrip(" ")
            return rest[1:-1] if rest.startswith("{") and rest.endswith("}") else rest
    return s


def extract_answer(response_text: str, think_end_token: str | None = "</think>") -> str | None:
    """Content of the last boxed answer after the last ``think_end_token`` (when present)."""
    if think_end_token and think_end_token in response_text:
        response_text = response_text.rsplit(think_end_token, 1)[1]
    boxed = last_boxed_only_string(response_text)
    return None if boxed is None else remove_boxed(boxed)


def gold_answer(gold: str) -> str:
    """A gold answer as bare content: the last boxed of ``gold`` if it has one, else ``gold``."""
    gold = str(gold).strip()
    boxed = last_boxed_only_string(gold)
    if boxed is not None:
        return remove_boxed(boxed)
    if len(gold) >= 2 and gold[0] == gold[-1] == "$":
        gold = gold.strip("$")
    return gold


_NORM_SUBS = [
    (re.compile(r"\\left(?![A-Za-z])|\\right(?![A-Za-z])"), ""),
    (re.compile(r"\\[dt]frac(?![A-Za-z])"), r"\\frac"),
    (re.compile(r"\\[!,;:]|\\ |~"), ""),
    (re.compile(r"\s+"), ""),
    (re.compile(r"\$"), ""),
]


def normalize_answer(s: str) -> str:
    """Light, meaning-preserving normalisation for the exact-match fast path."""
    for pattern, repl in _NORM_SUBS:
        s = pattern.sub(repl, s)
    return s.rstrip(".")


def _brace_depth(s: str) -> int:
    depth = best = 0
    for ch in s:
        if ch == "{":
            depth += 1
            best = max(best, depth)
        elif ch == "}":
            depth -= 1
    return best


def too_risky(answer: str) -> bool:
    """Answers no benchmark has and the LaTeX parser may choke on: score 0 unparsed."""
    return len(answer) > MAX_ANSWER_CHARS or _brace_depth(answer) > MAX_BRACE_DEPTH


def shortcut_score(answer: str | None, gold: str, fast_path: bool = True) -> float | None:
    """The score when it is decided without math-verify (no answer, exact match, too risky)."""
    if answer is None:
        return 0.0
    if fast_path and gold.strip() and normalize_answer(answer) == normalize_answer(gold):
        return 1.0
    if too_risky(answer) or too_risky(gold):
        return 0.0
    return None


# --------------------------------------------------------------------------- grading


def in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@functools.lru_cache(maxsize=1)
def load_math_verify():
    """Import math-verify once (slow: sympy); returns the module, our extraction config and its
    timeout exception. Pool workers call it before taking items."""
    import math_verify
    from math_verify import grader, parser
    from math_verify.errors import TimeoutException

    # its "Timeout is disabled ... provide the logic yourself" warning: we do (grading_deadline, GradingPool)
    grader.TIMEOUT_WARNING_SHOWN = parser.TIMEOUT_WARNING_SHOWN = True

    config = [math_verify.LatexExtractionConfig(boxed_match_priority=0), math_verify.ExprExtractionConfig()]
    return math_verify, config, TimeoutException


def _parse(content: str) -> list:
    """math-verify parse of ``\\boxed{content}`` (answers and golds go through the same call).

    ``raise_on_error``: a timeout raises instead of returning ``[]``, so that it is never cached.
    """
    mv, config, _ = load_math_verify()
    return mv.parse("\\boxed{" + content + "}", extraction_config=config, parsing_timeout=None,
                    raise_on_error=True)


@functools.lru_cache(maxsize=4096)
def _parse_gold(content: str) -> tuple:
    """Gold parses are cached: a group's G samples share one gold."""
    return tuple(_parse(content))


def math_verify_score(gold: str, answer: str) -> float:
    """math-verify's verdict as 1.0 / 0.0; a timeout or malformed LaTeX scores 0."""
    mv, _, timeout_exception = load_math_verify()
    try:
        gold_parsed = list(_parse_gold(gold))
        pred = _parse(answer)
        return float(bool(gold_parsed and pred and mv.verify(gold_parsed, pred, timeout_seconds=None)))
    except (Exception, timeout_exception):
        logger.debug("grading failed", exc_info=True)
        return 0.0


DEADLINE_REPEAT_S = 0.05   # the timeout is raised again this often after the deadline


@contextlib.contextmanager
def grading_deadline(seconds: float):
    """Bound the block, in the main thread: math-verify's ``TimeoutException`` is raised
    ``seconds`` after entry and again every ``DEADLINE_REPEAT_S`` until the block exits (module
    docstring: a single alarm can be swallowed by a garbage-collection callback). The graders
    catch it per step and call the step not correct; the caller catches one that escapes. A timer
    set before (e.g. pytest-timeout's) is re-armed with what is left of it."""
    _, _, timeout_exception = load_math_verify()

    def handler(signum, frame):
        raise timeout_exception("grading deadline")

    previous_hook = sys.unraisablehook

    def unraisable_hook(unraisable):
        if not isinstance(unraisable.exc_value, timeout_exception):  # ours: the repeat re-raises it
            previous_hook(unraisable)

    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    sys.unraisablehook = unraisable_hook
    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, max(float(seconds), 1e-3), DEADLINE_REPEAT_S)
    try:
        yield
    finally:
        while True:   # a signal already on its way may still raise here: once, then the timer is off
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            except timeout_exception:
                continue
            break
        sys.unraisablehook = previous_hook
        if outer_delay > 0:
            left = outer_delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), outer_interval)


def bounded_in_main_thread(grade_fn, timeout_s: float, *args) -> float:
    """``grade_fn(*args)`` under ``grading_deadline(timeout_s)`` (0.0 when the timeout escapes
    it); in another thread, where no signal lands, it runs as it is (callers there use workers)."""
    if not in_main_thread():
        return grade_fn(*args)
    _, _, timeout_exception = load_math_verify()
    try:
        with grading_deadline(timeout_s):
            return grade_fn(*args)
    except timeout_exception:
        return 0.0


def compute_score(
    solution_str: str,
    ground_truth: str,
    timeout_s: float = 5.0,
    think_end_token: str | None = "</think>",
    fast_path: bool = True,
) -> float:
    """verl-style ``compute_score``: 1.0 if the response's final answer equals the gold, else 0.0.

    Runs in the calling thread. In the main thread ``grading_deadline(timeout_s)`` bounds it; in
    another thread it runs unbounded, so callers there should use ``MathReward``, which sends such
    calls to worker processes.
    """
    answer = extract_answer(solution_str, think_end_token)
    gold = gold_answer(ground_truth)
    quick = shortcut_score(answer, gold, fast_path)
    if quick is not None:
        return quick
    return bounded_in_main_thread(math_verify_score, timeout_s, gold, answer)
