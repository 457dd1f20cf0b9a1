"""`tests.helpers.ranks`: a rank's result comes back, and a rank that raises fails the call with its
own traceback, whichever process dies first (its clean exit, `leave_group`, is taken only after the
work succeeded)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.ranks import RankFailed, on_ranks


def _sum_of_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def _rank_one_raises_late(rank: int, world: int) -> None:
    """Rank 1 leaves the group first, so rank 0's barrier fails on a reset connection before rank 1
    raises: the error seen first is not the cause."""
    if rank == 1:
        dist.destroy_process_group()
        time.sleep(2.0)
        raise RuntimeError("rank 1 failed on purpose")


def _rank_zero_dies(rank: int, world: int) -> None:
    if rank == 0:
        os._exit(3)    # no traceback, no result: only the exit code tells


@pytest.mark.multiproc
def test_results_come_back_and_the_raising_ranks_traceback_fails_the_call():
    assert on_ranks(_sum_of_ranks) == {0: 3.0, 1: 3.0}
    with pytest.raises(RankFailed, match=r"(?s)rank 1 raised:.*rank 1 failed on purpose"):
        on_ranks(_rank_one_raises_late)


@pytest.mark.multiproc
def test_a_rank_that_dies_without_raising_fails_the_call():
    with pytest.raises(RankFailed, match=r"exited abnormally.*0: 3"):
        on_ranks(_rank_zero_dies, timeout_s=120)
