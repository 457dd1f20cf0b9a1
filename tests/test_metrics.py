"""pass@k / avg@K: brute force, stability, torchmetrics classes, 2-process gloo reduction, and the
metrics ASPOModule logs in validation."""

from __future__ import annotations

import itertools
import math
import socket
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from aspo_lit.metrics import AvgAtK, PassAtK, avg_at_k, pass_at_k
from tests.tolerance import approx64, gamma, reduction_tol, rounding_tol


def _brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Fraction of the k-subsets of n samples (c correct) that contain a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(_brute_pass_at_k(n, c, k)), rel=0, abs=pass_at_k_atol(n)), (n, c, k)


def pass_at_k_atol(n: int) -> float:
    """1 - Π_i (1 - k/i) in float64: <= n factors of 2 roundings each, n - 1 products, the subtraction,
    all of values <= 1 (and the exact Fraction's own rounding): γ_{3n+1} absolute."""
    return gamma(3 * n + 1, torch.float64)


def test_pass_at_k_edge_cases():
    assert pass_at_k(64, 0, 64) == 0.0
    assert pass_at_k(64, 1, 64) == 1.0  # k = n: any correct
    assert pass_at_k(4, 2, 1) == pytest.approx(0.5, rel=0, abs=pass_at_k_atol(4))  # k = 1: the mean
    for bad in [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


@pytest.mark.parametrize("c", [0, 1, 2, 17, 512, 1000, 1023, 1024])
@pytest.mark.parametrize("k", [1, 2, 8, 64, 512, 1024])
def test_pass_at_k_stable_at_n_1024(c, k):
    n = 1024
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    got = pass_at_k(n, c, k)
    assert math.isfinite(got) and 0.0 <= got <= 1.0
    assert got == pytest.approx(float(exact), rel=0, abs=pass_at_k_atol(n))


def test_avg_at_k():
    assert avg_at_k(8, 3) == 3 / 8
    assert avg_at_k(1, 0) == 0.0
    with pytest.raises(ValueError):
        avg_at_k(4, 5)


def _correct_matrix(seed: int = 0, problems: int = 12, n: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(problems, n, generator=g) < torch.rand(problems, 1, generator=g)


def test_metric_classes_match_functions():
    correct = _correct_matrix()
    counts = correct.sum(1).tolist()
    n = correct.shape[1]
    avg, p1, p4 = AvgAtK(), PassAtK(1), PassAtK(4)
    for m in (avg, p1, p4):
        m.update(correct[:5])  # bool [P, n] ...
        m.update(correct.sum(1)[5:], n)  # ... or counts, in several updates
    # float64 states: means of 12 scores in [0, 1], summed in another order
    assert avg.compute().item() == approx64(sum(c / n for c in counts) / len(counts))
    assert p1.compute().item() == approx64(avg.compute().item())  # pass@1 == avg@n
    assert p4.compute().item() == approx64(sum(pass_at_k(n, c, 4) for c in counts) / len(counts))


def test_metric_classes_counts_and_errors():
    m = PassAtK(2)
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert math.isnan(m.compute().item())  # nothing seen yet
    m.update(torch.tensor([0, 1, 4]), torch.tensor([4, 4, 4]))
    assert m.compute().item() == approx64((0 + 0.5 + 1) / 3)
    m.reset()
    m.update(torch.ones(2, 2, dtype=torch.bool))
    assert m.compute().item() == 1.0
    with pytest.raises(ValueError):
        PassAtK(8).update(torch.ones(2, 4, dtype=torch.bool))  # fewer samples than k
    with pytest.raises(ValueError):
        AvgAtK().update(torch.tensor([1, 2]), torch.tensor([4, 4, 4]))
    with pytest.raises(ValueError):
        PassAtK(0)


# --------------------------------------------------------------------------- distributed


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _expected(correct: torch.Tensor) -> dict[str, float]:
    metrics = {"avg": AvgAtK(), "pass@1": PassAtK(1), "pass@4": PassAtK(4), "pass@8": PassAtK(8)}
    for m in metrics.values():
        m.update(correct)
    return {name: m.compute().item() for name, m in metrics.items()}


def _rank_main(rank: int, world_size: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        correct = _correct_matrix()
        metrics = {"avg": AvgAtK(), "pass@1": PassAtK(1), "pass@4": PassAtK(4), "pass@8": PassAtK(8)}
        for m in metrics.values():
            if rank == 0:  # rows 0-4 as a bool matrix
                m.update(correct[:5])
            else:  # rows 5-11 as counts, in two updates
                m.update(correct[5:8].sum(1), correct.shape[1])
                m.update(correct[8:].sum(1), torch.full((4,), correct.shape[1]))
        queue.put((rank, {name: m.compute().item() for name, m in metrics.items()}))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_distributed_reduction_two_processes():
    """Each rank updates different problems; compute() on both equals the single-process value."""
    world_size = 2
    expected = _expected(_correct_matrix())
    queue = tmp.get_context("spawn").SimpleQueue()
    tmp.start_processes(_rank_main, args=(world_size, _free_port(), queue), nprocs=world_size,
                        join=True, start_method="spawn")
    results = dict(queue.get() for _ in range(world_size))
    for rank in range(world_size):
        for name, value in expected.items():
            # float64 sums of 12 scores <= 1 in other orders (split over ranks), then / 12
            assert results[rank][name] == pytest.approx(value, rel=0, abs=reduction_tol(torch.float64, 13, 1.0)), (rank, name)


# --------------------------------------------------------------------------- in ASPOModule validation
def test_module_validation_logs_metrics_over_all_problems_per_run(tiny_model_dir):
    """`ASPOModule.validation_step` logs avg@K / pass@K over every problem of the run (batches of
    unequal sizes), and a second run starts from zero."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from aspo_lit.module import ASPOModule

    module = ASPOModule(model_name_or_path=str(tiny_model_dir), kl_coef=0.0)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    correct = _correct_matrix(problems=12, n=4)
    for batches in (correct[:9].split([2, 7]), [correct[9:]]):
        loader = DataLoader([{"correct": b} for b in batches], batch_size=None)
        logged = trainer.validate(module, loader, verbose=False)[0]
        counts = torch.cat(batches).sum(1).tolist()
        # the float64 metric (a mean of <= 12 scores: a few float64 roundings) as Lightning logs it, in fp32: one rounding
        rel = rounding_tol(torch.float32, 1) + rounding_tol(torch.float64, 40)
        assert logged["val/avg@4"] == pytest.approx(sum(counts) / (4 * len(counts)), rel=rel, abs=0)
        assert logged["val/pass@4"] == pytest.approx(sum(c > 0 for c in counts) / len(counts), rel=rel, abs=0)
