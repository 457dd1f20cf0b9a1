"""Power of the GPU study's paired comparisons (docs/studies/gpu-study-protocol.md, "Power and sample size").

    python -m experiments.power

prints the protocol's Markdown tables. Everything is a pure function of its arguments:

- :func:`paired_t_power`: power of the paired t-test (one-sample t on the n paired differences,
  n − 1 degrees of freedom), computed exactly from the noncentral t distribution;
- :func:`tost_power`: power of the paired TOST equivalence test (two one-sided t-tests at level α
  each, the (1 − 2α) CI inside ±margin), exactly, as a one-dimensional integral over the sample SD;
- :func:`smallest_n` and :func:`largest_sd`: the n that reaches a target power, and the largest
  SD of the paired difference at which a given n still does;
- :func:`sd_from_ci` and :func:`paired_sd`: the paired SDs of the CPU studies, from a reported CI
  or from per-seed values.

Exactness: with T = (Z + δ)/√(V/ν), Z ~ N(0, 1), V ~ χ²_ν (ν = n − 1), δ = √n·effect/sd, the
noncentral t's upper tail is P(T > c) = E[Φ(δ − c·U/√ν)], U = √V ~ χ_ν, integrated over U's density
by adaptive quadrature (`scipy.integrate.quad`). That is the noncentral t CDF itself, not an
approximation; it stays finite where ``scipy.stats.nct.sf`` returns NaN for large δ (the tests
check the two agree where both are finite).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

ALPHA = 0.05
TARGET_POWER = 0.8

# The paper, Table 1: Avg. over the six math benchmarks at 1.5B (DeepSeek-R1-Distill-Qwen-1.5B base).
TABLE1_AVG = {"GRPO": 53.5, "ASPO": 59.3}
ACCURACY_GAP = round(TABLE1_AVG["ASPO"] - TABLE1_AVG["GRPO"], 1)  # 5.8 points

# CPU-study inputs for the accuracy SD (held-out avg@4 on the CPU testbed, points):
# docs/studies/staleness-study.md, "Secondary": the 95 % CIs of ASPO − GRPO at k = 0, 1, 2, 4 (n = 3 seeds each).
STALENESS_ACCURACY_CIS = {0: (-19.3, 20.6), 1: (-12.9, 15.4), 2: (-10.7, 8.23), 4: (-9.53, 5.88)}
# the same table's late-entropy CIs (nats), with the arms' mean late entropy (the per-arm table) for the log scale.
STALENESS_ENTROPY_CIS = {0: (-0.017, 0.0162), 1: (-0.00149, 0.00206), 2: (-0.0119, 0.0116), 4: (-0.00978, 0.00317)}
STALENESS_LATE_ENTROPY = 0.45
# docs/studies/study-v2.md, the regime table: last held-out avg@4 per seed 0-4 (paired by seed).
V2_LAST_ACCURACY = {"GRPO": (69.3, 60.9, 70.3, 74.8, 72.7), "ASPO": (66.2, 71.1, 68.2, 71.1, 73.2)}
# study v2's between-seed SD of the late-phase mean entropy and its mean (docs/studies/study-v2.md, "Final values").
V2_LATE_ENTROPY_SD = {"GRPO": (0.0216, 0.442), "ASPO": (0.00482, 0.442)}

# The grids of the protocol's tables (assumptions, each stated in the protocol).
N_GRID = (3, 5, 8, 12)
ACCURACY_SDS = (2.0, 3.0, 4.0, 5.7, 8.0)
LOG_RATIO_EFFECTS = {"1.1": math.log(1.1), "1.25": math.log(1.25), "1.5": math.log(1.5), "2": math.log(2.0)}
LOG_RATIO_SDS = (0.05, 0.1, 0.2, 0.4)

# The protocol's design values for the primary endpoint (assumptions; the go/no-go gate checks the SD).
PLANNED_N = 5
PRIMARY_TARGET = math.log(1.5)  # ASPO's late-phase mean entropy 1.5 × GRPO's
PRIMARY_SD = 0.2  # planning SD of the paired log-ratio difference
TOST_MARGIN = math.log(1.25)  # equivalence: the ratio within [1/1.25, 1.25]


def _check(sd: float, n: int, alpha: float, sided: int) -> None:
    if not sd > 0:
        raise ValueError(f"sd must be > 0, got {sd}")
    if int(n) != n or n < 2:
        raise ValueError(f"n must be an integer >= 2 (n - 1 degrees of freedom), got {n}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if sided not in (1, 2):
        raise ValueError(f"sided must be 1 or 2, got {sided}")


def _expect_over_chi(f: Callable[[float], float], df: int, upper: float | None = None) -> float:
    """E[f(U)] for U ~ χ_df, by adaptive quadrature over U's density (finite at 0 for every df ≥ 1)."""
    from scipy import integrate, stats

    hi = stats.chi.ppf(1 - 1e-15, df)
    hi = min(hi, upper) if upper is not None else hi
    if hi <= 0:
        return 0.0
    # the integrand is smooth; split at the density's mode so quad sees both sides of the peak
    mode = math.sqrt(max(df - 1, 0))
    points = [mode] if 0 < mode < hi else None
    value, _ = integrate.quad(lambda u: f(u) * stats.chi.pdf(u, df), 0.0, hi, points=points,
                              epsabs=1e-12, epsrel=1e-10, limit=200)
    return float(value)


