"""Does a run behave like the seeds of its config? The maths of `compare` (docs/compare.md).

A run's metric is first summarised per window of ``W`` logged steps (window ``i`` holds the steps
``[i·W, (i+1)·W)``; complete windows only): by the **median** of the values logged there, so that one
rollout batch's spike (a grad-norm burst) does not move it, or by the **mean** for a metric that is
mostly exact zeros batch to batch (a clip share: a rare event, whose window medians would be 0 in
most windows and seeds). The window values then go through the metric's **transform** (``log`` for
positive, right-skewed metrics such as KL and grad norm; ``sqrt`` for the zero-inflated shares;
``identity`` otherwise) and are averaged over the windows the run has: the run's **trajectory
score** ``T`` for that metric. A metric's windows move together little from seed to seed (measured:
their seed deviations correlate at |ρ| <= 0.4 between neighbouring windows), so the average over ten
windows has about a third of one window's seed-to-seed spread: a regression that moves a metric
over the run shows in ``T`` long before it leaves any single window's band.

A reference holds each seed's window values. For a run compared on its first ``L`` windows, the
``n`` reference seeds' scores over the same windows have mean ``x̄`` and SD ``s``; a new seed of the
same config is a fresh draw, so under normality ``(T - x̄) / (s·√(1 + 1/n))`` is Student-t with
``n - 1`` degrees of freedom (the prediction interval: the new draw's own spread plus the reference
mean's error). Each metric gets that two-sided p-value, and Holm's step-down over the ``M`` metrics
compared holds the chance that a same-config seed departs on *any* metric to at most ``α`` (whatever
the dependence between metrics) -- where the normal model holds. The demo's metrics have heavier tails
than a normal's (its early KL, its ratio means: a rare large value), so a reference of at least
:data:`MIN_CALIBRATION_SEEDS` seeds calibrates the degrees of freedom instead (:func:`calibrated_df`):
the largest at which each seed, held out of the reference of the others, departs on at most ``α``
of the seeds on every prefix of windows. The false-alarm rate on seeds outside the reference is
measured, with its interval, in docs/compare.md.

Pure numpy/scipy: no files, no plotting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["TRANSFORMS", "AGGREGATES", "FLOAT32_EPS", "DF_GRID", "MIN_CALIBRATION_SEEDS", "MetricSpec",
           "complete_windows", "window_values", "trajectory_score", "Departure", "prediction_test", "calibrated_df", "t_p_value",
           "holm", "seed_range"]

# A score never needs to differ from the reference mean by less than the rounding of the float32
# values a logger writes: a metric every seed logged identically (SD 0) passes a run that logs it too.
FLOAT32_EPS = float(np.finfo(np.float32).eps)

TRANSFORMS = {"identity": lambda x: x, "log": np.log, "sqrt": np.sqrt}
AGGREGATES = {"median": np.median, "mean": np.mean}


@dataclass(frozen=True)
class MetricSpec:
    """How a metric's windows are summarised: ``window`` (median or mean of a window's logged
    values) and ``transform`` (applied to each window value before the average over windows)."""
    window: str = "median"
    transform: str = "identity"

    def __post_init__(self):
        if self.window not in AGGREGATES:
            raise ValueError(f"window summary must be one of {sorted(AGGREGATES)}, got {self.window!r}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {sorted(TRANSFORMS)}, got {self.transform!r}")


def complete_windows(last_step: float, window: int) -> int:
    """How many windows a run whose last logged step is ``last_step`` has seen to their end."""
    if window < 1:
        raise ValueError(f"window must be >= 1 step, got {window}")
    return int((math.floor(last_step) + 1) // window) if last_step >= 0 else 0


def window_values(steps: np.ndarray, values: np.ndarray, window: int, last_step: float,
                  aggregate: str = "median") -> dict[int, float]:
    """``{window index: median (or mean) of the values logged in it}`` over the complete windows only
    (a partial last window holds fewer steps, so it would spread wider than its reference)."""
    steps, values = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if steps.shape != values.shape:
        raise ValueError(f"steps {steps.shape} and values {values.shape} differ in shape")
    complete = complete_windows(last_step, window)
    index = np.floor(steps / window).astype(np.int64)
    keep = (steps >= 0) & (index < complete)
    agg = AGGREGATES[aggregate]
    return {int(i): float(agg(values[keep & (index == i)])) for i in np.unique(index[keep])}


def trajectory_score(values: Mapping[int, float], windows: Sequence[int], transform: str = "identity") -> float:
    """The mean over ``windows`` of the transformed window values (nan when a window is missing or a
    value is outside the transform's domain: log of a value <= 0)."""
    if not windows or any(w not in values for w in windows):
        return math.nan
    x = np.asarray([values[w] for w in windows], dtype=np.float64)
    if transform == "log" and (x <= 0).any() or transform == "sqrt" and (x < 0).any():
        return math.nan
    return float(np.mean(TRANSFORMS[transform](x)))


@dataclass(frozen=True)
class Departure:
    """One metric's prediction test: the run's score against the ``n`` reference seeds' scores."""
    score: float
    mean: float
    sd: float
    n: int
    t: float          # (score - mean) / (sd·√(1 + 1/n)); ±inf when sd is 0 and they differ
    p: float          # two-sided, Student-t with `df` degrees of freedom
    df: float = math.nan

    def limits(self, alpha: float) -> tuple[float, float]:
        """The scores a same-config seed keeps to with probability 1 - ``alpha`` (no rounding band)."""
        from scipy import stats

        df = self.df if math.isfinite(self.df) else self.n - 1
        half = float(stats.t.ppf(1 - alpha / 2, df)) * self.sd * math.sqrt(1 + 1 / self.n)
        return self.mean - half, self.mean + half


def prediction_test(score: float, seed_scores: Sequence[float], df: float | None = None) -> Departure:
    """The t prediction test of a new seed's ``score`` against the reference seeds' ``seed_scores``
    (module docstring), its p from Student-t with ``df`` degrees of freedom (default ``n - 1``, the
    normal model's; a reference calibrates a smaller one for heavier tails: :func:`calibrated_df`).
    A reference whose seeds agree exactly (SD 0) passes a score within float32 rounding of them
    (p = 1) and fails any other (p = 0)."""
    x = np.asarray([s for s in seed_scores if math.isfinite(s)], dtype=np.float64)
    if x.size < 2:
        raise ValueError(f"a prediction test needs >= 2 seeds with a score, got {x.size}")
    mean, sd, n = float(x.mean()), float(x.std(ddof=1)), int(x.size)
    df = float(n - 1 if df is None else min(df, n - 1))
    spread = sd * math.sqrt(1 + 1 / n)
    rounding = 2 * FLOAT32_EPS * max(abs(mean), abs(score))
    if not math.isfinite(score):
        return Departure(score, mean, sd, n, math.nan, 0.0, df)
    if spread <= rounding:
        inside = abs(score - mean) <= rounding
        return Departure(score, mean, sd, n, 0.0 if inside else math.copysign(math.inf, score - mean),
                         1.0 if inside else 0.0, df)
    t = (score - mean) / spread
    return Departure(score, mean, sd, n, t, t_p_value(t, df), df)


#: the degrees of freedom :func:`calibrated_df` tries, widest tails last
DF_GRID = (1000.0, 60.0, 40.0, 30.0, 20.0, 15.0, 12.0, 10.0, 8.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0)
#: fewer seeds than this and a reference keeps the normal model's n - 1: leaving one out measures a
#: rate in steps of 1/n, which below 20 seeds cannot resolve an alpha of 0.05 (one seed of 10 is 10 %)
MIN_CALIBRATION_SEEDS = 20


def calibrated_df(held_out_t: Sequence[Sequence[Mapping[str, float]]], n: int, alpha: float) -> float:
    """The largest degrees of freedom (of :data:`DF_GRID`, at most ``n - 1``) at which every seed held
    out of the reference of the others departs, on the run's first ``L`` windows, for at most
    ``alpha`` of the seeds at every ``L`` (Holm over the metrics): a Student-t whose tails are as
    heavy as the metrics' own, measured by leaving one seed out. ``held_out_t[L][i]``: seed ``i``'s
    t per metric on the first ``L + 1`` windows. The normal model's ``n - 1`` below
    :data:`MIN_CALIBRATION_SEEDS` seeds."""
    if n < MIN_CALIBRATION_SEEDS:
        return float(n - 1)
    for df in [float(n - 1)] + [d for d in DF_GRID if d < n - 1]:
        worst = max(np.mean([bool(holm({k: t_p_value(t, df) for k, t in seed.items()}, alpha)) for seed in prefix])
                    for prefix in held_out_t if prefix)
        if worst <= alpha:
            return df
    return DF_GRID[-1]


def t_p_value(t: float, df: float) -> float:
    """Two-sided p of a prediction test's ``t`` at ``df`` degrees of freedom (a nan score: 0, departs)."""
    from scipy import stats

    if math.isnan(t) or math.isinf(t):
        return 0.0
    return float(2 * stats.t.sf(abs(t), df))


def holm(p_values: Mapping[str, float], alpha: float) -> set[str]:
    """The names Holm's step-down rejects at family-wise level ``alpha``: sorted by p, the i-th
    smallest (from 0) is rejected while ``p <= alpha / (m - i)``."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    rejected, m = set(), len(p_values)
    for i, (name, p) in enumerate(sorted(p_values.items(), key=lambda item: (item[1], item[0]))):
        if p > alpha / (m - i):
            break
        rejected.add(name)
    return rejected


def seed_range(per_seed: Sequence[Mapping[int, float]], low: float = 5.0, high: float = 95.0
               ) -> dict[int, tuple[float, float, float]]:
    """``{window: (low percentile, mean, high percentile)}`` of the seeds' window values: what a figure
    draws behind a run (the test itself is on the trajectory score)."""
    windows = sorted({w for values in per_seed for w in values})
    out = {}
    for w in windows:
        x = np.asarray([v[w] for v in per_seed if w in v], dtype=np.float64)
        if x.size:
            out[w] = (float(np.percentile(x, low)), float(x.mean()), float(np.percentile(x, high)))
    return out
