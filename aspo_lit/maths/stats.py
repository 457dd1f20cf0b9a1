"""A statistic that says how to combine it: its value, its weight and its reduction.

A training step's scalars are made in pieces -- one per micro-batch, per optimizer step, per
rank -- and the logged value combines the pieces. How depends on what the number is a mean, a
sum or a maximum of, which only the code that makes it knows; so it says so where it makes it
(docs/design.md, "Step diagnostics"), never the name it is logged under:

    Stat.mean_over(clipped, where=positive_tokens)   # a share of the A > 0 tokens, weighed by their count
    Stat.mean(loss)                                  # one optimizer step's loss, weight 1
    Stat.sum(filtered_groups)                        # a count
    Stat.max(seconds)                                # the slowest rank sets the pace

:func:`combine` merges the pieces of one statistic by their declared reduction, and the same rule
holds over micro-batches, optimizer steps and ranks, so the result does not depend on how the
work was split:

* ``mean``: ``Σ w·v / Σ w`` over the pieces of weight > 0 (a piece of weight 0 -- an empty
  slice -- is left out, so a NaN it carries does not spread); NaN when every weight is 0;
* ``sum``: ``Σ v``;
* ``max``: ``max v``; a piece with nothing in it is ``-inf`` (NaN once logged, if every piece is).

Values and weights may be 0-dim tensors (no device synchronisation until a value is read) or
Python numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Union

import torch
from torch import Tensor

__all__ = ["REDUCTIONS", "Stat", "combine", "StatAccumulator"]

REDUCTIONS = ("mean", "sum", "max")
Number = Union[float, int, Tensor]


@dataclass(frozen=True)
class Stat:
    """One piece of a statistic: ``value``, its ``weight`` (used by ``mean`` only) and ``reduce``."""

    value: Number
    weight: Number = 1.0
    reduce: str = "mean"

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"Stat.reduce must be one of {', '.join(REDUCTIONS)}, got {self.reduce!r}")
        for name in ("value", "weight"):
            x = getattr(self, name)
            if isinstance(x, Tensor) and x.numel() != 1:
                raise ValueError(f"Stat.{name} must be one number, got a tensor of shape {tuple(x.shape)}")
            if not isinstance(x, (Tensor, int, float)):
                raise ValueError(f"Stat.{name} must be a number or a 0-dim tensor, got {type(x).__name__}")

    # -- constructors: the reduction is named where the statistic is made ------------------------

    @classmethod
    def mean(cls, value: Number, weight: Number = 1.0) -> "Stat":
        """A mean over ``weight`` units (tokens, responses, optimizer steps)."""
        return cls(value, weight, "mean")

    @classmethod
    def mean_over(cls, values: Tensor, where: Tensor) -> "Stat":
        """The mean of ``values`` over the elements where ``where`` is true, weighed by their count
        (0 with weight 0 when there are none). A bool ``values`` gives the share that is true."""
        where = where.bool()
        count = torch.count_nonzero(where).to(torch.float32)
        total = torch.where(where, values.detach().float(), 0.0).sum()
        return cls(total / count.clamp_min(1), count, "mean")

    @classmethod
    def sum(cls, value: Number) -> "Stat":
        return cls(value, 1.0, "sum")

    @classmethod
    def max(cls, value: Number) -> "Stat":
        return cls(value, 1.0, "max")

    @classmethod
    def empty(cls, reduce: str) -> "Stat":
        """A statistic of nothing: it leaves any other piece unchanged when combined."""
        return cls({"mean": float("nan"), "sum": 0.0, "max": float("-inf")}[reduce], 0.0, reduce)

    def __float__(self) -> float:
        return float(self.value)


def _as_tensor(x: Number, device: torch.device) -> Tensor:
    dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    return torch.as_tensor(x.detach() if isinstance(x, Tensor) else x, dtype=dtype, device=device).reshape(())


def combine(pieces: Iterable[Stat], reduce: str | None = None) -> Stat:
    """The pieces of one statistic merged by their (common) reduction (module docstring).

    ``reduce`` names the reduction when ``pieces`` may be empty (the result is then
    :meth:`Stat.empty`); pieces with another reduction are an error.
    """
    pieces = list(pieces)
    kinds = {p.reduce for p in pieces} | ({reduce} if reduce else set())
    if len(kinds) > 1:
        raise ValueError(f"cannot combine pieces of one statistic with different reductions: {sorted(kinds)}")
    if not pieces:
        if reduce is None:
            raise ValueError("combine() of no pieces needs reduce=")
        return Stat.empty(reduce)
    kind = kinds.pop()
    device = next((p.value.device for p in pieces if isinstance(p.value, Tensor)), torch.device("cpu"))
    values = torch.stack([_as_tensor(p.value, device) for p in pieces])
    weights = torch.stack([_as_tensor(p.weight, device) for p in pieces])
    if kind == "sum":
        return Stat(values.sum(), weights.sum(), "sum")
    if kind == "max":
        return Stat(values.max(), weights.sum(), "max")
    kept = weights > 0
    total = torch.where(kept, weights, 0.0).sum()
    weighted = torch.where(kept, values * weights, 0.0).sum()
    mean = torch.where(total > 0, weighted / total.clamp_min(torch.finfo(total.dtype).tiny), float("nan"))
    return Stat(mean, total, "mean")


class StatAccumulator:
    """Pieces of named statistics, gathered over a step and merged by :meth:`result`.

    ``expected`` (name -> reduction) fixes the names up front: every one is in the result, a piece
    or not (an empty statistic then), and a piece of any other name is an error. That is what
    keeps the names identical on every rank, which the cross-rank reductions need.
    """

    def __init__(self, expected: Mapping[str, str] | None = None) -> None:
        self.expected = dict(expected) if expected is not None else None
        self.pieces: dict[str, list[Stat]] = {name: [] for name in (self.expected or {})}

    def add(self, name: str, piece: Stat) -> None:
        if not isinstance(piece, Stat):
            raise TypeError(f"statistic {name!r} must be a Stat, got {type(piece).__name__}")
        if self.expected is not None and name not in self.expected:
            raise ValueError(f"statistic {name!r} was not declared up front (declared: {sorted(self.expected)}); "
                             "a loss must return the same statistic names for every input")
        self.pieces.setdefault(name, []).append(piece)

    def add_all(self, stats: Mapping[str, Stat]) -> None:
        for name, piece in stats.items():
            self.add(name, piece)

    def result(self) -> dict[str, Stat]:
        expected = self.expected or {}
        return {name: combine(pieces, expected.get(name)) for name, pieces in self.pieces.items()}
