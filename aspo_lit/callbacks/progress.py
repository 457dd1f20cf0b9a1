"""A progress bar line with what tells a run's state at a glance: reward, entropy, health, step time.

Reads the latest logged values from ``trainer.callback_metrics`` (so the metrics need no
``prog_bar=True``) and the verdict word from a :class:`HealthMonitor` if one is attached. Rich when
the ``rich`` package is installed, TQDM otherwise.

Its total is the rollout batches that will run: ``trainer.max_steps`` counts optimizer steps, and a
rollout batch gives ``ppo_epochs × batch_size / mini_batch_size`` of them, so a 160-step run of
4-step batches shows ``40/40``, not ``40/125`` (the prompt loader's length). With ``filter_groups``
a batch can give fewer steps, and the run then takes a few more batches than the bar's total.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE

from aspo_lit.callbacks.health import HealthMonitor
from aspo_lit.maths.step import updates_per_rollout

SHOWN = {"reward": "train/reward_mean", "entropy": "train/entropy", "step_s": "timing/step_s"}
VERDICTS = {0: "healthy", 1: "watch", 2: "collapsed"}


def diagnostics_line(trainer) -> dict[str, Any]:
    """``{reward, entropy, health, step_s}`` from the latest logged values (missing ones left out)."""
    logged = trainer.callback_metrics
    line: dict[str, Any] = {}
    for label, key in SHOWN.items():
        if key in logged:
            line[label] = float(logged[key])
    monitor = next((cb for cb in trainer.callbacks if isinstance(cb, HealthMonitor)), None)
    if monitor is not None:
        line["health"] = monitor.verdict
    elif "health/status" in logged:
        line["health"] = VERDICTS.get(int(logged["health/status"]), "?")
    return line


def planned_batches(trainer, total: int | float) -> int | float:
    """``total`` (this epoch's batches, as Lightning counts them) cut at the batch where
    ``max_steps`` optimizer steps are reached; ``total`` when that cannot be known."""
    module, data = trainer.lightning_module, trainer.datamodule
    model_hp, data_hp = getattr(module, "hparams", {}), getattr(data, "hparams", {})
    if trainer.max_steps is None or trainer.max_steps < 0 or "batch_size" not in data_hp \
            or not {"mini_batch_size", "ppo_epochs"} <= set(model_hp):
        return total
    per_batch = updates_per_rollout(data_hp["batch_size"], model_hp["mini_batch_size"], model_hp["ppo_epochs"])
    left = math.ceil(max(trainer.max_steps - trainer.global_step, 0) / per_batch)
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # this epoch's, before a resume
    return min(total, done + left)


class _DiagnosticsLine:
    @property
    def total_train_batches(self) -> int | float:
        return planned_batches(self.trainer, super().total_train_batches)  # type: ignore[misc]

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        shown_elsewhere = {*SHOWN.values(), "health/status"}
        items = {k: v for k, v in items.items() if k not in shown_elsewhere}
        return {**items, **diagnostics_line(trainer)}


class DiagnosticsTQDMProgressBar(_DiagnosticsLine, TQDMProgressBar):
    """TQDM bar showing reward, entropy, health verdict and step time."""


class DiagnosticsProgressBar(_DiagnosticsLine, RichProgressBar if _RICH_AVAILABLE else TQDMProgressBar):
    """Rich (else TQDM) bar showing reward, entropy, health verdict and step time."""
