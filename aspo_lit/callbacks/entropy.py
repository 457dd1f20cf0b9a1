"""Token entropy, its trend, and the entropy-collapse alarm (paper Fig. 2; App. D).

GRPO's ratio over-weights already-confident positive tokens (Sec. 4.3, Fig. 4), which shows up
first as entropy falling fast toward zero ("entropy collapse", App. D). Logged each step:

* ``train/entropy`` — mean of the pre-update policy's token entropy (π_old, the pre-update pass)
  over response tokens, weighted by tokens across ranks (docs/metrics.md);
* ``train/entropy_slope`` — least-squares slope of ``train/entropy`` per training step over the
  last ``max(window, 2)`` steps (from the 2nd step on);
* ``alarm/entropy_collapse`` — 1 once the mean entropy of the last ``window`` steps is below
  ``min_entropy`` or has lost more than ``max_relative_drop`` of the mean of the first ``window``
  steps, else 0 (logged from step ``window`` on). With ``stop_on_collapse`` the run stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_warn

from aspo_lit.callbacks.base import Diagnostic, weighted_mean


def slope(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` against their index (NaNs dropped; 0 if < 2 points)."""
    y = np.asarray(values, dtype=np.float64)
    x = np.arange(y.size, dtype=np.float64)
    keep = np.isfinite(y)
    if keep.sum() < 2:
        return 0.0
    x, y = x[keep], y[keep]
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum())


def token_mean_entropy(step, trainer=None):
    """Token-weighted mean entropy of π_old over response tokens, on all ranks."""
    return weighted_mean(step.entropy, step.response_mask, trainer=trainer)


class EntropyMonitor(Diagnostic):
    """Entropy, its slope over ``window`` steps and a collapse alarm.

    Args:
        window: steps of the slope, of the initial baseline and of the current level.
        min_entropy: absolute level (nats) under which entropy counts as collapsed.
        max_relative_drop: fraction of the initial entropy whose loss counts as collapse.
        stop_on_collapse: set ``trainer.should_stop`` when the alarm fires (same on every rank,
            since the entropy is already reduced across ranks).
    """

    def __init__(self, window: int = 20, min_entropy: float = 0.02, max_relative_drop: float = 0.9,
                 stop_on_collapse: bool = False, prog_bar: tuple[str, ...] = ("train/entropy",)) -> None:
        super().__init__(prog_bar)
        self.window = window
        self.min_entropy = min_entropy
        self.max_relative_drop = max_relative_drop
        self.stop_on_collapse = stop_on_collapse
        self.history: list[float] = []
        self.collapsed = False

    def compute(self, trainer, pl_module, step) -> dict[str, Any]:
        entropy = token_mean_entropy(step, trainer)
        self.history.append(float(entropy))
        metrics: dict[str, Any] = {"train/entropy": entropy}
        if len(self.history) >= 2:
            metrics["train/entropy_slope"] = slope(self.history[-max(self.window, 2):])
        if len(self.history) >= self.window:
            metrics["alarm/entropy_collapse"] = float(self._check(trainer))
        return metrics

    def _check(self, trainer) -> bool:
        initial = float(np.nanmean(self.history[: self.window]))
        current = float(np.nanmean(self.history[-self.window:]))
        collapsed = current < self.min_entropy or current < (1.0 - self.max_relative_drop) * initial
        if collapsed and not self.collapsed:
            rank_zero_warn(f"Entropy collapse at step {trainer.global_step}: mean entropy of the last "
                           f"{self.window} steps {current:.4f} vs initial {initial:.4f}.")
            if self.stop_on_collapse:
                trainer.should_stop = True
        self.collapsed = self.collapsed or collapsed
        return collapsed

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "collapsed": self.collapsed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        self.collapsed = bool(state_dict.get("collapsed", False))
