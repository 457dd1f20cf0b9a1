"""Convergence health: "healthy convergence" vs "local optimum" (paper App. D).

App. D: healthy convergence = entropy decreasing gradually to a small positive level, reward rising
then plateauing high, clip ratio and KL stable late in training. A local optimum = entropy
collapsing rapidly toward zero, reward stagnating, clip ratio persistently high. :func:`assess_health`
turns that into a verdict from per-rollout-batch metric histories, judged on the last ``window``
batches:

* ``collapsed`` — entropy collapsed (mean of the last window below ``min_entropy`` or lost
  ``max_entropy_drop`` of the first window's mean) while the reward is not rising or the clip ratio
  persistently high; or entropy falling fast with a reward not rising and a persistently high clip
  ratio;
* ``watch`` — any single warning sign: collapsed or fast-falling entropy (with reward still rising),
  clip ratio persistently high or surging, KL surging; or a run going the wrong way, which App. D
  does not name but a too-large step produces: the reward of the last window below the first's, or
  the entropy above it by more than ``max_entropy_rise`` of its level, each by more than 4 SE of
  the difference (:func:`level_shift`);
* ``healthy`` — none of these (also while fewer than ``window`` batches are known).

A trend counts only beyond its own noise (:mod:`aspo_lit.maths.trend`): over the last window, the
Theil-Sen line and the Mann-Kendall test at level ``alpha``. A series is ``rising`` / ``falling``
when the test rejects "no trend" and the line moves that way, else ``flat`` (``no trend beyond noise``
when the test does not reject: the line's start and end may then differ by noise).

* "Falling fast" = entropy falling, its line losing more than ``fast_entropy_drop`` of the initial
  entropy (the first window's mean) across the window, the level too: the last window's mean below
  the previous window's (the first window's while they overlap) by more than half that (a linear
  fall of D across a window lowers its mean by D/2), and both the line's end and the window's mean
  below the initial level: collapsing toward zero, not settling back from a rise (nor judged on the
  first window alone, whose mean is the initial level). The level's drop is what noise does not fake:
  the demo's Theil-Sen line over 10 batches moves 17 % of the level on noise alone, a mean of 10
  batches a third of that.
* The reward is ``rising`` / ``falling`` only when, besides, its line moves by more than
  ``min_reward_gain``; ``flat`` covers no trend within the noise and a plateau. "Not rising" (flat
  or falling) is App. D's stagnating reward: no warning alone (healthy runs plateau), only with a
  collapsing entropy.
* "Surging" = the last window's mean exceeds ``surge`` (3) × the previous window's (or the first
  window's) mean, and the series over those two windows rises beyond its noise (the same test). A
  policy that learns moves away from the reference steadily: on 60 seeds of the demo the KL's mean
  doubled from one 10-batch window to the next in 10 runs (ratios 2.0-2.6), all of them learning;
  at a factor of 2 each read watch.
  The KL to the reference is 0 at the first batch by construction and ramps up as training starts,
  so its first window is no baseline: a KL surge is judged from the third window on. A surge of the
  KL or the clip ratio while the reward rose (its last window's mean above its first window's by
  more than 2 SE and ``min_reward_gain``) is App. D's "policy learning effectively", not a sign.

Each trend test allows for the series' batch-to-batch correlation, estimated from its whole history
(:func:`aspo_lit.maths.trend.lag1_autocorrelation`): without it, correlated noise reads as a trend far
more often than ``alpha``.

Every number in a reason agrees with its words: a trend is written as its line's start -> end over
the window, its slope per batch and its p-value, e.g. ``reward rising (0.42 -> 0.61 over the last
10 batches, +2.1e-02/batch, p=0.003)``.
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
from aspo_lit.callbacks.entropy import EntropyMonitor
from aspo_lit.callbacks.training_stats import TrainingStats
from aspo_lit.maths.trend import Trend, lag1_autocorrelation, trend

ENTROPY, REWARD, CLIP, KL = "train/entropy", "train/reward_mean", "clip/pos_high", "train/kl"
STATUS = {"healthy": 0, "watch": 1, "collapsed": 2}
# A level shift between the first and last window counts beyond 4 SE: with the SE estimated from two windows
# of 10 batches (Student t, ~18 degrees of freedom) a one-sided 0.04 % per check on noise, and on the demo's
# measured noise 6 more of 2,000 flat 40-batch runs read watch at some check (tests/unit/test_health.py).
SHIFT_SE = 4.0
# The reward rose (App. D's "policy learning effectively", which excuses a rising KL or clip ratio) when
# its last window's mean is above its first's by more than 2 SE of the difference: a one-sided ~3 % test.
LEARNING_SE = 2.0


def _finite(values: Sequence[float] | None) -> np.ndarray:
    y = np.asarray(values if values is not None else [], dtype=np.float64)
    return y[np.isfinite(y)]


def _surge(y: np.ndarray, window: int, factor: float, floor: float,
           alpha: float) -> tuple[bool, float, float]:
    """Last window's mean > ``factor`` × the one before (the first window while they overlap), and the
    span they cover rising beyond its noise (a few spikes in a series of zeros move a mean, not a trend)."""
    now = float(y[-window:].mean())
    prev = y[-2 * window:-window] if y.size >= 2 * window else y[:window]
    before = float(prev.mean())
    rising = trend(y[-2 * window:], lag1_autocorrelation(y)).direction(alpha) == "rising"
    return now > factor * max(before, floor) and rising, now, before


def level_shift(y: np.ndarray, window: int) -> tuple[float, float, float]:
    """``(first, last, se)``: the means of the first and last ``window`` values and the standard error
    of their difference, ``sqrt(s_first²/w + s_last²/w)`` (each batch is a fresh rollout, so the two
    windows' values are independent draws)."""
    first, last = y[:window], y[-window:]
    se = math.sqrt(first.var(ddof=1) / first.size + last.var(ddof=1) / last.size) if window > 1 else math.inf
    return float(first.mean()), float(last.mean()), se


def _in_se(difference: float, se: float) -> float:
    """``difference / se``; ±inf when both windows are constant (se = 0)."""
    return difference / se if se > 0 else math.copysign(math.inf, difference)


def trend_text(name: str, word: str, line: Trend, alpha: float, extra: str = "") -> str:
    """``"<name> <word> (start -> end over the last n batches, slope/batch, p=...[; extra])"``; a
    ``flat`` whose test does not reject reads ``no trend beyond noise`` (its line may still move)."""
    word = "no trend beyond noise" if word == "flat" and line.p >= alpha else word
    return (f"{name} {word} ({line.start:.3g} -> {line.end:.3g} over the last {line.n} batches, "
            f"{line.slope:+.2e}/batch, p={_p_text(line.p, alpha)}{'; ' + extra if extra else ''})")


def _p_text(p: float, alpha: float) -> str:
    """``p`` to 2 significant digits, or 3 where 2 would round it up to ``alpha`` (0.0497 -> 0.0497, not 0.05)."""
    text = f"{p:.2g}"
    return f"{p:.3g}" if p < alpha <= float(text) else text


def assess_health(history: Mapping[str, Sequence[float]], *, window: int = 20,
                  min_entropy: float = 0.02, max_entropy_drop: float = 0.9,
                  fast_entropy_drop: float = 0.3, min_reward_gain: float = 0.02,
                  clip_high: float = 0.02, clip_floor: float = 1e-3, kl_floor: float = 1e-4,
                  surge: float = 3.0, alpha: float = 0.05, max_entropy_rise: float = 0.5) -> tuple[str, str]:
    """Verdict ``healthy | watch | collapsed`` and its reason in words (module docstring).

    ``history`` maps ``train/entropy``, ``train/reward_mean``, ``clip/pos_high``, ``train/kl`` to
    per-rollout-batch values (missing keys and NaNs are skipped). ``fast_entropy_drop`` is the share
    of the initial entropy whose loss within one window counts as "fast"; ``min_reward_gain`` the
    change of the reward's line across the window below which it reads flat; ``alpha`` the level of
    the Mann-Kendall trend test; ``clip_high`` the clip ratio that, as the window's median, counts
    as "persistently high"; ``clip_floor``/``kl_floor`` keep a surge from tiny values from counting;
    ``max_entropy_rise`` the share of the initial entropy a rise must exceed to count.
    """
    entropy, reward = _finite(history.get(ENTROPY)), _finite(history.get(REWARD))
    clip, kl = _finite(history.get(CLIP)), _finite(history.get(KL))
    known = max(entropy.size, reward.size, clip.size, kl.size)
    if known < window:
        return "healthy", f"too early to judge: {known} of {window} batches"

    signs: dict[str, str] = {}
    notes: list[str] = []
    entropy_collapsed = entropy_fast = False
    if entropy.size >= window:
        initial, now = float(entropy[:window].mean()), float(entropy[-window:].mean())
        line = trend(entropy[-window:], lag1_autocorrelation(entropy))
        word = line.direction(alpha)
        collapse_level = (1.0 - max_entropy_drop) * initial
        entropy_collapsed = now < min_entropy or now < collapse_level
        before = float(entropy[-2 * window:-window].mean()) if entropy.size >= 2 * window else initial
        entropy_fast = (word == "falling" and -line.change > fast_entropy_drop * initial
                        and before - now > fast_entropy_drop * initial / 2 and max(now, line.end) < initial)
        if now < collapse_level:
            signs["entropy"] = (f"entropy collapsed to {now:.3g} (mean of the last {window} batches; "
                                f"initial {initial:.3g})")
        elif entropy_collapsed:
            signs["entropy"] = (f"entropy collapsed to {now:.3g} (mean of the last {window} batches, "
                                f"below {min_entropy:g})")
        elif entropy_fast:
            signs["entropy"] = trend_text("entropy", "falling fast", line, alpha,
                                          f"window mean {before:.3g} -> {now:.3g}, initial {initial:.3g}")
        else:
            notes.append(trend_text("entropy", word, line, alpha))
        if entropy.size >= 2 * window:
            first, last, se = level_shift(entropy, window)
            if last > first + SHIFT_SE * se and last > (1.0 + max_entropy_rise) * first:
                signs["entropy"] = (f"entropy rose from {first:.3g} to {last:.3g} (first and last {window} "
                                    f"batches, +{_in_se(last - first, se):.1f} SE)")
    reward_rising = reward_rose = False
    if reward.size >= window:
        line = trend(reward[-window:], lag1_autocorrelation(reward))
        word = line.direction(alpha, min_change=min_reward_gain)
        reward_rising = word == "rising"
        notes.append(trend_text("reward", word, line, alpha))
    if reward.size >= 2 * window:
        first, last, se = level_shift(reward, window)
        reward_rose = last > first + max(min_reward_gain, LEARNING_SE * se)
        if last < first - max(min_reward_gain, SHIFT_SE * se):
            signs["reward"] = (f"reward fell from {first:.3g} to {last:.3g} (first and last {window} batches, "
                               f"{_in_se(last - first, se):.1f} SE)")
    learning = (f"; the reward up from {first:.3g} to {last:.3g} over the first and last {window} batches: learning"
                if reward_rose else "")
    rising: list[str] = []   # the series whose rise the reward excuses: not "stable"
    clip_persistent = False
    if clip.size >= window:
        median = float(np.median(clip[-window:]))
        clip_persistent = median > clip_high
        clip_surging, now, before = _surge(clip, window, surge, clip_floor, alpha)
        if clip_persistent:
            signs["clip"] = (f"clip ratio persistently high (median {median:.3g} > {clip_high:g} "
                             f"over the last {window} batches)")
        elif clip_surging and reward_rose:
            notes.append(f"clip ratio rising (window mean {before:.3g} -> {now:.3g}{learning})")
            rising.append("clip ratio")
        elif clip_surging:
            signs["clip"] = f"clip ratio surging (window mean {before:.3g} -> {now:.3g})"
    if kl.size >= 3 * window:   # the first window is the ramp from 0 (module docstring)
        kl_surging, now, before = _surge(kl, window, surge, kl_floor, alpha)
        if kl_surging and reward_rose:
            notes.append(f"KL rising (window mean {before:.3g} -> {now:.3g}{learning})")
            rising.append("KL")
        elif kl_surging:
            signs["kl"] = f"KL surging (window mean {before:.3g} -> {now:.3g})"

    collapsed = (entropy_collapsed and (not reward_rising or clip_persistent)) or (
        entropy_fast and not reward_rising and clip_persistent)
    parts = [*signs.values(), *notes]
    if collapsed:
        return "collapsed", "; ".join(parts)
    if signs:
        return "watch", "; ".join(parts)
    stable = [name for name, y in (("clip ratio", clip), ("KL", kl)) if y.size >= window and name not in rising]
    return "healthy", "; ".join([*parts, *([" and ".join(stable) + " stable"] if stable else [])])


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
                 kl_floor: float = 1e-4, surge: float = 3.0, alpha: float = 0.05,
                 max_entropy_rise: float = 0.5) -> None:
        super().__init__(prog_bar=("health/status",))
        self.interval = interval
        self.thresholds = dict(window=window, min_entropy=min_entropy, max_entropy_drop=max_entropy_drop,
                               fast_entropy_drop=fast_entropy_drop, min_reward_gain=min_reward_gain,
                               clip_high=clip_high, clip_floor=clip_floor, kl_floor=kl_floor, surge=surge,
                               alpha=alpha, max_entropy_rise=max_entropy_rise)
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