def nct_sf(c: float, df: int, nc: float) -> float:
    """P(T > c) for T noncentral t with ``df`` degrees of freedom and noncentrality ``nc``."""
    from scipy.stats import norm

    return _expect_over_chi(lambda u: float(norm.cdf(nc - c * u / math.sqrt(df))), df)


def paired_t_power(effect: float, sd: float, n: int, alpha: float = ALPHA, sided: int = 2) -> float:
    """Power of the paired t-test of H0: mean difference = 0 with n pairs.

    Args:
        effect: the true mean of the paired difference (in the tested direction for ``sided=1``).
        sd: the true SD of the paired difference.
        n: the number of pairs (seeds).
        alpha: the test's level (two-sided: α/2 in each tail).
        sided: 1 (H1: mean > 0) or 2 (H1: mean ≠ 0; both tails count).
    """
    from scipy.stats import t

    _check(sd, n, alpha, sided)
    df, nc = n - 1, math.sqrt(n) * effect / sd
    if sided == 1:
        return nct_sf(float(t.ppf(1 - alpha, df)), df, nc)
    c = float(t.ppf(1 - alpha / 2, df))
    return nct_sf(c, df, nc) + nct_sf(c, df, -nc)  # P(T > c) + P(T < −c), T(−nc) mirrors T(nc)


def tost_power(margin: float, sd: float, n: int, true_diff: float = 0.0, alpha: float = ALPHA) -> float:
    """Power of the paired TOST for equivalence within ±margin (each one-sided test at ``alpha``,
    i.e. the (1 − 2α) CI inside the margin), when the paired difference has mean ``true_diff``.

    Given the sample SD s, the TOST rejects when −margin + c·s/√n < d̄ < margin − c·s/√n
    (c = t(1 − α, n − 1)), and d̄ ~ N(true_diff, sd²/n) independently of s ~ sd·χ_{n−1}/√(n − 1):
    the power is the expectation over s of that normal interval's probability (exact).
    """
    from scipy.stats import norm, t

    _check(sd, n, alpha, 1)
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    df = n - 1
    c = float(t.ppf(1 - alpha, df))
    a = math.sqrt(n) * (margin - true_diff) / sd
    b = math.sqrt(n) * (margin + true_diff) / sd
    k = c / math.sqrt(df)
    # the interval is empty once c·u/√ν ≥ (a + b)/2
    return _expect_over_chi(lambda u: max(0.0, float(norm.cdf(a - k * u) - norm.cdf(-b + k * u))), df,
                            upper=(a + b) / (2 * k))


def smallest_n(power_of_n: Callable[[int], float], target: float = TARGET_POWER, n_max: int = 500) -> int | None:
    """The smallest n ≥ 2 with ``power_of_n(n) >= target``; None if none up to ``n_max``."""
    for n in range(2, n_max + 1):
        if power_of_n(n) >= target:
            return n
    return None


def largest_sd(power_of_sd: Callable[[float], float], target: float = TARGET_POWER, lo: float = 1e-6,
               hi: float = 1e6) -> float:
    """The SD at which a power that falls with the SD equals ``target`` (bisection on the log scale)."""
    if power_of_sd(hi) >= target or power_of_sd(lo) < target:
        raise ValueError("target power not bracketed by the SD range")
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if power_of_sd(mid) >= target else (lo, mid)
        if hi / lo < 1 + 1e-9:
            break
    return math.sqrt(lo * hi)


