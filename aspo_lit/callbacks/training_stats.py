"""Per-step training statistics: clipping, ratios, loss, KL, rewards, lengths, timings (paper Fig. 2, 3).

Two kinds of values, each reduced across ranks by what it is a mean, sum or maximum of:

* every statistic in the step's ``stats`` (`aspo_lit.maths.step.StepOutput`), by the weight and
  reduction it declares where it is made (`aspo_lit.maths.stats.Stat`): the loss's clip shares and ratio
  means (weighed by the response tokens of their advantage sign), a user loss's own statistics,
  ``train/pg_loss`` (mean over the optimizer steps and ranks), ``train/kl`` (weighed by tokens),
  ``train/grad_norm``, ``train/skipped_steps``, ``train/updates_per_rollout``, the DataModule's
  ``batch/*``, ``timing/*`` (max: the slowest rank sets the pace) and ``rollout/*`` (the
  sampler/trainer mismatch, `aspo_lit.maths.sampler_mismatch`);
* what this callback derives from the step's tensors: ``train/reward_mean``, ``train/reward_std``
  (population std), ``response/length_mean``, ``response/clip_ratio`` (share of responses cut at
  the length limit) over all responses, ``response/length_max``; ``ratio/off_policy_share``, the
  share of response tokens whose ratio moved (``|r − 1| > 1e-6``: 0 when every update is
  on-policy); ``timing/step_s``, this callback's wall clock from batch start to batch end, and
  ``perf/tokens_per_s`` = Σ_ranks response tokens / ``timing/step_s``;
* the whole batch: ``timing/batch_s``, the wall clock since the previous batch's statistics, split
  into what spent it (the DataModule's rollout, the training step, each callback, validation,
  Lightning's loop, `aspo_lit.callbacks.batch_timer.batch_accounting`), measured through the
  trainer's profiler, which this callback wraps in a `BatchTimer` at ``setup`` (a user's profiler
  still receives every action).
"""

from __future__ import annotations

import time
from typing import Any

from aspo_lit.callbacks.base import Diagnostic, global_maxes, global_sum, reduce_stats, weighted_means
from aspo_lit.callbacks.batch_timer import VALIDATION, BatchTimer, batch_accounting

OFF_POLICY_TOLERANCE = 1e-6


class TrainingStats(Diagnostic):
    """The step's statistics, rewards, lengths, the off-policy share and the step's pace."""

    def __init__(self, prog_bar: tuple[str, ...] = ("train/reward_mean",)) -> None:
        super().__init__(prog_bar)
        self._t0: float | None = None
        self._timer: BatchTimer | None = None
        self._callbacks: list[str] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            if not isinstance(trainer.profiler, BatchTimer):
                trainer.profiler = BatchTimer(trainer.profiler)
            self._timer = trainer.profiler
            self._callbacks = [type(cb).__name__ for cb in trainer.callbacks]

    def on_train_start(self, trainer, pl_module) -> None:
        if self._timer is not None:
            self._timer.take()  # the first window starts here, after the engines' start-up

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._timer is not None:
            self._timer.phase = VALIDATION

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._timer is not None:
            self._timer.phase = ""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def compute(self, trainer, pl_module, step) -> dict[str, Any]:
        step_s = time.perf_counter() - self._t0 if self._t0 is not None else float("nan")
        metrics = reduce_stats(step.stats, trainer=trainer)

        mask = step.response_mask
        rewards = step.rewards.reshape(-1)
        lengths = step.response_lengths.reshape(-1)
        moved = (step.ratio - 1.0).abs() > OFF_POLICY_TOLERANCE
        means = weighted_means({
            "train/reward_mean": (rewards, None),
            "reward_sq": (rewards.double() ** 2, None),
            "response/length_mean": (lengths, None),
            "response/clip_ratio": (step.truncated.double(), None),
            "ratio/off_policy_share": (moved.double(), mask),
        }, trainer=trainer)
        ex2 = means.pop("reward_sq")
        means["train/reward_std"] = (ex2 - means["train/reward_mean"] ** 2).clamp_min(0).sqrt()
        metrics.update(means)
        maxima = {"response/length_max": lengths, "timing/step_s": step_s}
        if self._timer is not None:
            maxima.update(batch_accounting(*self._timer.take(), self._callbacks))
        metrics.update(global_maxes(maxima, trainer=trainer))
        metrics["perf/tokens_per_s"] = global_sum(mask.sum(), trainer=trainer) / metrics["timing/step_s"]
        return metrics
