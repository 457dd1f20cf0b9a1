"""Rule-based math reward: the last ``\\boxed{}`` after ``</think>``, graded with math-verify.

Pure-Python guards run first: an exact match after light normalisation scores 1 without
math-verify (``fast_path``), and answers that are too long or too deeply nested score 0 without
being parsed. The rest is graded by math-verify, bounded in time two ways:

* **In the calling thread** (``MathVerifyReward.__call__`` from the main thread, ``batch`` with
  ``num_workers=0``, and every grading inside a pool worker): math-verify's own ``signal.alarm``
  timeouts bound each parse (``parsing_timeout``) and each comparison (``timeout_seconds``);
  a timeout scores 0 (a gold parse that times out is not cached).
* **In worker processes** (``MathVerifyReward.batch``, and any call from a non-main thread, where
  signals are unavailable): ``aspo_lit.rewards.pool.GradingPool`` kills and replaces a worker past
  a hard per-item deadline (e.g. stuck inside C code where the alarm cannot land); its item
  scores 0.

A pathological answer therefore scores 0; it never hangs or crashes the run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import signal
import threading
import time
from typing import Protocol, Sequence, runtime_checkable

from aspo_lit.rewards.pool import GradingPool

logger = logging.getLogger(__name__)

__all__ = [
    "MathVerifyReward",
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


def _too_risky(answer: str) -> bool:
    """Answers no benchmark has and the LaTeX parser may choke on: score 0 unparsed."""
    return len(answer) > MAX_ANSWER_CHARS or _brace_depth(answer) > MAX_BRACE_DEPTH


def _quick_score(answer: str | None, gold: str, fast_path: bool = True) -> float | None:
    """The score when it is decided without math-verify (no answer, exact match, too risky)."""
    if answer is None:
        return 0.0
    if fast_path and gold.strip() and normalize_answer(answer) == normalize_answer(gold):
        return 1.0
    if _too_risky(answer) or _too_risky(gold):
        return 0.0
    return None


# --------------------------------------------------------------------------- grading


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@functools.lru_cache(maxsize=1)
def load_math_verify():
    """Import math-verify once (slow: sympy); returns the module, our extraction config and its
    timeout exception. Pool workers call it before taking items."""
    import math_verify
    from math_verify.errors import TimeoutException

    config = [math_verify.LatexExtractionConfig(boxed_match_priority=0), math_verify.ExprExtractionConfig()]
    return math_verify, config, TimeoutException


def _parse(content: str, seconds: int | None) -> list:
    """math-verify parse of ``\\boxed{content}`` (answers and golds go through the same call).

    ``raise_on_error``: a timeout raises instead of returning ``[]``, so that it is never cached.
    """
    mv, config, _ = load_math_verify()
    return mv.parse("\\boxed{" + content + "}", extraction_config=config, parsing_timeout=seconds,
                    raise_on_error=True)


@functools.lru_cache(maxsize=4096)
def _parse_gold(content: str, seconds: int | None) -> tuple:
    """Gold parses are cached: a group's G samples share one gold."""
    return tuple(_parse(content, seconds))


def _verify(gold: str, answer: str, seconds: int | None) -> float:
    """math-verify's verdict as 1.0 / 0.0; a timeout or malformed LaTeX scores 0."""
    mv, _, timeout_exception = load_math_verify()
    try:
        gold_parsed = list(_parse_gold(gold, seconds))
        pred = _parse(answer, seconds)
        return float(bool(gold_parsed and pred and mv.verify(gold_parsed, pred, timeout_seconds=seconds)))
    except (Exception, timeout_exception):  # noqa: BLE001 - malformed LaTeX must score 0, not crash
        logger.debug("grading failed", exc_info=True)
        return 0.0


@contextlib.contextmanager
def _outer_timer_kept():
    """Re-arm a timer set before grading (e.g. pytest-timeout's): math-verify's ``alarm(0)`` cancels it."""
    delay, interval = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    try:
        yield
    finally:
        if delay > 0:
            left = delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), interval)


def compute_score(
    solution_str: str,
    ground_truth: str,
    timeout_s: float = 5.0,
    think_end_token: str | None = "</think>",
    fast_path: bool = True,
) -> float:
    """verl-style ``compute_score``: 1.0 if the response's final answer equals the gold, else 0.0.

    Runs in the calling thread. In the main thread math-verify's timeouts (``timeout_s``, rounded
    up to whole seconds: ``signal.alarm``) bound each parse and each comparison; in another
    thread it runs unbounded, so callers there should use ``MathVerifyReward``, which sends such
    calls to worker processes.
    """
    answer = extract_answer(solution_str, think_end_token)
    gold = gold_answer(ground_truth)
    quick = _quick_score(answer, gold, fast_path)
    if quick is not None:
        return quick
    if not _in_main_thread():
        return _verify(gold, answer, None)
    with _outer_timer_kept():
        return _verify(gold, answer, max(1, math.ceil(timeout_s)))


