"""A progress bar line with what tells a run's state at a glance: reward, entropy, health, step time.

Reads the latest logged values from ``trainer.callback_metrics`` (so the metrics need no
``prog_bar=True``) and the verdict word from a :class:`HealthMonitor` if one is attached. Rich when
the ``rich`` package is installed, TQDM otherwise.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE

from aspo_lit.callbacks.health import HealthMonitor

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


class _DiagnosticsLine:
    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        shown_elsewhere = {*SHOWN.values(), "health/status"}
        items = {k: v for k, v in items.items() if k not in shown_elsewhere}
        return {**items, **diagnostics_line(trainer)}


class DiagnosticsTQDMProgressBar(_DiagnosticsLine, TQDMProgressBar):
    """TQDM bar showing reward, entropy, health verdict and step time."""


class DiagnosticsProgressBar(_DiagnosticsLine, RichProgressBar if _RICH_AVAILABLE else TQDMProgressBar):
    """Rich (else TQDM) bar showing reward, entropy, health verdict and step time."""
