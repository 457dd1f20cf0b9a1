"""The extension base for step diagnostics, and rank-correct reductions.

A diagnostic is a Lightning callback that reads the dict ``ASPOModule.training_step`` returns
(``docs/design.md`` "Step diagnostics") and turns it into scalars. Subclass :class:`Diagnostic`,
implement :meth:`Diagnostic.compute`, name the class in YAML under ``trainer.callbacks``::

    class BoxedAnswerRate(Diagnostic):
        def compute(self, trainer, pl_module, diagnostics):
            boxed = torch.tensor([float("\\\\boxed" in t) for t in diagnostics["texts"]])
            return {"train/boxed_rate": weighted_mean(boxed, trainer=trainer)}

The base logs the returned dict every step through ``pl_module.log_dict`` (so CSV, TensorBoard and
W&B all receive it, at the trainer's ``log_every_n_steps``).

Under DDP/FSDP every rank holds a different slice of the rollout batch, so a metric must be
reduced across ranks *before* it is logged: means weighted by their token or response counts
(never a mean of per-rank means), maxima as maxima. The helpers below do that with one collective
per call; with ``trainer=None`` or a single process they reduce locally. Every rank must call the
same helpers in the same order (they are collectives): never branch on rank-local data before a
reduction. Side effects (figures, files, warnings) belong on rank 0 only (``trainer.is_global_zero``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

Number = Union[float, int, Tensor]


def _device(trainer: Optional[pl.Trainer]) -> torch.device:
    return trainer.strategy.root_device if trainer is not None else torch.device("cpu")


def _as_tensor(x: Any, device: torch.device) -> Tensor:
    # float64 so token counts and sums of millions of tokens stay exact (MPS has no float64)
    dtype = torch.float32 if device.type == "mps" else torch.float64
    if isinstance(x, Tensor):
        return x.detach().to(device=device, dtype=dtype)
    return torch.as_tensor(x, dtype=dtype, device=device)


def _distributed(trainer: Optional[pl.Trainer]) -> bool:
    return trainer is not None and trainer.world_size > 1


def global_sum(values: Any, *, trainer: Optional[pl.Trainer] = None) -> Tensor:
    """Element-wise sum of ``values`` over all ranks (one all-reduce)."""
    t = _as_tensor(values, _device(trainer)).clone()  # reduce is in place
    if _distributed(trainer):
        t = trainer.strategy.reduce(t, reduce_op="sum")
    return t


def weighted_means(
    pairs: Mapping[str, tuple[Any, Any]], *, trainer: Optional[pl.Trainer] = None
) -> dict[str, Tensor]:
    """``{name: Σ_ranks Σ w·v / Σ_ranks Σ w}`` for ``{name: (values, weights)}``, one all-reduce.

    ``weights=None`` weighs every element 1 (a per-response mean when ``values`` is ``[N]``).
    A name whose total weight is 0 on every rank comes back NaN (undefined, not 0).
    """
    device = _device(trainer)
    sums = []
    for values, weights in pairs.values():
        v = _as_tensor(values, device).reshape(-1)
        w = torch.ones_like(v) if weights is None else _as_tensor(weights, device).reshape(-1)
        v = torch.where(w != 0, v, 0.0)  # a NaN stat of an empty slice (weight 0) must not poison the sum
        sums.append(torch.stack([(v * w).sum(), w.sum()]))
    if not sums:
        return {}
    total = global_sum(torch.stack(sums), trainer=trainer)
    means = torch.where(total[:, 1] > 0, total[:, 0] / total[:, 1].clamp_min(1e-300), torch.nan)
    return dict(zip(pairs.keys(), means.unbind()))


def weighted_mean(values: Any, weights: Any = None, *, trainer: Optional[pl.Trainer] = None) -> Tensor:
    """Σ w·v / Σ w over all elements on all ranks (see :func:`weighted_means`)."""
    return weighted_means({"x": (values, weights)}, trainer=trainer)["x"]


def global_maxes(values: Mapping[str, Any], *, trainer: Optional[pl.Trainer] = None) -> dict[str, Tensor]:
    """``{name: max over all elements on all ranks}``, one all-gather; NaN where all are empty."""
    device = _device(trainer)
    local = []
    for x in values.values():
        t = _as_tensor(x, device).reshape(-1)
        local.append(t.max() if t.numel() else torch.tensor(-torch.inf, dtype=t.dtype, device=device))
    if not local:
        return {}
    stacked = torch.stack(local)
    if _distributed(trainer):
        stacked = trainer.strategy.all_gather(stacked).reshape(-1, len(local)).amax(0)
    stacked = torch.where(torch.isinf(stacked) & (stacked < 0), torch.nan, stacked)
    return dict(zip(values.keys(), stacked.unbind()))


def global_max(values: Any, *, trainer: Optional[pl.Trainer] = None) -> Tensor:
    """Max over all elements on all ranks (NaN if every rank is empty)."""
    return global_maxes({"x": values}, trainer=trainer)["x"]


def resolve_log_dir(trainer: pl.Trainer) -> str:
    """The run's log folder. ``trainer.log_dir`` is a collective: call this on every rank."""
    return trainer.log_dir or trainer.default_root_dir


class Diagnostic(Callback):
    """Base class of a step diagnostic: implement :meth:`compute`, the base logs its result.

    Args:
        prog_bar: metric names (of those ``compute`` returns) also shown in the progress bar.
    """

    def __init__(self, prog_bar: tuple[str, ...] = ()) -> None:
        self.prog_bar = tuple(prog_bar)

    def compute(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                diagnostics: Mapping[str, Any]) -> dict[str, Number]:
        """Return ``{metric name: scalar}`` for this step, reduced across ranks (use the helpers)."""
        raise NotImplementedError

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if not isinstance(outputs, Mapping):  # a step that returned nothing has nothing to show
            return
        metrics = self.compute(trainer, pl_module, outputs)
        if metrics:
            self.log_metrics(pl_module, metrics)

    def log_metrics(self, pl_module: pl.LightningModule, metrics: Mapping[str, Number]) -> None:
        """Log already-reduced scalars (so ``sync_dist=False``: a second mean would be wrong)."""
        shown = {k: v for k, v in metrics.items() if k in self.prog_bar}
        hidden = {k: v for k, v in metrics.items() if k not in self.prog_bar}
        for group, prog_bar in ((hidden, False), (shown, True)):
            if group:
                pl_module.log_dict({k: _scalar(v) for k, v in group.items()}, on_step=True,
                                   on_epoch=False, prog_bar=prog_bar, sync_dist=False, batch_size=1)


def _scalar(v: Number) -> Union[float, Tensor]:
    return v.detach().float().reshape(()) if isinstance(v, Tensor) else float(v)
