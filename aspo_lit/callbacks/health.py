"""Convergence health: "healthy convergence" vs "local optimum" (paper App. D).

App. D: healthy convergence = entropy decreasing gradually to a small positive level, reward rising
then plateauing high, clip ratio and KL stable late in training. A local optimum = entropy
collapsing rapidly toward zero, reward stagnating, clip ratio persistently high. :func:`assess_health`
turns that into a verdict from metric histories, judged on the last ``window`` steps:

* ``collapsed`` — entropy collapsed (below ``min_entropy`` or lost ``max_entropy_drop`` of its
  initial level) while the reward is flat or the clip ratio persistently high; or entropy falling
  fast with a flat reward and a persistently high clip ratio;
* ``watch`` — any single warning sign: collapsed or fast-falling entropy (with reward still rising),
  clip ratio persistently high or surging, KL surging;
* ``healthy`` — none of these (also while fewer than ``window`` steps are known).

"Flat reward" = reward gain over the window (slope × window) below ``min_reward_gain`` — a plateau
is flat too, which is why a flat reward alone is no warning (healthy runs plateau). "Surging" = the
last window's mean exceeds ``surge`` × the previous window's (or the first window's) mean.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_info

from aspo_lit.callbacks.base import Diagnostic, resolve_log_dir
from aspo_lit.callbacks.entropy import EntropyMonitor, slope
from aspo_lit.callbacks.training_stats import TrainingStats

ENTROPY, REWARD, CLIP, KL = "train/entropy", "train/reward_mean", "clip/pos_high", "train/kl"
STATUS = {"healthy": 0, "watch": 1, "collapsed": 2}


def _finite(values: Sequence[float] | None) -> np.ndarray:
    y = np.asarray(values if values is not None else [], dtype=np.float64)
    return y[np.isfinite(y)]


def _surge(y: np.ndarray, window: int, factor: float, floor: float) -> tuple[bool, float, float]:
    now = float(y[-window:].mean())
    prev = y[-2 * window:-window] if y.size >= 2 * window else y[:window]
    before = float(prev.mean())
    return now > factor * max(before, floor), now, before


def assess_health(history: Mapping[str, Sequence[float]], *, window: int = 20,
                  min_entropy: float = 0.02, max_entropy_drop: float = 0.9,
                  fast_entropy_drop: float = 0.3, min_reward_gain: float = 0.02,
                  clip_high: float = 0.02, clip_floor: float = 1e-3, kl_floor: float = 1e-4,
                  surge: float = 2.0) -> tuple[str, str]:
    """Verdict ``healthy | watch | collapsed`` and its reason in words (module docstring).

    ``history`` maps ``train/entropy``, ``train/reward_mean``, ``clip/pos_high``, ``train/kl`` to
    per-step values (missing keys and NaNs are skipped). ``fast_entropy_drop`` is the share of the
    initial entropy lost within one window that counts as "fast"; ``clip_high`` the clip ratio that,
    as the window's median, counts as "persistently high"; ``clip_floor``/``kl_floor`` keep a surge
    from tiny values from counting.
    """
    entropy, reward = _finite(history.get(ENTROPY)), _finite(history.get(REWARD))
    clip, kl = _finite(history.get(CLIP)), _finite(history.get(KL))
    known = max(entropy.size, reward.size, clip.size, kl.size)
    if known < window:
        return "healthy", f"too early to judge: {known} of {window} steps"

    signs: dict[str, str] = {}
    entropy_collapsed = entropy_fast = False
    if entropy.size >= window:
        initial, now = float(entropy[:window].mean()), float(entropy[-window:].mean())
        entropy_collapsed = now < min_entropy or now < (1.0 - max_entropy_drop) * initial
        entropy_fast = -slope(entropy[-window:]) * window > fast_entropy_drop * initial
        if entropy_collapsed:
            signs["entropy"] = f"entropy collapsed to {now:.3g} (initial {initial:.3g})"
        elif entropy_fast:
            signs["entropy"] = (f"entropy falling fast ({slope(entropy[-window:]):.2e}/step, "
                                f"now {now:.3g}, initial {initial:.3g})")
    reward_flat = False
    if reward.size >= window:
        gain = slope(reward[-window:]) * window
        reward_flat = gain < min_reward_gain
        reward_text = f"reward {'flat' if reward_flat else 'rising'} ({gain:+.3g} over {window} steps)"
    clip_persistent = False
    if clip.size >= window:
        clip_persistent = float(np.median(clip[-window:])) > clip_high
        clip_surging, now, before = _surge(clip, window, surge, clip_floor)
        if clip_persistent:
            signs["clip"] = f"clip ratio persistently high ({now:.3g} > {clip_high:g})"
        elif clip_surging:
            signs["clip"] = f"clip ratio surging ({before:.3g} -> {now:.3g})"
    if kl.size >= window:
        kl_surging, now, before = _surge(kl, window, surge, kl_floor)
        if kl_surging:
            signs["kl"] = f"KL surging ({before:.3g} -> {now:.3g})"

    collapsed = (entropy_collapsed and (reward_flat or clip_persistent)) or (
        entropy_fast and reward_flat and clip_persistent)
    parts = [*signs.values(), *([reward_text] if reward.size >= window else [])]
    if collapsed:
        return "collapsed", "; ".join(parts)
    if signs:
        return "watch", "; ".join(parts)
    return "healthy", "; ".join(["entropy, clip ratio and KL stable", *parts])


class HealthMonitor(Diagnostic):
    """Logs ``health/status`` (0 healthy, 1 watch, 2 collapsed) every ``interval`` steps, shows the
    verdict in the progress bar, and writes ``health.json`` into the log dir at the end of fit.

    Judges the four series as :class:`EntropyMonitor` (``train/entropy``) and :class:`TrainingStats`
    (the others) logged them this step, already reduced across ranks (read back from
    ``trainer.callback_metrics``, no reduction of its own): both must come before it in
    ``trainer.callbacks``. Thresholds: see :func:`assess_health`.
    """

    def __init__(self, interval: int = 10, window: int = 20, min_entropy: float = 0.02,
                 max_entropy_drop: float = 0.9, fast_entropy_drop: float = 0.3,
                 min_reward_gain: float = 0.02, clip_high: float = 0.02, clip_floor: float = 1e-3,
                 kl_floor: float = 1e-4, surge: float = 2.0) -> None:
        super().__init__(prog_bar=("health/status",))
        self.interval = interval
        self.thresholds = dict(window=window, min_entropy=min_entropy, max_entropy_drop=max_entropy_drop,
                               fast_entropy_drop=fast_entropy_drop, min_reward_gain=min_reward_gain,
                               clip_high=clip_high, clip_floor=clip_floor, kl_floor=kl_floor, surge=surge)
        self.history: dict[str, list[float]] = {ENTROPY: [], REWARD: [], CLIP: [], KL: []}
        self.verdict, self.reason = "healthy", "no steps yet"
        self._log_dir: str | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._log_dir = resolve_log_dir(trainer)  # a collective: every rank, once
        earlier = trainer.callbacks[: trainer.callbacks.index(self)]
        missing = [source.__name__ for source in (EntropyMonitor, TrainingStats)
                   if not any(isinstance(cb, source) for cb in earlier)]
        if missing:
            raise ValueError(f"HealthMonitor judges what {' and '.join(missing)} log each step: "
                             "list them before it in trainer.callbacks")

    def compute(self, trainer, pl_module, d) -> dict[str, Any]:
        logged = trainer.callback_metrics
        for key, series in self.history.items():
            series.append(float(logged.get(key, math.nan)))
        if len(self.history[ENTROPY]) % self.interval:
            return {}
        self._assess(trainer)
        return {"health/status": float(STATUS[self.verdict])}

    def _assess(self, trainer) -> None:
        verdict, self.reason = assess_health(self.history, **self.thresholds)
        if verdict != self.verdict:
            rank_zero_info(f"[health] step {trainer.global_step}: {verdict} — {self.reason}")
        self.verdict = verdict

    def on_fit_end(self, trainer, pl_module) -> None:
        self._assess(trainer)
        if not trainer.is_global_zero or self._log_dir is None:
            return
        os.makedirs(self._log_dir, exist_ok=True)
        last = {k: (v[-1] if v and math.isfinite(v[-1]) else None) for k, v in self.history.items()}
        report = {"verdict": self.verdict, "status": STATUS[self.verdict], "reason": self.reason,
                  "step": trainer.global_step, "steps_seen": len(self.history[ENTROPY]),
                  "last": last, "thresholds": self.thresholds}
        with open(os.path.join(self._log_dir, "health.json"), "w") as f:
            json.dump(report, f, indent=2)

    def state_dict(self) -> dict[str, Any]:
        return {"history": {k: list(v) for k, v in self.history.items()}, "verdict": self.verdict}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history.update({k: list(v) for k, v in state_dict.get("history", {}).items()})
        self.verdict = state_dict.get("verdict", self.verdict)