# --------------------------------------------------------------------------- reward


class MathVerifyReward:
    """0/1 math correctness reward with math-verify, bounded in time (see module docstring).

    Scores text only: DAPO's overlong penalty is the DataModule's (``data.overlong_buffer``).

    Args:
        timeout_s: math-verify's time bound for each parse and for each comparison (whole
            seconds, rounded up).
        num_workers: grading processes for ``batch`` and non-main-thread calls
            (default ``min(8, cpu_count)``); 0 grades ``batch`` sequentially in the main thread.
        think_end_token: grade only the text after the last occurrence of this token, when
            present (None: grade the whole text).
        format_reward: if True, a response without ``think_end_token`` or without a final
            ``\\boxed{}`` scores ``format_error_score`` instead of 0.
        format_error_score: see ``format_reward``.
        fast_path: exact match after normalisation scores 1 without math-verify.
        hard_timeout_s: per-item deadline in a worker before it is killed
            (default ``1.5 * timeout_s + 2``).
        worker_memory_limit_mb: address-space limit of each worker (None: no limit).
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        num_workers: int | None = None,
        think_end_token: str | None = "</think>",
        format_reward: bool = False,
        format_error_score: float = -1.0,
        fast_path: bool = True,
        hard_timeout_s: float | None = None,
        worker_memory_limit_mb: int | None = 4096,
    ):
        self.timeout_s = float(timeout_s)
        self.num_workers = min(8, os.cpu_count() or 1) if num_workers is None else int(num_workers)
        self.think_end_token = think_end_token
        self.format_reward = format_reward
        self.format_error_score = float(format_error_score)
        self.fast_path = fast_path
        self.hard_timeout_s = 1.5 * self.timeout_s + 2.0 if hard_timeout_s is None else float(hard_timeout_s)
        self.worker_memory_limit_mb = worker_memory_limit_mb
        self.pool: GradingPool | None = None
        self._lock = threading.Lock()

    # -- pickling: the pool and lock stay behind
    def __getstate__(self):
        state = self.__dict__.copy()
        state["pool"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def close(self) -> None:
        """Stop the worker processes (they restart on the next pooled call)."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    @property
    def grade_kwargs(self) -> dict:
        return dict(timeout_s=self.timeout_s, think_end_token=self.think_end_token, fast_path=self.fast_path)

    # -- scoring
    def __call__(self, response_text: str, gold: str) -> float:
        """Score one response; bounded in time from any thread (other threads use a worker)."""
        if _in_main_thread():
            score = compute_score(response_text, gold, **self.grade_kwargs)
        else:
            answer = extract_answer(response_text, self.think_end_token)
            score = _quick_score(answer, gold_answer(gold), self.fast_path)
            if score is None:
                score = self._grade_in_processes([(response_text, gold)])[0]
        return self._format_checked(response_text, score)

    def batch(self, texts: Sequence[str], golds: Sequence[str]) -> list[float]:
        """Score ``texts[i]`` against ``golds[i]`` in parallel worker processes."""
        if len(texts) != len(golds):
            raise ValueError(f"{len(texts)} texts but {len(golds)} golds")
        scores: list[float | None] = [
            _quick_score(extract_answer(t, self.think_end_token), gold_answer(g), self.fast_path)
            for t, g in zip(texts, golds)
        ]
        todo = [i for i, s in enumerate(scores) if s is None]
        if todo:
            if self.num_workers == 0 and _in_main_thread():
                graded = [compute_score(texts[i], golds[i], **self.grade_kwargs) for i in todo]
            else:
                graded = self._grade_in_processes([(texts[i], golds[i]) for i in todo])
            for i, s in zip(todo, graded):
                scores[i] = s
        return [self._format_checked(t, s) for t, s in zip(texts, scores)]

    def _grade_in_processes(self, items: list[tuple[str, str]]) -> list[float]:
        with self._lock:
            if self.pool is None:
                self.pool = GradingPool(functools.partial(compute_score, **self.grade_kwargs),
                                        max(1, self.num_workers), self.hard_timeout_s,
                                        self.worker_memory_limit_mb, warmup=load_math_verify)
            return self.pool.map(items)

    def _format_checked(self, text: str, score: float) -> float:
        """``format_error_score`` for a malformed response when ``format_reward`` is on."""
        if self.format_reward and not self._well_formed(text):
            score = self.format_error_score
        return float(score)

    def _well_formed(self, text: str) -> bool:
        if self.think_end_token and self.think_end_token not in text:
            return False
        return extract_answer(text, self.think_end_token) is not None

    def __repr__(self) -> str:
        return (f"MathVerifyReward(timeout_s={self.timeout_s}, num_workers={self.num_workers}, "
                f"think_end_token={self.think_end_token!r}, format_reward={self.format_reward})")
