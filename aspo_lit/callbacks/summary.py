"""RunSummary: at the end of fit, say what was trained and where its logs, figures and checkpoints are.

The summary reads the run's scalars back from whichever local logger wrote them (``CSVLogger``'s
``metrics.csv`` or ``TensorBoardLogger``'s event files, :func:`aspo_lit.training.figures.read_metrics`),
draws Fig. 2 from them and hands the figure to every logger that takes images
(:func:`aspo_lit.training.figures.log_figure`). A W&B-only run has nothing local to read: the summary names
its ``wandb:`` path, which ``python -m aspo_lit figure2`` reads online.

This module also holds the two measures Lightning's ``ThroughputMonitor`` needs for a rollout
batch (``batch_size_fn``, ``length_fn``; the opt-in ``conf/loggers/throughput.yaml`` names them):
:func:`rollout_responses` and :func:`rollout_tokens`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from aspo_lit.callbacks.base import resolve_log_dir
from aspo_lit.rollout import RolloutBatch
from aspo_lit.training.figures import log_figure, plot_figure2, read_metrics

SUMMARY_WINDOW = 10   # batches averaged per end: a batch's noise / sqrt(10) (the demo's reward: 0.085 -> 0.027)


def rollout_responses(batch: Any) -> int:
    """``ThroughputMonitor(batch_size_fn=...)``: the responses in a batch (this rank's rows).

    A training batch is a :class:`~aspo_lit.rollout.RolloutBatch` (G responses per prompt); a
    validation batch is the DataModule's graded ``{"correct": [P, K]}`` (K samples per prompt).
    """
    if isinstance(batch, RolloutBatch):
        return batch.num_rows
    if isinstance(batch, dict) and "correct" in batch:
        return int(batch["correct"].numel())
    raise TypeError(f"rollout_responses: expected a RolloutBatch or a graded validation batch, got {type(batch)}")


def rollout_tokens(batch: Any) -> int:
    """``ThroughputMonitor(length_fn=...)``: the prompt + response tokens of a training batch (the
    real tokens its forward passes read, as verl's ``perf/throughput`` counts them).

    A validation batch carries only its grades, no tokens: it counts one item per response, so
    ``validate/device/items_per_sec`` is responses per second (``ThroughputMonitor`` needs the
    items of a batch to be at least its samples).
    """
    if isinstance(batch, RolloutBatch):
        return int(batch.attention_mask.sum().item())
    return rollout_responses(batch)


def metrics_source(trainer) -> tuple[str | None, str]:
    """``(what read_metrics reads, its kind)`` for the first local logger of ``trainer``."""
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            return os.path.join(logger.log_dir, "metrics.csv"), "CSV"
        if isinstance(logger, TensorBoardLogger):
            return logger.log_dir, "TensorBoard"
    return None, ""


def _wandb_path(trainer) -> str | None:
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            path = getattr(logger.experiment, "path", None)
            return f"wandb:{path}" if path else None
    return None


def end_window(n: int, window: int = SUMMARY_WINDOW) -> int:
    """Values averaged at each end of a series of ``n``: ``window``, at most a quarter of the run (so
    start and end never share a value and stay at the ends of a short run), at least 1."""
    return max(1, min(window, n // 4))


def _first_last(series: dict, key: str, window: int = SUMMARY_WINDOW) -> str:
    """``"start -> end  (what they are)"`` of a per-rollout-batch series: means of its first and last
    :func:`end_window` values, since one batch's value carries that batch's sampling noise."""
    values = np.asarray(series.get(key, ((), ()))[1], dtype=np.float64)
    if not values.size:
        return "n/a"
    w = end_window(values.size, window)
    what = f"means of the first/last {w} batches" if w > 1 else "first/last batch"
    return f"{values[:w].mean():.3f} -> {values[-w:].mean():.3f}  ({what})"


def _first_last_evaluation(series: dict, key: str) -> str:
    """First and last held-out evaluation: each is already a mean over its prompts and samples."""
    values = series.get(key, ((), ()))[1]
    return f"{values[0]:.3f} -> {values[-1]:.3f}  (first/last evaluation)" if len(values) else "n/a"


def figure_bands(log_dir: Path, pl_module, series: dict) -> tuple[int, dict | None, str]:
    """What a run's own Fig. 2 draws behind its series: the window (of the shipped reference its config
    is, else about a tenth of the run), the reference seeds' range per metric, and the reference's name
    (``aspo_lit.compare.run_reference.matching_reference``; its testbed must be the run's too)."""
    from aspo_lit.compare.run_reference import matching_reference
    from aspo_lit.maths.bands import seed_range

    batches = max((len(steps) for steps, _ in series.values()), default=0)
    config = log_dir / "config.yaml"
    ref = matching_reference(config.read_text()) if config.is_file() else None
    if ref is None or ref.testbed != pl_module.hparams.get("testbed"):
        return max(1, round(batches / 10)), None, ""
    return ref.window, {key: seed_range(m.values) for key, m in ref.metrics.items()}, Path(ref.path).stem


class RunSummary(Callback):
    """Prints a short report (rank 0) when fit ends or is interrupted, and draws Fig. 2.

    Reward and entropy are given as start -> end, each the mean over ``window`` rollout batches at
    that end of the run (at most a quarter of it, :func:`end_window`); ``val/avg@K`` as its first and
    last evaluation.
    """

    def __init__(self, window: int = SUMMARY_WINDOW) -> None:
        super().__init__()
        self.window = window

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.log_dir = Path(resolve_log_dir(trainer))  # a collective: every rank calls it

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        log_dir = self.log_dir
        for logger in trainer.loggers:  # flush: the CSV file and the event files are read below
            save = getattr(logger, "save", None)
            if callable(save):
                save()
        source, kind = metrics_source(trainer)
        series, unreadable = {}, ""
        if source is not None and os.path.exists(source):
            try:
                series = read_metrics(source)
            except ImportError as err:  # a TensorBoard run written through tensorboardX alone
                unreadable = str(err)
        val_keys = [k for k in trainer.callback_metrics if k.startswith("val/avg@")]
        lines = [
            "",
            "=" * 72,
            f"aspo-lit: trained {pl_module.hparams.model_name_or_path} with loss "
            f"'{pl_module.hparams.loss_name}' for {trainer.global_step} optimizer steps",
            f"  reward mean      {_first_last(series, 'train/reward_mean', self.window)}",
            f"  entropy          {_first_last(series, 'train/entropy', self.window)}",
        ]
        lines += [f"  {k:<16} {_first_last_evaluation(series, k)}" for k in val_keys]
        figures = log_dir / "figures"
        if series:
            window, bands, reference = figure_bands(log_dir, pl_module, series)
            paths = plot_figure2([source], str(figures / "figure2"), labels=[pl_module.hparams.loss_name],
                                 window=window, bands=bands, band_label=reference)
            log_figure(trainer, "figures/figure2", paths[0])
            if bands:
                lines.append(f"  reference        {reference}: drawn behind figure2.png; python -m aspo_lit compare "
                             f"{log_dir} --reference {reference}")
        health = log_dir / "health.json"
        if health.exists():
            verdict = json.loads(health.read_text())
            lines.append(f"  health           {verdict.get('verdict')}: {verdict.get('reason')}")
        if source is not None:
            lines.append(f"  {f'metrics ({kind})':<16} {source}")
        if unreadable:
            lines.append(f"  (not read: {unreadable})")
        wandb_path = _wandb_path(trainer)
        if wandb_path:
            lines.append(f"  metrics (W&B)    {wandb_path}  (python -m aspo_lit figure2 {wandb_path}: online; "
                         "an offline run after `wandb sync`)")
        lines += [
            f"  figures          {figures}  (figure2.png: Fig. 2 panels; token_weights_*.png: Fig. 4)",
            f"  config           {log_dir / 'config.yaml'}",
        ]
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and getattr(ckpt, "last_model_path", ""):
            lines.append(f"  last checkpoint  {ckpt.last_model_path}  (resume: --ckpt_path last)")
        lines.append("=" * 72)
        print("\n".join(lines), flush=True)
