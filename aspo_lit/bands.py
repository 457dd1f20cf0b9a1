"""Reference bands over seeds: window medians, their mean/SD/SE across seeds, and the band's k.

A run's metric is summarised over windows of ``W`` logged steps (window ``i`` holds the steps
``[i·W, (i+1)·W)``) by its median there: one rollout batch's spike (a grad-norm burst, a clip share
that is a rare event) moves a window's mean by spike/W but its median by at most the next value, and
with means a held-out seed of the demo left the band on one such spike (docs/compare.md). Across the
``n`` seeds of a reference each window ("cell") has a mean
``x̄``, a standard deviation ``s`` (ddof 1) and a standard error ``SE = s/√n``. The band is
``x̄ ± k·max(SE, SE_floor)``, ``SE_floor`` the median SE of the metric's cells. docs/compare.md
derives k:

A new seed's window median ``y`` is drawn like the reference's, so under normality
``(y - x̄) / (s·√(1 + 1/n))`` is Student-t with ``n - 1`` degrees of freedom (the prediction
interval: the new draw's own spread plus the reference mean's). Over ``m`` cells a Bonferroni
correction holds the chance that a same-config seed leaves *any* band to at most ``α``:
``|y - x̄| ≤ t_{n-1, 1-α/(2m)}·s·√(1 + 1/n)``. Since ``s·√(1 + 1/n) = SE·√(n + 1)``,

    k = t_{n-1, 1-α/(2m)} · √(n + 1)        (n = 5, m = 100, α = 0.05: k ≈ 25.2)

The floor only widens a band, so the bound holds with it. It is there because 5 seeds' SD is
itself noisy and real metrics are not normal: a window where the seeds happen to agree closely,
or where a clip share is exactly 0 for every seed, would get a band far narrower than the metric's
seed-to-seed spread, and a held-out seed leaves it (docs/compare.md, "leave one seed out").

Pure numpy/scipy: no files, no plotting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# A band never narrower than the rounding of the float32 values a logger writes (a reference
# whose seeds agree exactly, SD 0, still passes a run that agrees up to that rounding).
FLOAT32_EPS = float(np.finfo(np.float32).eps)


@dataclass(frozen=True)
class Cell:
    """One (metric, window) of a reference: the seeds' window medians summarised."""
    window: int
    mean: float
    sd: float
    se: float
    n: int

    def halfwidth(self, k: float, se_floor: float = 0.0) -> float:
        """``k·max(SE, se_floor)``, at least float32 rounding of the mean."""
        return max(k * max(self.se, se_floor), 2 * FLOAT32_EPS * abs(self.mean))

    def contains(self, value: float, k: float, se_floor: float = 0.0) -> bool:
        return abs(value - self.mean) <= self.halfwidth(k, se_floor)


@dataclass(frozen=True)
class MetricBand:
    """One metric's cells by window, and the SE floor every cell's band uses."""
    cells: dict[int, Cell]
    se_floor: float

    def halfwidth(self, window: int, k: float) -> float:
        return self.cells[window].halfwidth(k, self.se_floor)

    def contains(self, window: int, value: float, k: float) -> bool:
        return self.cells[window].contains(value, k, self.se_floor)

    def first_departure(self, run_means: dict[int, float], k: float) -> int | None:
        """The first window (in step order) whose run mean leaves the band; None if none does.
        Only windows both sides have are compared."""
        for window in sorted(set(run_means) & set(self.cells)):
            if not self.contains(window, run_means[window], k):
                return window
        return None


def se_floor(cells: list[Cell]) -> float:
    """The median SE of a metric's cells: the SE a cell's band never goes under (module docstring).
    The median, not the mean: spread grows over training and spikes in one window, and neither
    should widen the early windows a short run is compared on."""
    return float(np.median([c.se for c in cells])) if cells else 0.0


def metric_band(cells: list[Cell]) -> MetricBand:
    return MetricBand({c.window: c for c in cells}, se_floor(cells))


def complete_windows(last_step: float, window: int) -> int:
    """How many windows a run whose last logged step is ``last_step`` has seen to their end."""
    if window < 1:
        raise ValueError(f"window must be >= 1 step, got {window}")
    return int((math.floor(last_step) + 1) // window) if last_step >= 0 else 0


def window_medians(steps: np.ndarray, values: np.ndarray, window: int, last_step: float) -> dict[int, float]:
    """``{window index: median of the values logged in it}`` over the complete windows only (a
    partial last window holds fewer steps, so it would spread wider than its reference)."""
    steps, values = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if steps.shape != values.shape:
        raise ValueError(f"steps {steps.shape} and values {values.shape} differ in shape")
    complete = complete_windows(last_step, window)
    index = np.floor(steps / window).astype(np.int64)
    keep = (steps >= 0) & (index < complete)
    return {int(i): float(np.median(values[keep & (index == i)])) for i in np.unique(index[keep])}


def summarize(window: int, seed_means: list[float]) -> Cell:
    """The cell of ``window`` from one window median per seed."""
    x = np.asarray(seed_means, dtype=np.float64)
    if x.size < 2:
        raise ValueError(f"window {window}: a cell needs >= 2 seeds, got {x.size}")
    sd = float(x.std(ddof=1))
    return Cell(window, float(x.mean()), sd, sd / math.sqrt(x.size), int(x.size))


def prediction_k(n: int, cells: int, alpha: float = 0.05) -> float:
    """The band's k in SE units: a two-sided t prediction interval for one new seed, Bonferroni-
    corrected over ``cells`` (metric, window) cells, so a same-config seed leaves some band with
    probability at most ``alpha`` (module docstring; docs/compare.md)."""
    from scipy import stats

    if n < 2:
        raise ValueError(f"a band needs >= 2 seeds, got n={n}")
    if cells < 1:
        raise ValueError(f"a band needs >= 1 cell, got {cells}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    return float(stats.t.ppf(1 - alpha / (2 * cells), n - 1) * math.sqrt(n + 1))
