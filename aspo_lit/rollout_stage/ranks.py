"""The ranks a rollout controller runs on: who it is, how many there are, and the two collectives it
needs (is anyone failing; everyone's groups), behind one small object so that the controller runs
and is tested without a Trainer."""

from __future__ import annotations

from typing import Any


class RankContext:
    """One process alone: rank 0 of 1, no collective, optimizer step 0 (a benchmark, a test, an
    offline evaluation). `TrainerRanks` reads the same from a Lightning Trainer."""

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    def step(self) -> int:
        """The optimizer steps taken so far (a weight push is due when it changes)."""
        return 0

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any."""
        return flag

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        return [obj]


class TrainerRanks(RankContext):
    """The ranks of a Lightning Trainer's strategy, read when asked (the Trainer sets them up after
    the DataModule is built)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    @property
    def world_size(self) -> int:
        return self.trainer.world_size

    @property
    def rank(self) -> int:
        return self.trainer.global_rank

    def step(self) -> int:
        return self.trainer.global_step

    def any(self, flag: bool) -> bool:
        if self.world_size == 1:
            return flag
        return bool(self.trainer.strategy.reduce_boolean_decision(flag, all=False))

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered
