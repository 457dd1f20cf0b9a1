"""Per-step training statistics: clipping, ratios, KL, rewards, lengths, timings (paper Fig. 2, 3).

Every value is reduced across ranks by what it is a mean of:

* ``clip/pos_high``, ``clip/pos_dual``, ``ratio/pos_mean`` — fractions/means over A>0 tokens,
  weighted by ``loss_stats["count/pos_tokens"]``; ``clip/neg_low``, ``clip/neg_dual``,
  ``ratio/neg_mean`` likewise by ``count/neg_tokens`` (docs/design.md "Losses");
* ``train/pg_loss`` — mean over ranks (DDP averages the per-rank losses' gradients);
* ``train/kl`` — weighted by the rank's response tokens; ``train/grad_norm`` and
  ``train/skipped_steps`` — max over ranks (equal on all ranks after the gradient all-reduce);
* ``train/reward_mean``, ``train/reward_std`` (population std), ``response/length_mean``,
  ``response/clip_ratio`` (share of responses truncated at ``max_tokens``) — over all responses;
  ``response/length_max`` — max;
* ``batch/*`` (``batch_stats``) — mean over ranks (each rank draws the same number of prompts),
  except counts (keys in ``sum_keys`` or containing ``count``), which are summed;
* ``timing/*`` — max over ranks (the slowest rank sets the pace), plus ``timing/step_s``, this
  callback's wall clock from batch start to batch end;
* ``perf/tokens_per_s`` — Σ_ranks ``num_tokens`` / ``timing/step_s``;
* ``rollout/logprob_diff_mean``, ``rollout/is_ratio_mean`` (sampler/trainer mismatch, see
  `aspo_lit.sampler_mismatch`) — weighted by the rank's response tokens; ``*_max`` — max.

Every rank must return the same keys in ``loss_stats``, ``batch_stats`` and ``timings`` (they
are reduced key by key, in sorted order).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from aspo_lit.callbacks.base import Diagnostic, global_maxes, global_sum, weighted_means

POS_STATS = ("clip/pos_high", "clip/pos_dual", "ratio/pos_mean")
NEG_STATS = ("clip/neg_low", "clip/neg_dual", "ratio/neg_mean")


class TrainingStats(Diagnostic):
    """Clip fractions, ratio means, loss, KL, grad norm, rewards, lengths, batch stats, timings."""

    def __init__(self, sum_keys: tuple[str, ...] = ("batch/filtered_groups", "batch/filter_remainder_count"),
                 prog_bar: tuple[str, ...] = ("train/reward_mean",)) -> None:
        super().__init__(prog_bar)
        self.sum_keys = tuple(sum_keys)
        self._t0: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def compute(self, trainer, pl_module, d) -> dict[str, Any]:
        step_s = time.perf_counter() - self._t0 if self._t0 is not None else float("nan")
        mask = torch.as_tensor(d["response_mask"])
        n_tokens = mask.sum()
        loss_stats = dict(sorted((d.get("loss_stats") or {}).items()))  # same order on every rank
        n_pos = loss_stats.pop("count/pos_tokens", 1.0)
        n_neg = loss_stats.pop("count/neg_tokens", 1.0)
        pg_loss = loss_stats.pop("pg_loss", float("nan"))

        rewards = torch.as_tensor(d["rewards"]).reshape(-1)
        lengths = torch.as_tensor(d.get("response_lengths", mask.sum(-1))).reshape(-1)
        truncated = torch.as_tensor(d.get("truncated", torch.zeros_like(lengths))).reshape(-1)
        means = {
            "train/pg_loss": (pg_loss, None),
            "train/kl": (d.get("kl", float("nan")), n_tokens),
            "train/reward_mean": (rewards, None),
            "reward_sq": (rewards.double() ** 2, None),
            "response/length_mean": (lengths, None),
            "response/clip_ratio": (truncated.double(), None),
        }
        means.update({k: (loss_stats.pop(k), n_pos) for k in POS_STATS if k in loss_stats})
        means.update({k: (loss_stats.pop(k), n_neg) for k in NEG_STATS if k in loss_stats})
        means.update({_name(k, "train"): (v, None) for k, v in loss_stats.items()
                      if not k.startswith("count/")})
        batch_stats = {_name(k, "batch"): v for k, v in sorted((d.get("batch_stats") or {}).items())}
        means.update({k: (v, None) for k, v in batch_stats.items() if not self._is_count(k)})
        metrics = weighted_means(means, trainer=trainer)

        ex2 = metrics.pop("reward_sq")
        metrics["train/reward_std"] = (ex2 - metrics["train/reward_mean"] ** 2).clamp_min(0).sqrt()
        counts = [k for k in batch_stats if self._is_count(k)]
        if counts:
            summed = global_sum([float(batch_stats[k]) for k in counts], trainer=trainer)
            metrics.update(zip(counts, summed.unbind()))

        rollout = dict(sorted((d.get("rollout_stats") or {}).items()))
        n_rollout = rollout.pop("rollout/num_tokens", None)
        if rollout:
            metrics.update(weighted_means({k: (v, n_rollout) for k, v in rollout.items() if k.endswith("_mean")},
                                          trainer=trainer))
        maxes = {"train/grad_norm": d.get("grad_norm", float("nan")),
                 "train/skipped_steps": d.get("skipped_steps", 0),
                 "response/length_max": lengths,
                 "timing/step_s": step_s}
        maxes.update({_name(k, "timing"): v for k, v in sorted((d.get("timings") or {}).items())})
        maxes.update({k: v for k, v in rollout.items() if k.endswith("_max")})
        metrics.update(global_maxes(maxes, trainer=trainer))
        num_tokens = global_sum(d.get("num_tokens", n_tokens), trainer=trainer)
        metrics["perf/tokens_per_s"] = num_tokens / metrics["timing/step_s"]
        return metrics

    def _is_count(self, key: str) -> bool:
        return key in self.sum_keys or "count" in key


def _name(key: str, prefix: str) -> str:
    return key if "/" in key else f"{prefix}/{key}"