def sd_from_ci(low: float, high: float, n: int, level: float = 0.95) -> float:
    """The SD of the paired differences behind a reported paired-t CI d̄ ± t(·, n − 1)·s/√n."""
    from scipy.stats import t

    return (high - low) / 2 * math.sqrt(n) / float(t.ppf(1 - (1 - level) / 2, n - 1))


def paired_sd(a: Sequence[float], b: Sequence[float]) -> float:
    """The sample SD (n − 1) of the per-seed differences a − b."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    m = sum(d) / len(d)
    return math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1))


def _fmt(p: float) -> str:
    return f"{p:.2f}"


def accuracy_table(gap: float = ACCURACY_GAP, sds: Sequence[float] = ACCURACY_SDS,
                   ns: Sequence[int] = N_GRID) -> str:
    head = "| SD of the paired difference (points) | " + " | ".join(f"n = {n}" for n in ns) + " |"
    rows = [head, "|---|" + "--:|" * len(ns)]
    for sd in sds:
        cells = [f"{_fmt(paired_t_power(gap, sd, n, sided=1))} / {_fmt(paired_t_power(gap, sd, n, sided=2))}"
                 for n in ns]
        rows.append(f"| {sd:g} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def review_range_table(gap: float = ACCURACY_GAP, n: int = 3, powers: Sequence[float] = (0.26, 0.68)) -> str:
    rows = ["| power at n = 3 | SD, one-sided α = 0.05 | SD, two-sided α = 0.05 |", "|--:|--:|--:|"]
    for p in powers:
        one = largest_sd(lambda s: paired_t_power(gap, s, n, sided=1), target=p)
        two = largest_sd(lambda s: paired_t_power(gap, s, n, sided=2), target=p)
        rows.append(f"| {p:.2f} | {one:.1f} | {two:.1f} |")
    return "\n".join(rows)


def primary_table(effects: dict[str, float] = LOG_RATIO_EFFECTS, sds: Sequence[float] = LOG_RATIO_SDS,
                  ns: Sequence[int] = N_GRID) -> str:
    head = ("| ratio ASPO/GRPO | effect (log) | SD (log) | " + " | ".join(f"n = {n}" for n in ns)
            + " | n for 0.8 |")
    rows = [head, "|--:|--:|--:|" + "--:|" * (len(ns) + 1)]
    for label, effect in effects.items():
        for sd in sds:
            cells = [_fmt(paired_t_power(effect, sd, n, sided=1)) for n in ns]
            need = smallest_n(lambda n, e=effect, s=sd: paired_t_power(e, s, n, sided=1))
            rows.append(f"| {label} | {effect:.3f} | {sd:g} | " + " | ".join(cells) + f" | {need} |")
    return "\n".join(rows)


def sizing_table(target: float = PRIMARY_TARGET, margin: float = TOST_MARGIN, sds: Sequence[float] = LOG_RATIO_SDS,
                 planned_n: int = PLANNED_N) -> str:
    rows = [f"| SD (log) | superiority power at n = {planned_n} | n for 0.8 (superiority) "
            f"| TOST power at n = {planned_n} | n for 0.8 (TOST) |", "|--:|--:|--:|--:|--:|"]
    for sd in (*sds[:2], 0.15, *sds[2:]):
        sup = paired_t_power(target, sd, planned_n, sided=1)
        n_sup = smallest_n(lambda n, s=sd: paired_t_power(target, s, n, sided=1))
        eq = tost_power(margin, sd, planned_n)
        n_eq = smallest_n(lambda n, s=sd: tost_power(margin, s, n))
        rows.append(f"| {sd:g} | {_fmt(sup)} | {n_sup} | {_fmt(eq)} | {n_eq} |")
    return "\n".join(rows)


def gate_thresholds(target: float = PRIMARY_TARGET, margin: float = TOST_MARGIN,
                    planned_n: int = PLANNED_N) -> dict[str, float]:
    """The largest paired SD (log scale) at which ``planned_n`` seeds keep 0.8 power: for the
    superiority test at ``target`` and for the TOST at ``margin``."""
    return {"superiority": largest_sd(lambda s: paired_t_power(target, s, planned_n, sided=1)),
            "tost": largest_sd(lambda s: tost_power(margin, s, planned_n))}


def gate_stop_probability(true_sd: float, threshold: float, n: int) -> float:
    """P(the sample SD of n normal paired differences exceeds ``threshold``) when their SD is
    ``true_sd``: (n − 1)·s²/σ² ~ χ²_{n−1}. The go/no-go gate's chance of stopping."""
    from scipy.stats import chi2

    _check(true_sd, n, ALPHA, 1)
    return float(chi2.sf((n - 1) * (threshold / true_sd) ** 2, n - 1))


