"""``MathReward``: the 0/1 math correctness reward of training and evaluation (paper §7.1,
Appendix B), graded by a verifier rule (``aspo_lit.rewards.verifiers``), bounded in time.

Grading runs in the calling thread when it is the main thread (``__call__``, ``batch`` with
``num_workers=0``): signal alarms bound each verifier step. ``batch`` otherwise, and any call from
another thread, grade in worker processes (``aspo_lit.rewards.pool.GradingPool``) that are killed
and replaced past a hard per-item deadline. An answer that a verifier cannot finish scores 0.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from typing import Sequence

from aspo_lit.maths.settings import check_choice
from aspo_lit.rewards.lifecycle import ProcessLocalWorkers
from aspo_lit.rewards.math import extract_answer, in_main_thread
from aspo_lit.rewards.pool import GradingPool
from aspo_lit.rewards.verifiers import Verifier, grade, load_verifiers, quick_score

__all__ = ["MathReward", "MathVerifyReward"]


class MathReward(ProcessLocalWorkers):
    """0/1 math correctness with DeepScaleR's and/or math-verify's verifier (docs/grading.md).

    Scores text only: DAPO's overlong penalty is the DataModule's (``data.overlong_buffer``).

    Args:
        verifier: ``either`` (correct when DeepScaleR's verifier or Skywork-OR1's math-verify
            step accepts: the paper's "both" verification functions), ``released`` (the
            authors' ``RewardMathFn`` as released: DeepScaleR, else math-verify's parse matched
            as a string only), ``math_verify`` or ``deepscaler`` (one verifier alone);
            ``aspo_lit.rewards.verifiers``.
        timeout_s: the time bound of one response's grading in a main thread
            (``aspo_lit.rewards.math.grading_deadline``); no step starts past it.
        num_workers: grading processes for ``batch`` and non-main-thread calls
            (default ``min(8, cpu_count)``); 0 grades ``batch`` sequentially in the main thread.
        think_end_token: grade only the text after the last occurrence of this token, when
            present (None: grade the whole text).
        format_reward: if True, a response without ``think_end_token`` or without a final
            ``\\boxed{}`` scores ``format_error_score`` instead of 0.
        format_error_score: see ``format_reward``.
        fast_path: an exact match after light normalisation scores 1 without a verifier.
        hard_timeout_s: per-item deadline in a worker before it is killed
            (default ``1.5 * timeout_s + 2``).
        worker_memory_limit_mb: address-space limit of each worker (None: no limit).
    """

    def __init__(
        self,
        verifier: Verifier = "either",
        timeout_s: float = 5.0,
        num_workers: int | None = None,
        think_end_token: str | None = "</think>",
        format_reward: bool = False,
        format_error_score: float = -1.0,
        fast_path: bool = True,
        hard_timeout_s: float | None = None,
        worker_memory_limit_mb: int | None = 4096,
    ):
        check_choice("verifier", verifier, Verifier)
        if verifier != "math_verify" and importlib.util.find_spec("pylatexenc") is None:
            raise ImportError(f"verifier={verifier!r} needs DeepScaleR's LaTeX reader: pip install pylatexenc "
                              "(verifier='math_verify' runs without it)")
        self.verifier = verifier
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

    _process_local = ("pool",)  # pickled without its grading processes (``ProcessLocalWorkers``)

    def close(self) -> None:
        """Stop the worker processes (they restart on the next pooled call)."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    @property
    def grade_kwargs(self) -> dict:
        return dict(verifier=self.verifier, timeout_s=self.timeout_s, think_end_token=self.think_end_token,
                    fast_path=self.fast_path)

    def _quick(self, text: str, gold: str) -> float | None:
        return quick_score(text, gold, self.verifier, self.think_end_token, self.fast_path)

    # -- scoring
    def __call__(self, response_text: str, gold: str) -> float:
        """Score one response; bounded in time from any thread (other threads use a worker)."""
        if in_main_thread():
            score = grade(response_text, gold, **self.grade_kwargs)
        else:
            score = self._quick(response_text, gold)
            if score is None:
                score = self._grade_in_processes([(response_text, gold)])[0]
        return self._format_checked(response_text, score)

    def batch(self, texts: Sequence[str], golds: Sequence[str]) -> list[float]:
        """Score ``texts[i]`` against ``golds[i]`` in parallel worker processes.

        What needs no verifier is scored here; the rest is graded once per distinct ``(text,
        gold)`` pair, since a verdict is a function of the pair (a group's samples often repeat
        one another: a third of a demo batch's verifier calls)."""
        if len(texts) != len(golds):
            raise ValueError(f"{len(texts)} texts but {len(golds)} golds")
        scores: list[float | None] = [self._quick(t, g) for t, g in zip(texts, golds)]
        todo: dict[tuple[str, str], list[int]] = {}
        for i, score in enumerate(scores):
            if score is None:
                todo.setdefault((texts[i], golds[i]), []).append(i)
        if todo:
            if self.num_workers == 0 and in_main_thread():
                graded = [grade(text, gold, **self.grade_kwargs) for text, gold in todo]
            else:
                graded = self._grade_in_processes(list(todo))
            for indices, score in zip(todo.values(), graded):
                for i in indices:
                    scores[i] = score
        return [self._format_checked(t, s) for t, s in zip(texts, scores)]

    def _grade_in_processes(self, items: list[tuple[str, str]]) -> list[float]:
        with self._lock:
            if self.pool is None:
                self.pool = GradingPool(functools.partial(grade, **self.grade_kwargs),
                                        max(1, self.num_workers), self.hard_timeout_s,
                                        self.worker_memory_limit_mb,
                                        warmup=functools.partial(load_verifiers, self.verifier))
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
        return (f"{type(self).__name__}(verifier={self.verifier!r}, timeout_s={self.timeout_s}, "
                f"num_workers={self.num_workers}, think_end_token={self.think_end_token!r}, "
                f"format_reward={self.format_reward})")


class MathVerifyReward(MathReward):
    """``MathReward`` with math-verify alone (``verifier="math_verify"``); same other arguments."""

    def __init__(self, **kwargs):
        # every argument but the verifier is MathReward's: jsonargparse reads them from there
        super().__init__(verifier="math_verify", **kwargs)
