"""pass@k / avg@K: brute force, stability, torchmetrics classes, 2-process gloo reduction, and the
metrics ASPOModule logs in validation."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from aspo_lit.maths.metrics import (
    AvgAtK,
    PassAtK,
    avg_at_k,
    avg_at_k_se,
    mean_se,
    pass_at_k,
    pass_at_k_se,
    samples_for_halfwidth,
)
from tests.helpers.ranks import on_ranks
from tests.helpers.tolerance import approx64, gamma, reduction_tol, rounding_tol


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


def _expected(correct: torch.Tensor) -> dict[str, float]:
    metrics = {"avg": AvgAtK(), "pass@1": PassAtK(1), "pass@4": PassAtK(4), "pass@8": PassAtK(8)}
    for m in metrics.values():
        m.update(correct)
    return {name: m.compute().item() for name, m in metrics.items()}


def _rank_metrics(rank: int, world_size: int) -> dict[str, float]:
    correct = _correct_matrix()
    metrics = {"avg": AvgAtK(), "pass@1": PassAtK(1), "pass@4": PassAtK(4), "pass@8": PassAtK(8)}
    for m in metrics.values():
        if rank == 0:  # rows 0-4 as a bool matrix
            m.update(correct[:5])
        else:  # rows 5-11 as counts, in two updates
            m.update(correct[5:8].sum(1), correct.shape[1])
            m.update(correct[8:].sum(1), torch.full((4,), correct.shape[1]))
    return {name: m.compute().item() for name, m in metrics.items()}


@pytest.mark.multiproc
def test_distributed_reduction_two_processes():
    """Each rank updates different problems; compute() on both equals the single-process value."""
    world_size = 2
    expected = _expected(_correct_matrix())
    results = on_ranks(_rank_metrics, world_size)
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

    from aspo_lit.training.module import ASPOModule

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


# --------------------------------------------------------------------------- standard errors
# Exact expectations by enumerating every outcome of a few problems' K samples (the estimators'
# derivations: aspo_lit/maths/metrics.py), then Monte-Carlo checks at a realistic size within bounds
# derived from the simulation's own spread.


def _binomial(k: int, p: float) -> list[tuple[float, int]]:
    """[(probability, c)] of c ~ Binomial(k, p)."""
    return [(math.comb(k, c) * p ** c * (1 - p) ** (k - c), c) for c in range(k + 1)]


def _mixture(k: int, population: list[tuple[float, float]]) -> list[tuple[float, int]]:
    """[(probability, c)] of one problem drawn from ``population`` [(weight, p)], then k samples."""
    dist = [0.0] * (k + 1)
    for weight, p in population:
        for prob, c in _binomial(k, p):
            dist[c] += weight * prob
    return [(prob, c) for c, prob in enumerate(dist)]


def _expectations(per_problem: list[list[tuple[float, int]]], k: int, metric) -> tuple[float, float, float, float]:
    """(Var of the metric's value, E[se²], E[se_problems²], E[value]) over every outcome."""
    mean = second = se2 = sep2 = 0.0
    for outcome in itertools.product(*per_problem):
        prob = math.prod(p for p, _ in outcome)
        got = metric([c for _, c in outcome], k)
        mean += prob * got.value
        second += prob * got.value ** 2
        se2 += prob * got.se ** 2
        sep2 += prob * got.se_problems ** 2
    return second - mean ** 2, se2, sep2, mean


def _u_bound(p: float, k: int) -> float:
    """K p (1 - p)^(K-1) >= q(1 - q): pass@K's per-problem variance bound (aspo_lit/maths/metrics.py)."""
    return k * p * (1 - p) ** (k - 1)


@pytest.mark.parametrize("ps, k", [((0.1, 0.5, 0.85), 3), ((0.02, 0.97), 4), ((0.3, 0.3, 0.6, 0.0), 2)])
def test_avg_at_k_se_is_unbiased_with_the_problems_fixed(ps, k):
    var, se2, sep2, mean = _expectations([_binomial(k, p) for p in ps], k, avg_at_k_se)
    # the closed form of Var(A), the sum the estimator targets, and the enumeration agree
    assert var == approx64(sum(p * (1 - p) for p in ps) / (k * len(ps) ** 2), scale=1.0)
    assert se2 == approx64(var, scale=1.0)
    assert mean == approx64(sum(ps) / len(ps))
    spread = sum((p - sum(ps) / len(ps)) ** 2 for p in ps) / (len(ps) - 1)
    assert sep2 == approx64(var + spread / len(ps), scale=1.0)   # the problems' spread on top


def test_se_problems_is_unbiased_over_a_population_of_problems():
    """Problems drawn from a population (two kinds: p = 0.2 or 0.9), K samples each: both levels of
    variance, σ_b²/P + σ_w²/(P K), and both metrics' ``se_problems²`` is unbiased for it."""
    population, k, problems = [(0.3, 0.2), (0.7, 0.9)], 2, 3
    sigma_b2 = sum(w * p * p for w, p in population) - sum(w * p for w, p in population) ** 2
    sigma_w2 = sum(w * p * (1 - p) for w, p in population)
    var, _, sep2, _ = _expectations([_mixture(k, population)] * problems, k, avg_at_k_se)
    assert var == approx64(sigma_b2 / problems + sigma_w2 / (problems * k), scale=1.0)
    assert sep2 == approx64(var, scale=1.0)
    var, _, sep2, _ = _expectations([_mixture(k, population)] * problems, k, pass_at_k_se)
    assert sep2 == approx64(var, scale=1.0)


@pytest.mark.parametrize("ps, k", [((0.05, 0.3, 0.9), 3), ((0.01, 0.5), 4), ((0.2, 0.0, 1.0), 5)])
def test_pass_at_k_se_is_an_unbiased_upper_bound(ps, k):
    var, se2, _, mean = _expectations([_binomial(k, p) for p in ps], k, pass_at_k_se)
    assert mean == approx64(sum(1 - (1 - p) ** k for p in ps) / len(ps))
    assert se2 == approx64(sum(_u_bound(p, k) for p in ps) / len(ps) ** 2, scale=1.0)
    assert se2 >= var


@pytest.mark.parametrize("p, k", [(0.01, 4), (0.002, 16), (0.05, 2)])
def test_pass_at_k_se_bound_is_tight_for_rarely_solved_problems(p, k):
    """U / q(1-q) = K p / ((1-p) q) <= 1 / ((1-p)(1 - (K-1)p/2)), since q >= K p - C(K,2) p²
    (Bonferroni): the bound is within that factor of the true variance when K p is small."""
    var, se2, _, _ = _expectations([_binomial(k, p)] * 2, k, pass_at_k_se)
    assert var <= se2 <= var / ((1 - p) * (1 - (k - 1) * p / 2))


def _simulate(ps: np.ndarray, k: int, replications: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).binomial(k, ps, size=(replications, ps.size))


def _mc_bound(terms: np.ndarray, z: float = 4.0) -> float:
    """z Monte-Carlo standard errors of the mean of ``terms`` (z = 4: a false failure at 6e-5 per
    check, and the draws are seeded)."""
    return z * terms.std(ddof=1) / math.sqrt(terms.size)


@pytest.mark.parametrize("metric, unbiased", [(avg_at_k_se, True), (pass_at_k_se, False)])
def test_se_matches_the_spread_of_simulated_evaluations(metric, unbiased):
    """4,000 evaluations of one benchmark (40 problems, K = 8, p_i spread over [0, 1] with many rarely
    solved): the mean of se² against the values' variance, both Monte-Carlo estimates; their
    difference has mean 0 (avg@K, unbiased) or <= 0 (pass@K, an upper bound)."""
    k, replications = 8, 4000
    ps = np.random.default_rng(0).beta(0.4, 0.6, size=40)
    draws = [metric(c, k) for c in _simulate(ps, k, replications, seed=1)]
    values = np.array([d.value for d in draws])
    se2 = np.array([d.se ** 2 for d in draws])
    diff = se2 - (values - values.mean()) ** 2 * replications / (replications - 1)
    if unbiased:
        assert abs(diff.mean()) <= _mc_bound(diff)
    else:
        assert diff.mean() >= -_mc_bound(diff)
    exact = (ps * (1 - ps) / k).sum() / ps.size ** 2 if unbiased else \
        (((1 - ps) ** k) * (1 - (1 - ps) ** k)).sum() / ps.size ** 2
    assert abs(values.var(ddof=1) - exact) <= _mc_bound((values - values.mean()) ** 2)


def test_se_problems_matches_a_seeded_bootstrap_over_problems():
    """The closed form against what a bootstrap over problems estimates, (P-1)/P · se_problems², within
    the bootstrap's own Monte-Carlo error."""
    k, resamples = 16, 8000
    counts = _simulate(np.random.default_rng(2).beta(0.5, 0.5, size=30), k, 1, seed=3)[0]
    rng = np.random.default_rng(4)
    picks = rng.integers(0, counts.size, size=(resamples, counts.size))
    for metric in (avg_at_k_se, pass_at_k_se):
        boot = np.array([metric(counts[i], k).value for i in picks])
        spread = (boot - boot.mean()) ** 2
        expected = (counts.size - 1) / counts.size * metric(counts, k).se_problems ** 2
        assert abs(spread.mean() - expected) <= _mc_bound(spread), metric.__name__


def test_se_edge_cases_and_errors():
    assert avg_at_k_se([0, 4, 4], 4).se == 0.0             # every problem always or never solved
    one = avg_at_k_se([1, 0, 1], 1)                         # K = 1: the conservative se_problems
    assert one.se == one.se_problems == approx64(math.sqrt(1 / 3 / 3))
    assert math.isnan(avg_at_k_se([2], 4).se_problems)      # one problem: no spread between problems
    assert pass_at_k_se([1, 1, 0, 3], 4).se == approx64(math.sqrt(2) / 4)
    assert pass_at_k_se(torch.tensor([1, 2]), 4).value == 1.0
    for bad, match in [(([1, 5], 4), r"integers in \[0, k=4\]"), (([], 4), "non-empty"),
                       (([1.5], 4), "integers"), (([1], 0), "k .* must be an int >= 1"),
                       (([[1, 2]], 4), "non-empty list")]:
        with pytest.raises(ValueError, match=match):
            avg_at_k_se(*bad)


def test_mean_se_and_samples_for_halfwidth():
    assert mean_se([0.03, 0.04]) == approx64(0.025)         # sqrt(0.0009 + 0.0016) / 2
    assert math.isnan(mean_se([0.01, None]))
    # 2 SE <= 1.5 points at A = 50 %: 4 · 0.25 / 0.015² = 4444.4
    assert samples_for_halfwidth(0.5, 0.015) == 4445
    assert samples_for_halfwidth(0.836, 0.015) == math.ceil(4 * 0.836 * 0.164 / 0.015 ** 2)
    worst = 0.836 * 0.164 / samples_for_halfwidth(0.836, 0.015)
    assert 2 * math.sqrt(worst) <= 0.015                    # the bound it promises


@pytest.mark.parametrize("ranks", [4, 40])
def test_metrics_over_validation_shards_of_unequal_size(ranks):
    """A validation's 30 problems in strided shares (`RolloutController.val_share`): 8, 8, 7, 7 on 4
    ranks; 1 or none on 40. The ranks' summed states give the metric of the 30 problems, each
    counted once, and the value `avg_at_k_se` / `pass_at_k_se` compute from the 30 counts."""
    gen = torch.Generator().manual_seed(3)
    correct = torch.rand(30, 8, generator=gen) < torch.rand(30, 1, generator=gen)
    for metric, se in ((AvgAtK(), avg_at_k_se), (PassAtK(8), pass_at_k_se)):
        shards = []
        for rank in range(ranks):
            shard = type(metric)(*([8] if isinstance(metric, PassAtK) else []))
            shard.update(correct[rank::ranks])  # a rank with no problems updates with none
            shards.append(shard)
        for shard in shards[1:]:
            shards[0].merge_state(shard)    # what the sum reduction over the ranks does
        assert int(shards[0].num_problems) == 30
        # float64 sums of 30 scores <= 1 in another order, / 30
        assert shards[0].compute().item() == pytest.approx(se(correct.sum(1), 8).value, rel=0,
                                                            abs=reduction_tol(torch.float64, 31, 1.0))
