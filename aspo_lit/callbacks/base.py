"""The extension base for step diagnostics, and rank-correct reductions.

A diagnostic is a Lightning callback that reads the `~aspo_lit.maths.step.StepOutput`
``ASPOModule.training_step`` returns (``docs/design.md`` "Step diagnostics") and turns it into
scalars. Subclass :class:`Diagnostic`, implement :meth:`Diagnostic.compute`, and append the class
to the run's callbacks (``trainer: {callbacks+: [mypkg.MyDiagnostic]}`` in an extra ``--config``)::

    class BoxedAnswerRate(Diagnostic):
        def compute(self, trainer, pl_module, step):
            boxed = torch.tensor([float("\\\\boxed" in t) for t in step.texts])
            return {"train/boxed_rate": weighted_mean(boxed, trainer=trainer)}

The base logs the returned dict every step through ``pl_module.log_dict`` (so CSV, TensorBoard and
W&B all receive it, at the trainer's ``log_every_n_steps``).

Under DDP/FSDP every rank holds a different slice of the rollout batch, so a metric must be
reduced across ranks *before* it is logged: means weighted by their token or response counts
(never a mean of per-rank means), maxima as maxima. The helpers below do that with one torchmetrics
``Metric`` per call (:class:`RankReduction`: the call's values as one vector state, synced over the
process group on ``compute``, a single collective); with ``trainer=None`` or a single process they
reduce locally. Statistics no sum reduces exactly (quantiles, ranks) gather the tokens instead
(:func:`global_cat`) and are computed on the whole batch on every rank. A NaN stays NaN (a rank's
NaN statistic makes the global value NaN). Every rank must call the same helpers in the same order
(they are collectives): never branch on rank-local data before a reduction. Side effects
(figures, files, warnings) belong on rank 0 only (``trainer.is_global_zero``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from aspo_lit.maths.stats import Stat
from aspo_lit.maths.step import StepOutput

Number = Union[float, int, Tensor]


def _as_tensor(x: Any, trainer: Optional[pl.Trainer]) -> Tensor:
    """``x`` on the trainer's device in float64, which keeps sums over millions of tokens exact
    (float32 on MPS, which has no float64)."""
    device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
    dtype = torch.float32 if device.type == "mps" else torch.float64
    return torch.as_tensor(x.detach() if isinstance(x, Tensor) else x, dtype=dtype, device=device)


class RankReduction(Metric):
    """One vector reduced element-wise over all ranks by ``reduce_fx`` (``"sum"`` or ``"max"``):
    torchmetrics syncs its one state with a single collective on ``compute``."""

    full_state_update = False

    def __init__(self, like: Tensor, reduce_fx: str, sync: bool) -> None:
        super().__init__(sync_on_compute=sync)
        self.add_state("value", default=torch.zeros_like(like), dist_reduce_fx=reduce_fx)

    def update(self, value: Tensor) -> None:
        self.value = value

    def compute(self) -> Tensor:
        return self.value


def _reduce(local: Tensor, reduce_fx: str, trainer: Optional[pl.Trainer]) -> Tensor:
    """``local`` (a vector) reduced element-wise over all ranks; a NaN stays NaN."""
    metric = RankReduction(local, reduce_fx, sync=trainer is not None and trainer.world_size > 1).to(local.device)
    metric.update(local)
    return metric.compute()


class RankGather(Metric):
    """Rows concatenated over all ranks, in rank order (``dist_reduce_fx="cat"``: torchmetrics pads
    the ranks' different row counts, gathers once and trims)."""

    full_state_update = False

    def __init__(self, sync: bool) -> None:
        super().__init__(sync_on_compute=sync)
        self.add_state("rows", default=[], dist_reduce_fx="cat")

    def update(self, rows: Tensor) -> None:
        self.rows.append(rows)

    def compute(self) -> Tensor:
        return dim_zero_cat(self.rows)


def global_cat(rows: Tensor, *, trainer: Optional[pl.Trainer] = None) -> Tensor:
    """Every rank's ``rows`` (``[n_rank, k]``, any ``n_rank`` including 0) stacked in rank order,
    on every rank (one gather). For statistics no sum reduces exactly (quantiles, ranks): each rank
    then computes them on the whole batch, as one process would."""
    if rows.dim() != 2:
        raise ValueError(f"global_cat takes [n, k] rows, got shape {tuple(rows.shape)}")
    device = trainer.strategy.root_device if trainer is not None else rows.device
    metric = RankGather(sync=trainer is not None and trainer.world_size > 1).to(device)
    metric.update(rows.detach().to(device))
    return metric.compute().reshape(-1, rows.shape[1])


def global_sum(values: Any, *, trainer: Optional[pl.Trainer] = None) -> Tensor:
    """Element-wise sum of ``values`` over all ranks (one collective)."""
    t = _as_tensor(values, trainer)
    return _reduce(t.reshape(-1), "sum", trainer).reshape(t.shape)


def weighted_means(
    pairs: Mapping[str, tuple[Any, Any]], *, trainer: Optional[pl.Trainer] = None
) -> dict[str, Tensor]:
    """``{name: Σ_ranks Σ w·v / Σ_ranks Σ w}`` for ``{name: (values, weights)}``, one collective.

    ``weights=None`` weighs every element 1 (a per-response mean when ``values`` is ``[N]``).
    Elements of weight 0 are left out (a NaN stat of an empty slice does not poison the mean); a
    name whose total weight is 0 on every rank comes back NaN (undefined, not 0).
    """
    if not pairs:
        return {}
    sums = []
    for values, weights in pairs.values():
        v = _as_tensor(values, trainer).reshape(-1)
        w = torch.ones_like(v) if weights is None else _as_tensor(weights, trainer).reshape(-1)
        v, w = torch.broadcast_tensors(v, w)
        kept = w != 0
        sums.append(torch.stack([(v[kept] * w[kept]).sum(), w[kept].sum()]))
    total = _reduce(torch.cat(sums), "sum", trainer).reshape(-1, 2)
    means = torch.where(total[:, 1] > 0, total[:, 0] / total[:, 1], torch.nan)
    return dict(zip(pairs.keys(), means.unbind()))


def weighted_mean(values: Any, weights: Any = None, *, trainer: Optional[pl.Trainer] = None) -> Tensor:
    """Σ w·v / Σ w over all elements on all ranks (see :func:`weighted_means`)."""
    return weighted_means({"x": (values, weights)}, trainer=trainer)["x"]


def global_maxes(values: Mapping[str, Any], *, trainer: Optional[pl.Trainer] = None) -> dict[str, Tensor]:
    """``{name: max over all elements on all ranks}``, one collective; NaN where all are empty."""
    if not values:
        return {}
    local = []
    for x in values.values():
        t = _as_tensor(x, trainer).reshape(-1)
        local.append(t.max() if t.numel() else torch.tensor(-torch.inf, dtype=t.dtype, device=t.device))
    maxes = _reduce(torch.stack(local), "max", trainer)
    return dict(zip(values.keys(), torch.where(torch.isneginf(maxes), torch.nan, maxes).unbind()))


def global_max(values: Any, *, trainer: Optional[pl.Trainer] = None) -> Tensor:
    """Max over all elements on all ranks (NaN if every rank is empty)."""
    return global_maxes({"x": values}, trainer=trainer)["x"]


def reduce_stats(stats: Mapping[str, Stat], *, trainer: Optional[pl.Trainer] = None) -> dict[str, Tensor]:
    """Every statistic reduced over all ranks by the reduction it declares (`aspo_lit.maths.stats`):
    means weighted by their weights, sums, maxima; three collectives at most. Every rank must pass
    the same names (a `StepOutput`'s ``stats`` are, by construction)."""
    by_kind: dict[str, dict[str, Stat]] = {"mean": {}, "sum": {}, "max": {}}
    for name, stat in sorted(stats.items()):
        by_kind[stat.reduce][name] = stat
    out = weighted_means({k: (s.value, s.weight) for k, s in by_kind["mean"].items()}, trainer=trainer)
    if by_kind["sum"]:
        sums = global_sum([float(s.value) for s in by_kind["sum"].values()], trainer=trainer)
        out.update(zip(by_kind["sum"], sums.unbind()))
    out.update(global_maxes({k: s.value for k, s in by_kind["max"].items()}, trainer=trainer))
    return out


def resolve_log_dir(trainer: pl.Trainer) -> str:
    """The run's log folder: ``trainer.log_dir`` (CSV and TensorBoard loggers), else
    ``<save_dir>/<name>/<version>`` of a logger that has no folder of its own (W&B: project, run
    id), so that every run writes its figures and ``health.json`` apart. A collective: call this on
    every rank."""
    logger = trainer.logger
    if logger is not None and getattr(logger, "log_dir", None) is None and logger.save_dir:
        path = str(Path(logger.save_dir) / str(logger.name) / str(logger.version)) if trainer.is_global_zero else None
        return trainer.strategy.broadcast(path)
    return trainer.log_dir or trainer.default_root_dir


class Diagnostic(Callback):
    """Base class of a step diagnostic: implement :meth:`compute`, the base logs its result.

    Args:
        prog_bar: metric names (of those ``compute`` returns) also shown in the progress bar.
    """

    def __init__(self, prog_bar: tuple[str, ...] = ()) -> None:
        self.prog_bar = tuple(prog_bar)

    def compute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: StepOutput) -> dict[str, Number]:
        """Return ``{metric name: scalar}`` for this step, reduced across ranks (use the helpers)."""
        raise NotImplementedError

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = self.compute(trainer, pl_module, step_output(outputs))
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


def step_output(outputs: Any) -> StepOutput:
    """``outputs`` of ``on_train_batch_end`` as the `StepOutput` it is; a clear error otherwise."""
    if not isinstance(outputs, StepOutput):
        raise TypeError(f"a step diagnostic reads the StepOutput ASPOModule.training_step returns "
                        f"(aspo_lit.maths.step), got {type(outputs).__name__}")
    return outputs


def _scalar(v: Number) -> Union[float, Tensor]:
    return v.detach().float().reshape(()) if isinstance(v, Tensor) else float(v)
