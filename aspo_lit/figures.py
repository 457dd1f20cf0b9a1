"""Paper Fig. 2 from the CSV logs of several runs: accuracy, entropy, repetition, clip ratio, KL.

    python -m aspo_lit.figures runs/grpo runs/aspo --labels GRPO ASPO --out figure2

Each run is a folder holding a Lightning ``CSVLogger`` ``metrics.csv`` somewhere below it (the
newest one is used) or the CSV file itself. The accuracy panel plots validation ``avg@K``
(a ``val/...avg@...`` column) when any run has one, else ``train/reward_mean``. Writes
``<out>.png`` and ``<out>.svg``.
"""

from __future__ import annotations

import argparse
import csv
import glob
import math
import os
import re
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

PANELS = (  # (metric, panel title); the accuracy panel is chosen per call, see accuracy_key
    (None, "Accuracy"),
    ("train/entropy", "Entropy"),
    ("train/repetition_rate", "Repetition rate"),
    ("clip/pos_high", "Clip ratio (A > 0)"),
    ("train/kl", "KL loss"),
)
_AVG_AT = re.compile(r"^val/.*avg@")


def find_metrics_csv(run: str) -> str:
    """The run's ``metrics.csv`` (the run itself if a file, else the newest one below it)."""
    if os.path.isfile(run):
        return run
    found = glob.glob(os.path.join(run, "**", "metrics.csv"), recursive=True)
    if not found:
        raise FileNotFoundError(f"no metrics.csv under {run}")
    return max(found, key=os.path.getmtime)


def read_metrics(path: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{metric: (steps, values)}`` from a CSVLogger file (empty cells skipped)."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = _float(row.get("step"))
            for key, cell in row.items():
                value = _float(cell)
                if key not in ("step", "epoch") and value is not None and step is not None:
                    series[key].append((step, value))
    return {k: tuple(np.asarray(c) for c in zip(*v)) for k, v in series.items()}


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


def plot_figure2(run_dirs: Sequence[str], out_path_stem: str, labels: Sequence[str] | None = None,
                 smooth: float = 0.0) -> list[str]:
    """Overlay the Fig. 2 panels of ``run_dirs``; save ``<stem>.png`` and ``<stem>.svg``."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    labels = list(labels) if labels else [os.path.basename(os.path.normpath(r)) for r in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    runs = [read_metrics(find_metrics_csv(r)) for r in run_dirs]
    accuracy = accuracy_key(runs)
    fig = Figure(figsize=(4 * len(PANELS), 3.4), layout="constrained")
    for ax, (key, title) in zip(fig.subplots(1, len(PANELS)), PANELS):
        key = key or accuracy
        for i, (run, label) in enumerate(zip(runs, labels)):
            if key in run:
                steps, values = run[key]
                ax.plot(steps, ema_smooth(values, smooth), color=f"C{i}", label=label, lw=1.4,
                        marker="o" if len(steps) < 30 else None, ms=3)
        ax.set(title=title, xlabel="step", ylabel=key)
        ax.grid(alpha=0.3)
    fig.axes[0].legend()
    stem = os.path.splitext(out_path_stem)[0] if out_path_stem.endswith((".png", ".svg")) else out_path_stem
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    paths = [f"{stem}.png", f"{stem}.svg"]
    for path in paths:
        fig.savefig(path, dpi=130)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (or metrics.csv files)")
    parser.add_argument("--out", default="figure2", help="output path without extension")
    parser.add_argument("--labels", nargs="*", default=None, help="one label per run")
    parser.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1)")
    args = parser.parse_args(argv)
    for path in plot_figure2(args.runs, args.out, args.labels, args.smooth):
        print(path)


if __name__ == "__main__":
    main()
