"""Evaluation metrics: avg@K and the unbiased pass@K estimator (Chen et al., 2021).

All values are **fractions** in [0, 1]; tables multiply by 100.

* ``avg@K``  = mean over problems of (correct samples / samples).
* ``pass@k`` = mean over problems of ``1 - C(n-c, k) / C(n, k)`` with ``n`` samples of which
  ``c`` are correct; with ``k = n`` it is "any of the n samples correct".

The torchmetrics classes keep only ``sum`` states (score sum and problem count), so their
``dist_reduce_fx="sum"`` reduction across ranks is exact whatever the split of problems.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["AvgAtK", "PassAtK", "avg_at_k", "pass_at_k"]


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
