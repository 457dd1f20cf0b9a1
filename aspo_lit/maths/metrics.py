"""Evaluation metrics: avg@K and the unbiased pass@K estimator (Chen et al., 2021), and their
standard errors.

All values are **fractions** in [0, 1]; tables multiply by 100.

* ``avg@K``  = mean over problems of (correct samples / samples).
* ``pass@k`` = mean over problems of ``1 - C(n-c, k) / C(n, k)`` with ``n`` samples of which
  ``c`` are correct; with ``k = n`` it is "any of the n samples correct".

The torchmetrics classes keep only ``sum`` states (score sum and problem count), so their
``dist_reduce_fx="sum"`` reduction across ranks is exact whatever the split of problems.

``avg_at_k_se`` / ``pass_at_k_se`` give a benchmark's standard errors from its per-problem correct
counts (float64; derivations in their docstrings, what they cover in docs/evaluation.md,
"Standard errors").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["AvgAtK", "PassAtK", "avg_at_k", "pass_at_k", "MetricSE", "avg_at_k_se", "pass_at_k_se", "mean_se",
           "samples_for_halfwidth"]


def _check_counts(n: int, c: int) -> None:
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"need n >= 1 and 0 <= c <= n, got n={n}, c={c}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (no huge binomials), stable for any
    ``n`` (tested to 1024).
    """
    _check_counts(n, c)
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def avg_at_k(n: int, c: int) -> float:
    """avg@K of one problem: the fraction ``c / n`` of its ``n`` samples that are correct."""
    _check_counts(n, c)
    return c / n


def _as_counts(correct: Tensor, num_samples: Tensor | int | None) -> tuple[list[int], list[int]]:
    """``(num_correct, num_samples)`` per problem, from a bool ``[P, n]`` matrix or from counts."""
    correct = torch.as_tensor(correct)
    if num_samples is None:
        if correct.ndim != 2:
            raise ValueError(f"expected correctness of shape [num_problems, n], got {tuple(correct.shape)}")
        c = correct.bool().sum(dim=1)
        n = torch.full_like(c, correct.shape[1])
    else:
        c = correct.reshape(-1).long()
        ns = torch.as_tensor(num_samples).long()
        n = ns.expand(c.shape) if ns.ndim == 0 else ns.reshape(-1)
        if n.shape != c.shape:
            raise ValueError(f"num_correct has {c.numel()} problems but num_samples {n.numel()}")
    return c.tolist(), n.tolist()


class _MeanOverProblems(Metric):
    """Mean over problems of a per-problem score; sum states, so rank reduction is exact."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("score_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_problems", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def _problem_score(self, n: int, c: int) -> float:
        raise NotImplementedError

    def update(self, correct: Tensor, num_samples: Tensor | int | None = None) -> None:
        """Add problems: ``correct`` bool ``[P, n]``, or ``correct`` = num_correct ``[P]`` with
        ``num_samples`` ``[P]`` (or one int for all)."""
        cs, ns = _as_counts(correct, num_samples)
        self.score_sum += sum(self._problem_score(n, c) for n, c in zip(ns, cs))
        self.num_problems += len(cs)

    def compute(self) -> Tensor:
        """Mean over all problems seen (all ranks), as a fraction; NaN before any update."""
        if self.num_problems == 0:
            return torch.tensor(float("nan"), dtype=torch.float64)
        return self.score_sum / self.num_problems


class AvgAtK(_MeanOverProblems):
    """avg@K: mean over problems of the fraction of correct samples (a fraction, not %)."""

    def _problem_score(self, n: int, c: int) -> float:
        return avg_at_k(n, c)


class PassAtK(_MeanOverProblems):
    """Unbiased pass@k averaged over problems (a fraction, not %). Needs ``n >= k`` samples."""

    def __init__(self, k: int, **kwargs):
        super().__init__(**kwargs)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k

    def _problem_score(self, n: int, c: int) -> float:
        return pass_at_k(n, c, self.k)


# --------------------------------------------------------------------------- standard errors

@dataclass(frozen=True)
class MetricSE:
    """A benchmark's metric and its two standard errors, fractions like the metric.

    The model's probability ``p_i`` of a correct sample on problem ``i`` is fixed by the checkpoint
    and the sampling settings; the K samples of a problem are independent draws, so its count is
    ``c_i ~ Binomial(K, p_i)``. Two populations:

    * ``se``: **response sampling, the benchmark's P problems fixed** — what separates two
      evaluations of one checkpoint on these problems (ours and the paper's); the tables' SE.
    * ``se_problems``: the problems too as a random draw from a population of such problems (both
      levels of variance: between problems and between samples within a problem); what generalising
      beyond the benchmark's problems would take. NaN with one problem.

    Neither covers training seeds: another training run is another checkpoint.
    """
    value: float
    se: float
    se_problems: float


def _as_count_array(num_correct, k: int) -> np.ndarray:
    """Per-problem correct counts out of K samples as float64, checked."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k (samples per problem) must be an int >= 1, got {k!r}")
    counts = np.asarray(num_correct.tolist() if isinstance(num_correct, Tensor) else num_correct)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"num_correct must be a non-empty list of per-problem counts, got shape {counts.shape}")
    if counts.dtype == bool or not np.all(np.isfinite(counts.astype(np.float64))) \
            or np.any(counts != np.round(counts)) or counts.min() < 0 or counts.max() > k:
        raise ValueError(f"num_correct must be integers in [0, k={k}], got {counts.tolist()[:8]}...")
    return counts.astype(np.float64)


def _problem_se(scores: np.ndarray) -> float:
    """``s / sqrt(P)``, s the problems' sample SD (ddof 1): the SE of a mean of i.i.d. per-problem
    scores; NaN with one problem."""
    return float(scores.std(ddof=1) / math.sqrt(scores.size)) if scores.size > 1 else math.nan


