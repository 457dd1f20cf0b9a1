"""The token-weight surface of paper Fig. 4: effective weight vs (π_old, π), per sign of A.

Prop. 4.1: the gradient of the clipped objective is ``Σ w·A·∇log π`` with a per-token weight ``w``
(``r = π/π_old`` inside the trust region for GRPO, 0 where clipped). Fig. 4(b): for A > 0, GRPO's
weight is largest where π ≫ π_old (top-left of the (π_old, π) square) and tiny where π < π_old
(bottom-right) — the over-weighting of already-reinforced tokens. ASPO flips it (weight 1/r, Sec. 6):
largest where π < π_old. For A < 0 both behave like Fig. 4(c).

:class:`TokenWeightSurface` samples ``(π_old, π, w, sign A)`` of response tokens from the step
diagnostics (``exp(old_logprobs)``, ``exp(logprobs)``, ``token_weight``; tokens with A = 0 carry no
gradient and are skipped) into a bounded reservoir, and every ``every_n_steps`` steps and at the
end of fit saves ``<log_dir>/figures/token_weights_step{N}.png`` (and the binned grids as ``.npz``):
two heat maps of the mean weight per (π_old, π) bin, ``N`` the optimizer step. Each PNG also goes
to every logger that takes images (:func:`aspo_lit.training.figures.log_figure`: TensorBoard's Images tab,
W&B) under the tag ``figures/token_weights``, at the logger's step. Rank 0 only, from rank 0's
tokens: the figure is a picture of a sample, no collective is involved.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from aspo_lit.callbacks.base import resolve_log_dir, step_output
from aspo_lit.maths.step import StepOutput
from aspo_lit.training.figures import log_figure


def bin_token_weights(pi_old: Any, pi: Any, weight: Any, bins: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """Mean weight per bin of the unit square, and the sample count per bin.

    Returns ``(mean, count)``, both ``[bins, bins]`` indexed ``[π bin, π_old bin]``: rows run up the
    y axis (π, the current policy), columns along the x axis (π_old), as ``imshow(origin="lower")``
    draws them. Empty bins are NaN in ``mean``.
    """
    y, x, w = (np.asarray(a, dtype=np.float64).reshape(-1) for a in (pi, pi_old, weight))
    square = [[0.0, 1.0], [0.0, 1.0]]
    total, _, _ = np.histogram2d(y, x, bins=bins, range=square, weights=w)
    count, _, _ = np.histogram2d(y, x, bins=bins, range=square)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, total / count, np.nan)
    return mean, count


class Reservoir:
    """Uniform sample of at most ``capacity`` rows from a stream (Vitter's algorithm R, batched)."""

    def __init__(self, capacity: int, width: int, seed: int = 0) -> None:
        self.rows = np.empty((capacity, width), dtype=np.float32)
        self.seen = 0
        self.rng = np.random.default_rng(seed)

    def add(self, rows: np.ndarray) -> None:
        capacity = self.rows.shape[0]
        fill = max(0, min(capacity - self.seen, len(rows)))
        self.rows[self.seen:self.seen + fill] = rows[:fill]
        rest = rows[fill:]
        if len(rest):  # row k of the stream replaces a random slot with probability capacity/(k+1)
            index = self.seen + fill + np.arange(len(rest))
            keep = self.rng.random(len(rest)) < capacity / (index + 1)
            slots = self.rng.integers(0, capacity, int(keep.sum()))
            self.rows[slots] = rest[keep]  # later rows overwrite earlier, as in the sequential form
        self.seen += len(rows)

    def sample(self) -> np.ndarray:
        return self.rows[: min(self.seen, self.rows.shape[0])]

    def clear(self) -> None:
        self.seen = 0


def plot_token_weights(samples: np.ndarray, path: str, bins: int = 20,
                       title: str = "") -> dict[str, np.ndarray]:
    """Draw the two Fig. 4 panels from rows ``(π_old, π, w, sign A)``; returns the binned grids."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(10, 4.4), layout="constrained")
    grids = {}
    for ax, (name, sign) in zip(fig.subplots(1, 2), (("pos", 1.0), ("neg", -1.0))):
        rows = samples[samples[:, 3] == sign]
        mean, count = bin_token_weights(rows[:, 0], rows[:, 1], rows[:, 2], bins)
        grids[f"{name}_mean"], grids[f"{name}_count"] = mean, count
        # colour scale to the 98th percentile: a few tokens with π_old → 0 have huge ratios
        vmax = float(np.nanpercentile(mean, 98)) if np.isfinite(mean).any() else 1.0
        image = ax.imshow(np.ma.masked_invalid(mean), origin="lower", extent=(0, 1, 0, 1),
                          cmap="viridis", aspect="equal", vmin=0.0, vmax=max(vmax, 1e-6))
        ax.plot([0, 1], [0, 1], color="white", lw=0.8, ls="--")
        ax.set(xlabel=r"$\pi_{old}$", ylabel=r"$\pi_\theta$",
               title=f"{'A > 0' if sign > 0 else 'A < 0'}  ({len(rows)} tokens)")
        fig.colorbar(image, ax=ax, label="mean effective token weight", extend="max")
    if title:
        fig.suptitle(title)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    return grids


class TokenWeightSurface(Callback):
    """Saves the Fig. 4 token-weight surface every ``every_n_steps`` steps and at the end of fit,
    and hands it to the run's image-taking loggers (TensorBoard, W&B).

    Args:
        every_n_steps: steps per window (samples are reset after each figure).
        max_samples: reservoir size, i.e. the memory bound (16 bytes a token).
        bins: bins per axis of the heat maps.
    """

    def __init__(self, every_n_steps: int = 50, max_samples: int = 200_000, bins: int = 20,
                 seed: int = 0) -> None:
        self.every_n_steps = every_n_steps
        self.bins = bins
        self.reservoir = Reservoir(max_samples, 4, seed)
        self.steps = 0
        self.saved: list[str] = []
        self._log_dir: str | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._log_dir = resolve_log_dir(trainer)  # a collective: every rank, once

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.is_global_zero:
            return
        self.reservoir.add(self._rows(step_output(outputs)))
        self.steps += 1
        if self.steps % self.every_n_steps == 0:
            self._save(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and self.reservoir.seen:
            self._save(trainer)

    @staticmethod
    def _rows(step: StepOutput) -> np.ndarray:
        mask = step.response_mask.detach().cpu() > 0
        sign = torch.sign(step.advantages.detach().cpu().float()).reshape(-1, 1)
        keep = mask & (sign != 0)
        columns = [step.old_logprobs, step.logprobs, step.token_weight]
        columns = [c.detach().cpu().float() for c in columns]
        columns[0], columns[1] = columns[0].exp(), columns[1].exp()
        columns.append(sign.expand_as(keep))
        return torch.stack([c[keep] for c in columns], dim=-1).numpy()

    def _save(self, trainer) -> None:
        step = trainer.global_step
        folder = os.path.join(self._log_dir or trainer.default_root_dir, "figures")
        path = os.path.join(folder, f"token_weights_step{step}.png")
        module = trainer.lightning_module
        name = type(getattr(module, "loss_fn", module)).__name__
        title = f"{name}: effective token weight, step {step}"
        grids = plot_token_weights(self.reservoir.sample(), path, self.bins, title)
        np.savez(path[:-4] + ".npz", **grids)
        log_figure(trainer, "figures/token_weights", path)
        self.saved.append(path)
        self.reservoir.clear()
