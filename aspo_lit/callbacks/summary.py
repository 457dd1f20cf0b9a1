"""RunSummary: at the end of fit, say what was trained and where its logs, figures and checkpoints are."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from lightning.pytorch import Callback

from aspo_lit.callbacks.base import resolve_log_dir


def _metric_series(metrics_csv: Path, key: str) -> list[float]:
    if not metrics_csv.exists():
        return []
    with metrics_csv.open() as handle:
        return [float(row[key]) for row in csv.DictReader(handle) if row.get(key) not in (None, "")]


def _first_last(values: list[float]) -> str:
    return f"{values[0]:.3f} -> {values[-1]:.3f}" if values else "n/a"


class RunSummary(Callback):
    """Prints a short report (rank 0) when fit ends or is interrupted."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.log_dir = Path(resolve_log_dir(trainer))  # a collective: every rank calls it

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        log_dir = self.log_dir
        metrics_csv = log_dir / "metrics.csv"
        for logger in trainer.loggers:
            save = getattr(logger, "save", None)
            if callable(save):
                save()
        val_keys = [k for k in trainer.callback_metrics if k.startswith("val/avg@")]
        lines = [
            "",
            "=" * 72,
            f"aspo-lit: trained {pl_module.hparams.model_name_or_path} with loss "
            f"'{pl_module.hparams.loss_name}' for {trainer.global_step} optimizer steps",
            f"  reward mean      {_first_last(_metric_series(metrics_csv, 'train/reward_mean'))}",
            f"  entropy          {_first_last(_metric_series(metrics_csv, 'train/entropy'))}",
        ]
        lines += [f"  {k:<16} {_first_last(_metric_series(metrics_csv, k))}" for k in val_keys]
        figures = log_dir / "figures"
        if metrics_csv.exists():
            from aspo_lit.figures import plot_figure2

            plot_figure2([str(log_dir)], str(figures / "figure2"), labels=[pl_module.hparams.loss_name])
        health = log_dir / "health.json"
        if health.exists():
            verdict = json.loads(health.read_text())
            lines.append(f"  health           {verdict.get('verdict')}: {verdict.get('reason')}")
        lines += [
            f"  metrics (CSV)    {metrics_csv}",
            f"  figures          {figures}  (figure2.png: Fig. 2 panels; token_weights_*.png: Fig. 4)",
            f"  config           {log_dir / 'config.yaml'}",
        ]
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and getattr(ckpt, "last_model_path", ""):
            lines.append(f"  last checkpoint  {ckpt.last_model_path}  (resume: --ckpt_path last)")
        lines.append("=" * 72)
        print("\n".join(lines), flush=True)
