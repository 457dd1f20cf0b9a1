"""experiments.power: the paired t-test's exact power and the TOST's, against known values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from experiments import power
from experiments.power import largest_sd, paired_sd, paired_t_power, sd_from_ci, smallest_n, tost_power


def normal_power(effect: float, sd: float, n: int, alpha: float = 0.05, sided: int = 2) -> float:
    """The z-test's power: what the t-test's tends to as n grows."""
    shift = math.sqrt(n) * effect / sd
    if sided == 1:
        return float(stats.norm.sf(stats.norm.isf(alpha) - shift))
    z = stats.norm.isf(alpha / 2)
    return float(stats.norm.sf(z - shift) + stats.norm.cdf(-z - shift))


def test_textbook_value():
    # n = 10 pairs, d = 1, two-sided α = 0.05: 0.803 (Cohen's tables; G*Power gives 0.8031)
    assert paired_t_power(1.0, 1.0, 10) == pytest.approx(0.8031, abs=5e-4)
    # and the same d with the effect and SD scaled together
    assert paired_t_power(5.8, 5.8, 10) == pytest.approx(paired_t_power(1.0, 1.0, 10), abs=1e-9)


@pytest.mark.parametrize("sided", [1, 2])
@pytest.mark.parametrize("n", [2, 3, 5, 12])
def test_power_at_zero_effect_is_alpha(n, sided):
    for alpha in (0.05, 0.01):
        assert paired_t_power(0.0, 1.0, n, alpha=alpha, sided=sided) == pytest.approx(alpha, abs=1e-7)


@pytest.mark.parametrize("sided", [1, 2])
def test_large_n_matches_the_normal_approximation(sided):
    for n, effect in ((400, 0.15), (2000, 0.06)):
        assert paired_t_power(effect, 1.0, n, sided=sided) == pytest.approx(normal_power(effect, 1.0, n, sided=sided),
                                                                            abs=3e-3)
    # and at small n the t-test has less power than the z-test (the SD is estimated)
    assert paired_t_power(1.0, 1.0, 3, sided=sided) < normal_power(1.0, 1.0, 3, sided=sided) - 0.1


@pytest.mark.parametrize("effect,sd,n", [(5.8, 3.0, 3), (5.8, 8.0, 5), (0.223, 0.2, 8), (-0.4, 0.3, 4), (1.0, 1.0, 10)])
def test_agrees_with_scipy_noncentral_t(effect, sd, n):
    df, nc = n - 1, math.sqrt(n) * effect / sd
    one = stats.nct.sf(stats.t.isf(0.05, df), df, nc)
    c = stats.t.isf(0.025, df)
    two = stats.nct.sf(c, df, nc) + stats.nct.cdf(-c, df, nc)
    assert paired_t_power(effect, sd, n, sided=1) == pytest.approx(one, abs=1e-6)
    assert paired_t_power(effect, sd, n, sided=2) == pytest.approx(two, abs=1e-6)


def test_monotone_in_n_effect_and_sd():
    by_n = [paired_t_power(5.8, 5.7, n) for n in (2, 3, 5, 8, 12, 20)]
    assert all(a < b for a, b in zip(by_n, by_n[1:]))
    by_effect = [paired_t_power(e, 0.2, 5, sided=1) for e in (0.0, 0.05, 0.1, 0.2, 0.4)]
    assert all(a < b for a, b in zip(by_effect, by_effect[1:]))
    by_sd = [paired_t_power(5.8, s, 5) for s in (2.0, 3.0, 5.7, 8.0)]
    assert all(a > b for a, b in zip(by_sd, by_sd[1:]))


def test_sidedness():
    # a one-sided test has more power in its direction, less than α against it; two-sided is symmetric
    assert paired_t_power(5.8, 5.7, 3, sided=1) > paired_t_power(5.8, 5.7, 3, sided=2)
    assert paired_t_power(-5.8, 5.7, 3, sided=1) < 0.05
    assert paired_t_power(-5.8, 5.7, 5, sided=2) == pytest.approx(paired_t_power(5.8, 5.7, 5, sided=2), abs=1e-9)


def test_reviews_range_for_the_table1_gap():
    # the paper's Table 1 at 1.5B: ASPO 59.3 - GRPO 53.5; n = 3 one-sided: 0.69 at SD 3, 0.26 at SD 6.9
    assert power.ACCURACY_GAP == pytest.approx(5.8)
    assert paired_t_power(5.8, 3.0, 3, sided=1) == pytest.approx(0.69, abs=0.01)
    assert paired_t_power(5.8, 6.9, 3, sided=1) == pytest.approx(0.26, abs=0.01)


def test_tost_against_simulation():
    rng = np.random.default_rng(0)
    margin, sd, n, reps = math.log(1.25), 0.2, 6, 40_000
    c = stats.t.isf(0.05, n - 1)
    for true_diff in (0.0, 0.1):
        d = rng.normal(true_diff, sd, size=(reps, n))
        mean, se = d.mean(1), d.std(1, ddof=1) / math.sqrt(n)
        simulated = np.mean((mean - c * se > -margin) & (mean + c * se < margin))
        assert tost_power(margin, sd, n, true_diff=true_diff) == pytest.approx(simulated, abs=0.01)


def test_tost_limits():
    # at the margin the TOST's rejection rate is at most α (→ α as n grows); far inside, → 1 with n
    assert tost_power(0.2, 0.2, 5, true_diff=0.2) <= 0.05 + 1e-9
    assert tost_power(0.2, 0.2, 400, true_diff=0.2) == pytest.approx(0.05, abs=2e-3)
    assert tost_power(0.2, 0.2, 60) > 0.99
    # large n: the normal approximation 2Φ(√n·Δ/σ − z) − 1 at a true difference of 0
    z, n = stats.norm.isf(0.05), 300
    assert tost_power(0.05, 0.2, n) == pytest.approx(2 * stats.norm.cdf(math.sqrt(n) * 0.05 / 0.2 - z) - 1, abs=5e-3)
    # tiny n with a wide SD almost never concludes equivalence
    assert tost_power(0.1, 1.0, 2) < 5e-3


def test_sample_size_and_sd_threshold_helpers():
    need = smallest_n(lambda n: paired_t_power(1.0, 1.0, n))
    assert need == 10  # the textbook value above is the first n over 0.8
    assert paired_t_power(1.0, 1.0, need - 1) < 0.8
    assert smallest_n(lambda n: 0.0, n_max=5) is None
    sd = largest_sd(lambda s: paired_t_power(math.log(1.5), s, 5, sided=1))
    assert paired_t_power(math.log(1.5), sd, 5, sided=1) == pytest.approx(0.8, abs=1e-6)


def test_cpu_inputs():
    # a 95 % CI d̄ ± t(0.975, 2)·s/√3 gives s back
    s = 3.0
    half = stats.t.ppf(0.975, 2) * s / math.sqrt(3)
    assert sd_from_ci(1.0 - half, 1.0 + half, 3) == pytest.approx(s)
    assert paired_sd([3.0, 5.0, 4.0], [1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert paired_sd(power.V2_LAST_ACCURACY["ASPO"], power.V2_LAST_ACCURACY["GRPO"]) == pytest.approx(5.73, abs=0.01)


@pytest.mark.parametrize("kwargs", [dict(sd=0.0), dict(n=1), dict(n=2.5), dict(alpha=1.0), dict(sided=3)])
def test_rejects_bad_arguments(kwargs):
    args = dict(effect=1.0, sd=1.0, n=5, alpha=0.05, sided=2) | kwargs
    with pytest.raises(ValueError):
        paired_t_power(**args)


def test_main_prints_the_tables(capsys):
    power.main()
    out = capsys.readouterr().out
    assert "| 5.7 | 0.33 / 0.18 | 0.59 / 0.41 | 0.83 / 0.70 | 0.95 / 0.89 |" in out
    assert "n = 5: the largest paired SD at which it keeps power 0.8 is 0.298" in out
    assert "| 0.2 | 0.98 | 4 | 0.40 | 9 |" in out  # the sizing row at the planning SD