def avg_at_k_se(num_correct, k: int) -> MetricSE:
    """avg@K of per-problem correct counts ``c_i`` out of ``k`` samples, with its standard errors.

    ``A = (1/P) Σ_i ȳ_i``, ``ȳ_i = c_i / K``.

    Problems fixed (``se``): ``Var(A) = (1/P²) Σ_i p_i(1 - p_i) / K``. Since
    ``E[c(K - c)] = K(K - 1) p(1 - p)`` for ``c ~ Binomial(K, p)``, the within-problem sample variance
    of the K 0/1 outcomes, ``s_i² = c_i(K - c_i) / (K(K - 1))`` (ddof 1), is unbiased for
    ``p_i(1 - p_i)``, and so is

        se² = (1/P²) Σ_i s_i² / K        for Var(A).

    Problems drawn too (``se_problems``): with ``p ~ F`` over a population of problems,
    ``Var(A) = σ_b²/P + σ_w²/(P K)``, ``σ_b² = Var_F(p)`` between problems and ``σ_w² = E_F[p(1 - p)]``
    within. The ``ȳ_i`` are then i.i.d. with variance ``σ_b² + σ_w²/K``, so their sample variance
    ``s_ȳ²`` (ddof 1) is unbiased for it and ``se_problems² = s_ȳ² / P``; it splits as
    ``σ̂_w² = mean_i s_i²``, ``σ̂_b² = s_ȳ² - σ̂_w²/K``. With the problems fixed,
    ``E[s_ȳ²/P] = Var(A) + S_p²/P`` (``S_p²`` the spread of the ``p_i``): ``se_problems`` is the wider.

    With K = 1, ``p(1 - p)`` has no unbiased estimate from one sample (it is of degree 2 in ``p``):
    ``se`` is then ``se_problems``, which is conservative (the line above). An SE is the square root
    of an unbiased variance, so itself slightly low (Jensen); the variance is what the tests check.
    """
    counts = _as_count_array(num_correct, k)
    means = counts / k
    se_problems = _problem_se(means)
    if k >= 2:
        within = counts * (k - counts) / (k * (k - 1))
        se = math.sqrt(float(within.sum()) / k) / counts.size
    else:
        se = se_problems
    return MetricSE(float(means.mean()), se, se_problems)


def pass_at_k_se(num_correct, k: int) -> MetricSE:
    """pass@K with K = k samples per problem (the tables' pass@K: any of the K correct), with its
    standard errors.

    Each problem scores ``π_i = 1[c_i > 0]``, mean ``q_i = 1 - (1 - p_i)^K``.

    Problems fixed (``se``): ``Var = (1/P²) Σ_i q_i(1 - q_i)``. It has **no** unbiased estimate from
    K samples: any estimator ``g(c)`` has expectation ``Σ_c g(c) C(K, c) p^c (1 - p)^(K-c)``, a
    polynomial of degree <= K in ``p``, and ``q(1 - q) = (1 - p)^K - (1 - p)^(2K)`` is of degree 2K.
    It has an unbiased upper bound: ``q(1 - q) <= U(p) = K p (1 - p)^(K-1) = P(c = 1)``
    (divided by ``(1 - p)^(K-1)``, this is ``(1 - p)(1 - (1 - p)^K) <= K p``, Bernoulli's
    inequality), so with ``S`` the number of problems with exactly one correct sample,

        se² = S / P²        E[se²] = (1/P²) Σ_i U(p_i) >= Var.

    The bound is tight where pass@K is uncertain, problems solved by a rare sample
    (``U/q(1-q) -> 1`` as ``K p -> 0``; 1.6 at ``p = 1/K``); a problem always or never solved
    adds nothing to either. (``S`` is Good's (1953) count of singletons.)

    Problems drawn too (``se_problems``): the ``π_i`` are i.i.d. over a population of problems, so
    ``s_π² / P`` (ddof 1) is unbiased for the variance of their mean, both levels included; a
    bootstrap over problems estimates the same, ``(P - 1)/P`` times it, with Monte-Carlo noise.
    """
    counts = _as_count_array(num_correct, k)
    solved = (counts > 0).astype(np.float64)
    singletons = float(np.count_nonzero(counts == 1))
    return MetricSE(float(solved.mean()), math.sqrt(singletons) / counts.size, _problem_se(solved))


def mean_se(ses) -> float:
    """The SE of a mean of B independent estimates (a table's Avg over its benchmarks: separate
    samples), ``sqrt(Σ se_b²) / B``; NaN if any is missing or NaN."""
    ses = [math.nan if s is None else float(s) for s in ses]
    if not ses:
        raise ValueError("mean_se needs at least one SE")
    return math.sqrt(sum(s * s for s in ses)) / len(ses)


def samples_for_halfwidth(accuracy: float, halfwidth: float, z: float = 2.0) -> int:
    """Samples N = P·K that make ``z·se`` of avg@K at most ``halfwidth`` (fractions) on a fixed
    benchmark of mean accuracy ``accuracy``, in the worst case: ``(1/P) Σ p_i(1 - p_i) <= A(1 - A)``
    (the gap is the spread of the ``p_i``), so ``se² <= A(1 - A)/(P K)`` and
    ``N = ceil(z² A(1 - A) / halfwidth²)`` always suffices."""
    if not 0 <= accuracy <= 1 or not halfwidth > 0 or not z > 0:
        raise ValueError(f"need 0 <= accuracy <= 1, halfwidth > 0, z > 0; got {accuracy}, {halfwidth}, {z}")
    return math.ceil(z * z * accuracy * (1 - accuracy) / (halfwidth * halfwidth))