def gate_table(threshold: float, n: int = PLANNED_N, sds: Sequence[float] = (0.1, 0.15, 0.2, 0.3, 0.4, 0.6)) -> str:
    rows = [f"| true SD (log) | P(stop), s > {threshold:.2f} with n = {n} | superiority power at n = {n} |",
            "|--:|--:|--:|"]
    for sd in sds:
        rows.append(f"| {sd:g} | {_fmt(gate_stop_probability(sd, threshold, n))} "
                    f"| {_fmt(paired_t_power(PRIMARY_TARGET, sd, n, sided=1))} |")
    return "\n".join(rows)


def inputs_table() -> str:
    rows = ["| source | n | paired SD, accuracy (points) | paired SD, late log entropy |", "|---|--:|--:|--:|"]
    for k, ci in STALENESS_ACCURACY_CIS.items():
        acc = sd_from_ci(*ci, n=3)
        ent = sd_from_ci(*STALENESS_ENTROPY_CIS[k], n=3) / STALENESS_LATE_ENTROPY
        rows.append(f"| staleness study, ASPO − GRPO at k = {k} (from its 95 % CIs) | 3 | {acc:.1f} | {ent:.4f} |")
    acc = paired_sd(V2_LAST_ACCURACY["ASPO"], V2_LAST_ACCURACY["GRPO"])
    (g_sd, g_m), (a_sd, a_m) = V2_LATE_ENTROPY_SD["GRPO"], V2_LATE_ENTROPY_SD["ASPO"]
    ent = math.hypot(g_sd / g_m, a_sd / a_m)
    rows.append(f"| study v2, ASPO − GRPO (per-seed last evaluations; entropy: the arms' SDs, "
                f"no correlation assumed) | 5 | {acc:.1f} | {ent:.3f} |")
    return "\n".join(rows)


def main() -> None:
    print(f"Paired SDs on the CPU testbed (inputs):\n\n{inputs_table()}\n")
    print(f"Power for the paper's Table 1 gap, {ACCURACY_GAP} points (ASPO {TABLE1_AVG['ASPO']} − GRPO "
          f"{TABLE1_AVG['GRPO']}); each cell one-sided / two-sided, α = 0.05, paired t on n seeds:\n")
    print(accuracy_table() + "\n")
    print("The SD that gives a stated power at n = 3 for the 5.8-point gap:\n")
    print(review_range_table() + "\n")
    print("Primary endpoint, log of the late-phase entropy ratio ASPO/GRPO: power of the one-sided paired t "
          "at α = 0.05, and the smallest n with power ≥ 0.8:\n")
    print(primary_table() + "\n")
    print(f"Sizing at the design target (ratio 1.5, log {PRIMARY_TARGET:.3f}; one-sided α = 0.05) and the TOST "
          f"margin ±log 1.25 = ±{TOST_MARGIN:.3f} (α = 0.05 each side, true difference 0):\n")
    print(sizing_table() + "\n")
    tight = smallest_n(lambda n: tost_power(math.log(1.1), PRIMARY_SD, n))
    print(f"A tighter margin, ±log 1.1: the TOST needs n = {tight} for 0.8 at SD {PRIMARY_SD:g}.\n")
    n_eq = smallest_n(lambda n: tost_power(TOST_MARGIN, PRIMARY_SD, n))
    for n in (PLANNED_N, n_eq):
        gate = gate_thresholds(planned_n=n)
        threshold = round(gate["superiority"], 2)
        print(f"n = {n}: the largest paired SD at which it keeps power 0.8 is {gate['superiority']:.3f} (superiority "
              f"at ratio 1.5), {gate['tost']:.3f} (TOST at ±log 1.25). The go/no-go gate stops when the sample SD "
              f"of the early endpoint over the n seeds exceeds {threshold:.2f}; its chance of stopping:\n")
        print(gate_table(threshold, n=n) + "\n")

if __name__ == "__main__":
    main()
