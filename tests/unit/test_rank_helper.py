"""`tests.helpers.ranks`: a rank's result comes back, and a rank that raises fails the call (its
clean exit, `leave_group`, is taken only after the work succeeded)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from tests.helpers.ranks import on_ranks


def _sum_of_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def _rank_one_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")


@pytest.mark.multiproc
def test_results_come_back_and_a_raising_rank_fails_the_call():
    assert on_ranks(_sum_of_ranks) == {0: 3.0, 1: 3.0}
    with pytest.raises(ProcessRaisedException, match="rank 1 failed on purpose"):
        on_ranks(_rank_one_raises)
