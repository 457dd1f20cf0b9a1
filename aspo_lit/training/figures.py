"""Paper Fig. 2 from the logs of several runs: accuracy, entropy, repetition, clip ratio, KL.

    python -m aspo_lit figure2 '[runs/grpo, runs/aspo]' --labels '[GRPO, ASPO]' --out figure2

A run is whatever its logger wrote (:func:`read_metrics`): a Lightning ``CSVLogger``
``metrics.csv`` or the CSV file itself, a ``TensorBoardLogger`` folder (its ``events.out.tfevents.*``
files; needs the ``tensorboard`` package), or ``wandb:ENTITY/PROJECT/RUN_ID`` for a W&B run (read
through ``wandb.Api``, so online only). A folder is searched for the newest of these below it.
The accuracy panel plots validation ``avg@K`` (a ``val/...avg@...`` series) when any run has one,
else ``train/reward_mean``. Writes ``<out>.png`` and ``<out>.svg``.

:func:`log_figure` hands a figure (or its PNG) to every logger of a run that takes images, so the
figure callbacks' PNGs (Fig. 2, Fig. 4) also show up in TensorBoard and W&B.
"""

from __future__ import annotations

import csv
import glob
import math
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

PANELS = (  # (metric, panel title); the accuracy panel is chosen per call, see accuracy_key
    (None, "Accuracy"),
    ("train/entropy", "Entropy"),
    ("train/repetition_rate", "Repetition rate"),
    ("clip/pos_high", "Clip ratio (A > 0)"),
    ("train/kl", "KL loss"),
)
_AVG_AT = re.compile(r"^val/.*avg@")


WANDB_PREFIX = "wandb:"
_EVENTS = "events.out.tfevents."
_NOT_METRICS = ("step", "epoch", "trainer/global_step")  # the x axis, not series


def is_tensorboard_events(path: str) -> bool:
    """Whether ``path`` names a TensorBoard event file (``events.out.tfevents.*``)."""
    return os.path.basename(path).startswith(_EVENTS)


def find_metrics_source(run: str) -> str:
    """Where a run's metrics are: ``run`` itself if it is a file or a ``wandb:`` path, else the
    newest ``metrics.csv`` or TensorBoard event folder below it (a folder holding both: the CSV)."""
    if run.startswith(WANDB_PREFIX) or os.path.isfile(run):
        return run
    newest: dict[str, float] = {}  # folder -> mtime of its newest metrics file
    for path in glob.glob(os.path.join(glob.escape(run), "**", "*"), recursive=True):
        name = os.path.basename(path)
        if (name == "metrics.csv" or name.startswith(_EVENTS)) and os.path.isfile(path):
            folder = os.path.dirname(path)
            newest[folder] = max(newest.get(folder, 0.0), os.path.getmtime(path))
    if not newest:
        raise FileNotFoundError(f"no metrics.csv or TensorBoard event file under {run}")
    folder = max(newest, key=newest.get)
    csv_path = os.path.join(folder, "metrics.csv")
    return csv_path if os.path.isfile(csv_path) else folder


def read_metrics(path: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{metric: (steps, values)}`` of one run, in logging order; non-finite values are skipped.

    ``path``: a CSVLogger file (empty cells skipped), a TensorBoard event file or a folder (scalars
    only, read with tensorboard's ``EventAccumulator``), ``wandb:ENTITY/PROJECT/RUN_ID`` (the run's
    history through ``wandb.Api``, online), or a run folder (:func:`find_metrics_source`).
    """
    source = find_metrics_source(path)
    if source.startswith(WANDB_PREFIX):
        series = _read_wandb(source[len(WANDB_PREFIX):])
    elif os.path.isdir(source) or is_tensorboard_events(source):
        series = _read_tensorboard(source)
    else:
        series = _read_csv(source)
    return {k: tuple(np.asarray(c) for c in zip(*v)) for k, v in series.items()}


def _read_csv(path: str) -> dict[str, list[tuple[float, float]]]:
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = _float(row.get("step"))
            for key, cell in row.items():
                value = _float(cell)
                if key not in _NOT_METRICS and value is not None and step is not None:
                    series[key].append((step, value))
    return series


def _read_tensorboard(path: str) -> dict[str, list[tuple[float, float]]]:
    try:  # tensorboard is optional (the `tensorboard` extra): import it only for a TensorBoard run
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
    except ImportError as err:
        raise ImportError(f"{path} is a TensorBoard run: reading it needs `pip install tensorboard`") from err

    # keep every event (the default keeps a sample of 10,000) and no purge: the series as written
    events = EventAccumulator(path, size_guidance={SCALARS: 0}, purge_orphaned_data=False).Reload()
    series: dict[str, list[tuple[float, float]]] = {}
    for tag in events.Tags()[SCALARS]:
        if tag not in _NOT_METRICS:
            points = [(float(e.step), e.value) for e in events.Scalars(tag) if math.isfinite(e.value)]
            if points:
                series[tag] = points
    return series


def _read_wandb(run_path: str) -> dict[str, list[tuple[float, float]]]:
    try:
        import wandb
    except ImportError as err:
        raise ImportError(f"wandb:{run_path} is a W&B run: reading it needs `pip install wandb`") from err

    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    # WandbLogger logs the trainer's step as `trainer/global_step` (W&B's own `_step` counts calls)
    for row in wandb.Api().run(run_path).scan_history():
        step = _float(row.get("trainer/global_step"))
        step = _float(row.get("_step")) if step is None else step
        for key, cell in row.items():
            value = None if isinstance(cell, (bool, str, dict, list)) else _float(cell)
            if not key.startswith("_") and key not in _NOT_METRICS and value is not None and step is not None:
                series[key].append((step, value))
    return series


def _float(cell: str | None) -> float | None:
    try:
        value = float(cell)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def accuracy_key(runs: Sequence[dict]) -> str:
    keys = sorted({k for run in runs for k in run if _AVG_AT.match(k)},
                  key=lambda k: (-sum(k in run for run in runs), k))
    return keys[0] if keys else "train/reward_mean"


def ema_smooth(y: np.ndarray, alpha: float) -> np.ndarray:
    if alpha <= 0 or y.size == 0:
        return y
    out = np.empty_like(y, dtype=np.float64)
    out[0] = y[0]
    for i in range(1, y.size):  # exponential moving average, as TensorBoard's slider
        out[i] = alpha * out[i - 1] + (1 - alpha) * y[i]
    return out


#: what a panel says when its series is 0 in every batch of every run (nothing to draw but a flat line)
NOTHING = {"train/repetition_rate": "no repeated n-grams in any batch", "clip/pos_high": "no token clipped in any batch"}


def plot_figure2(run_dirs: Sequence[str], out_path_stem: str, labels: Sequence[str] | None = None,
                 smooth: float = 0.0, window: int | None = None,
                 bands: dict[str, dict[int, tuple[float, float, float]]] | None = None,
                 band_label: str = "reference") -> list[str]:
    """Overlay the Fig. 2 panels of ``run_dirs``; save ``<stem>.png`` and ``<stem>.svg``.

    ``window``: draw each run's per-batch values faintly and its means over windows of that many
    batches over them (a run's own figure: one batch's value is mostly that batch's sampling noise).
    ``bands``: per metric, ``{window: (low, mean, high)}`` of reference seeds (``aspo_lit.maths.bands.seed_range``)
    drawn behind the runs, in windows of ``window`` batches. A panel whose series is 0 in every batch of
    every run says so instead of drawing a flat line."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    labels = list(labels) if labels else [os.path.basename(os.path.normpath(r)) for r in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    runs = [read_metrics(r) for r in run_dirs]
    accuracy = accuracy_key(runs)
    fig = Figure(figsize=(4 * len(PANELS), 3.4), layout="constrained")
    for ax, (key, title) in zip(fig.subplots(1, len(PANELS)), PANELS):
        key = key or accuracy
        if bands and key in bands and window:
            draw_seed_range(ax, bands[key], window, band_label)
        values = [run[key][1] for run in runs if key in run]
        if values and all(not np.any(v) for v in values):
            ax.text(0.5, 0.5, NOTHING.get(key, f"{key} = 0 in every batch"), ha="center", va="center",
                    transform=ax.transAxes, fontsize=9, color="0.3")
        for i, (run, label) in enumerate(zip(runs, labels)):
            if key not in run or not np.any(run[key][1]):
                continue
            steps, y = run[key]
            if window and len(steps) >= 2 * window:
                ax.plot(steps, y, color=f"C{i}", lw=0.7, alpha=0.35)
                index = np.floor(steps / window).astype(int)
                centres = [w * window + (window - 1) / 2 for w in np.unique(index)]
                ax.plot(centres, [y[index == w].mean() for w in np.unique(index)], color=f"C{i}", lw=1.6,
                        marker="o", ms=3, label=f"{label} (means of {window} batches)")
            else:
                ax.plot(steps, ema_smooth(y, smooth), color=f"C{i}", label=label, lw=1.4,
                        marker="o" if len(steps) < 30 else None, ms=3)
        ax.set(title=title, xlabel="step", ylabel=key)
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize=7)
    stem = os.path.splitext(out_path_stem)[0] if out_path_stem.endswith((".png", ".svg")) else out_path_stem
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    paths = [f"{stem}.png", f"{stem}.svg"]
    for path in paths:
        fig.savefig(path, dpi=130)
    return paths


def draw_seed_range(ax, ranges: dict[int, tuple[float, float, float]], window: int, label: str = "seeds") -> None:
    """Reference seeds' 5th-95th percentile per window (a window's band spans its steps) and their mean."""
    for i, (w, (low, _, high)) in enumerate(sorted(ranges.items())):
        ax.fill_between([w * window - 0.5, (w + 1) * window - 0.5], [low, low], [high, high], color="0.6", alpha=0.3,
                        lw=0, label=f"{label}: 5-95 % of seeds" if i == 0 else None)
    ax.plot([w * window + (window - 1) / 2 for w in sorted(ranges)], [ranges[w][1] for w in sorted(ranges)],
            color="0.4", ls="--", lw=1, label=f"{label}: mean")


def figure_pixels(figure: Any) -> np.ndarray:
    """``[H, W, 3]`` uint8 RGB of a matplotlib ``Figure`` (drawn with Agg) or of an image file (PNG)."""
    if isinstance(figure, (str, os.PathLike)):
        from matplotlib.image import imread

        pixels = imread(os.fspath(figure))
    else:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global backend state

        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        pixels = np.asarray(canvas.buffer_rgba())
    if pixels.dtype != np.uint8:  # PNGs read as floats in [0, 1]
        pixels = (np.clip(pixels, 0.0, 1.0) * 255).round().astype(np.uint8)
    if pixels.ndim == 2:
        pixels = np.stack([pixels] * 3, axis=-1)
    return np.ascontiguousarray(pixels[..., :3])


def log_figure(trainer: Any, tag: str, figure: Any, step: int | None = None) -> list[str]:
    """Hand ``figure`` (a matplotlib ``Figure`` or the path of its PNG) to every logger of
    ``trainer`` that takes images; returns the class names of those that took it.

    * ``TensorBoardLogger``: ``experiment.add_image(tag, pixels, step)`` -- what ``add_figure``
      does, drawn here with Agg instead of pyplot (the Images tab, one slider per ``tag``);
    * a logger with ``log_image(key, images, step)`` (``WandbLogger``): the PNG file itself when
      ``figure`` is a path, else the pixels;
    * any other logger (``CSVLogger``): nothing -- the PNG written next to the logs is the record.

    Call it on rank 0 (loggers only write there). ``step`` defaults to the step the logger puts on
    this batch's scalars (:func:`logger_step`), so a figure lines up with the curves.
    """
    from lightning.pytorch.loggers import TensorBoardLogger

    step = logger_step(trainer) if step is None else int(step)
    pixels: np.ndarray | None = None
    took = []
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            pixels = figure_pixels(figure) if pixels is None else pixels
            logger.experiment.add_image(tag, pixels, global_step=step, dataformats="HWC")
        elif callable(getattr(logger, "log_image", None)):
            if isinstance(figure, (str, os.PathLike)):
                image = os.fspath(figure)
            else:
                pixels = figure_pixels(figure) if pixels is None else pixels
                image = pixels
            logger.log_image(key=tag, images=[image], step=step)
        else:
            continue
        took.append(type(logger).__name__)
    return took


def logger_step(trainer: Any) -> int:
    """The step the trainer's loggers put on the current batch's scalars: the rollout batch index
    (docs/metrics.md: every metric is logged once per rollout batch, which is several optimizer
    steps, so this is not ``trainer.global_step``)."""
    return max(int(trainer.fit_loop.total_batch_idx), 0)


def figure2(runs: list[str] | str, out: str = "figure2", labels: list[str] | None = None, smooth: float = 0.0) -> int:
    """Overlay the paper's Fig. 2 panels of several runs; write <out>.png and <out>.svg.

    Args:
        runs: run folders (CSV or TensorBoard logs), metrics.csv files, or wandb:ENTITY/PROJECT/RUN_ID:
            one, or a list of them ('[runs/grpo, runs/aspo]').
        out: output path without extension.
        labels: one label per run (default: the run folders' names).
        smooth: EMA weight in [0, 1) (0: no smoothing).
    """
    runs = [runs] if isinstance(runs, str) else list(runs)
    for path in plot_figure2(runs, out, labels, smooth):
        print(path)
    return 0
