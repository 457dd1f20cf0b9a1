"""The study's pre-registered claims and their decision rule (docs/studies/study-protocol.md; v2:
docs/studies/study-protocol-v2.md, the same rule).

Per seed, the *final* value of a claim's metric (the mean over the last ``tail_fraction`` of the
logged training steps, the last held-out evaluation for accuracy, the maximum over the run for
claim 7's grad norm), then the 2 x pooled-SE rule on the difference of the two losses' means, with
Welch's two-sided p-value beside it as information.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from experiments.results import ACCURACY, Results


@dataclass(frozen=True)
class Claim:
    """``value(higher) > value(lower)`` per seed, for ``metric`` reduced by ``statistic``."""

    id: str
    text: str
    source: str
    metric: str          # a logged key, or ACCURACY (resolved to val/avg@K)
    statistic: str       # tail_mean | last_eval | max
    higher: str          # the loss the paper says ends higher
    lower: str


CLAIMS = (
    Claim("1", "GRPO's entropy falls faster / lower than ASPO's", "Sec. 7.3, Fig. 2",
          "train/entropy", "tail_mean", higher="aspo", lower="grpo"),
    Claim("2", "GRPO's repetition rate grows more than ASPO's", "Sec. 7.3, Fig. 2, App. C",
          "train/repetition_rate", "tail_mean", higher="grpo", lower="aspo"),
    Claim("3", "GRPO's positive clip ratio rises more than ASPO's", "Sec. 7.3, Fig. 2",
          "clip/pos_high", "tail_mean", higher="grpo", lower="aspo"),
    Claim("4", "ASPO ends with higher held-out accuracy than GRPO", "Sec. 7.2-7.3, Table 1, Fig. 2",
          ACCURACY, "last_eval", higher="aspo", lower="grpo"),
    Claim("5a", "GRPO w/o IS ends higher than GRPO (held-out accuracy)", "Table 4",
          ACCURACY, "last_eval", higher="grpo_no_is", lower="grpo"),
    Claim("5b", "GRPO w/o IS is more stable than GRPO (slower entropy decay)", "Sec. 4.2.1, Fig. 2",
          "train/entropy", "tail_mean", higher="grpo_no_is", lower="grpo"),
    Claim("6a", "GRPO w/ Pos. Resp. IS Mean ends higher than GRPO (held-out accuracy)", "Table 4, Sec. 5.3.1",
          ACCURACY, "last_eval", higher="grpo_pos_mean", lower="grpo"),
    Claim("6b", "GRPO w/ Pos. Resp. IS Mean is more stable than GRPO (slower entropy decay)",
          "Sec. 5.3.1, Fig. 2", "train/entropy", "tail_mean", higher="grpo_pos_mean", lower="grpo"),
    Claim("7", "Without dual clip, grad-norm spikes are larger (max grad norm)", "App. C, Fig. 8",
          "train/grad_norm", "max", higher="aspo_no_dual_clip", lower="aspo"),
)


@dataclass
class Verdict:
    verdict: str          # supported | not supported | inconclusive | no data
    diff: float           # mean(higher) - mean(lower): > 0 is the claimed direction
    margin: float         # k x pooled standard error
    n_higher: int
    n_lower: int
    mean_higher: float
    mean_lower: float
    std_higher: float
    std_lower: float
    p_value: float = math.nan  # Welch's t-test, two-sided (information only: the 2xSE rule decides)


def pooled_se(a: Sequence[float], b: Sequence[float]) -> float:
    """Standard error of ``mean(a) - mean(b)`` with the pooled variance (NaN if n_a + n_b < 3)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    na, nb = len(a), len(b)
    if na < 1 or nb < 1 or na + nb < 3:
        return math.nan
    ss = (np.var(a, ddof=1) * (na - 1) if na > 1 else 0.0) + (np.var(b, ddof=1) * (nb - 1) if nb > 1 else 0.0)
    return float(math.sqrt(ss / (na + nb - 2) * (1.0 / na + 1.0 / nb)))


def welch_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of Welch's t-test (unequal variances) of ``mean(a) - mean(b)``; NaN with
    fewer than 2 values per side or no spread at all."""
    from scipy.stats import ttest_ind

    if len(a) < 2 or len(b) < 2 or (np.ptp(a) == 0 and np.ptp(b) == 0):
        return math.nan
    return float(ttest_ind(a, b, equal_var=False).pvalue)


def verdict(higher: Sequence[float], lower: Sequence[float], k: float = 2.0) -> Verdict:
    """The decision rule: the claim is ``mean(higher) > mean(lower)``.

    *supported* when the difference is positive and larger than ``k`` x the pooled standard error,
    *not supported* when it is negative by more than that margin, else *inconclusive* (also with
    fewer than 2 seeds for either loss: no spread, no test). NaN values are dropped.
    """
    a = [float(x) for x in higher if x is not None and math.isfinite(x)]
    b = [float(x) for x in lower if x is not None and math.isfinite(x)]

    def std(x):
        return float(np.std(x, ddof=1)) if len(x) > 1 else math.nan

    ma = float(np.mean(a)) if a else math.nan
    mb = float(np.mean(b)) if b else math.nan
    if not a or not b:
        return Verdict("no data", math.nan, math.nan, len(a), len(b), ma, mb, std(a), std(b))
    diff = ma - mb
    margin = k * pooled_se(a, b) if len(a) >= 2 and len(b) >= 2 else math.nan
    if not math.isfinite(margin):
        word = "inconclusive"
    elif diff > margin:
        word = "supported"
    elif diff < -margin:
        word = "not supported"
    else:
        word = "inconclusive"
    return Verdict(word, diff, margin, len(a), len(b), ma, mb, std(a), std(b), welch_p(a, b))


def judge(results: Results) -> list[tuple[Claim, Verdict]]:
    out = []
    for claim in CLAIMS:
        if claim.higher not in results.study.losses or claim.lower not in results.study.losses:
            out.append((claim, verdict([], [])))
            continue
        out.append((claim, verdict(results.per_seed(claim.higher, claim.metric, claim.statistic),
                                   results.per_seed(claim.lower, claim.metric, claim.statistic))))
    return out
