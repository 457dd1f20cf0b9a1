"""Torch threads per rank (aspo_lit.training.threads): the host's cores divided among its ranks, a user's
OMP_NUM_THREADS kept, and FSDP2Strategy applying it (its 2-rank fits: tests/integration/test_sharded.py)."""

from __future__ import annotations

import os

import pytest
import torch

from aspo_lit.training.threads import set_threads_per_rank, threads_per_rank, usable_cores, user_thread_settings


@pytest.mark.parametrize(("cores", "ranks", "threads"), [(16, 2, 8), (16, 8, 2), (17, 2, 8), (4, 8, 1), (1, 1, 1), (8, 1, 8)])
def test_threads_divide_the_cores(cores, ranks, threads):
    assert threads_per_rank(cores, ranks, {}) == threads


@pytest.mark.parametrize("env", [{"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "12"}, {"MKL_NUM_THREADS": "3"}])
def test_a_user_thread_count_is_kept(env):
    assert threads_per_rank(16, 2, env) is None


def test_an_empty_setting_is_no_setting():
    assert threads_per_rank(16, 2, {"OMP_NUM_THREADS": "", "OTHER": "4"}) == 8


def test_no_ranks_is_refused():
    with pytest.raises(ValueError, match="local_world_size"):
        threads_per_rank(16, 0, {})


def test_usable_cores_are_at_most_the_cpus_of_this_process():
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= usable_cores() <= cpus


@pytest.fixture
def restore_threads(monkeypatch):
    """torch's thread count and OMP_NUM_THREADS as they were, after the test; neither variable set during it."""
    threads = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, "0")  # recorded, so the original value (or its absence) comes back
        monkeypatch.delenv(name)
    yield
    torch.set_num_threads(threads)


def test_fsdp2_strategy_sets_its_share_of_the_cores(restore_threads, monkeypatch):
    """Four ranks on an 8-core host: each rank's torch runs 2 threads, and the processes it starts
    inherit 2, whatever Lightning's launcher set in the rank after the strategy was made."""
    from aspo_lit.training.strategy import FSDP2Strategy

    monkeypatch.setattr("aspo_lit.training.threads.usable_cores", lambda: 8)
    strategy = FSDP2Strategy(param_dtype=None)
    strategy.parallel_devices = [torch.device("cpu")] * 4
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as Lightning's launcher sets it (logical CPUs / ranks) before setup
    torch.set_num_threads(1)
    strategy.set_threads()
    assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"


def test_fsdp2_strategy_keeps_the_users_setting(restore_threads, monkeypatch):
    """OMP_NUM_THREADS set before the strategy is made (a launcher sets it later, in each rank): kept."""
    from aspo_lit.training.strategy import FSDP2Strategy

    monkeypatch.setattr("aspo_lit.training.threads.usable_cores", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    strategy = FSDP2Strategy(param_dtype=None)
    strategy.parallel_devices = [torch.device("cpu")] * 4
    torch.set_num_threads(3)
    strategy.set_threads()
    assert torch.get_num_threads() == 3 and os.environ["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS=3 set" in set_threads_per_rank(4, user_thread_settings())


def test_the_count_set_by_an_earlier_fit_is_not_the_users(restore_threads):
    """A second fit in the same process sees OMP_NUM_THREADS as the first one set it: not a user's setting."""
    set_threads_per_rank(2, {}, cores=4)
    assert os.environ["OMP_NUM_THREADS"] == "2" and user_thread_settings() == {}
    os.environ["OMP_NUM_THREADS"] = "3"  # changed since: a user's
    assert user_thread_settings() == {"OMP_NUM_THREADS": "3"}
