"""The dose-response study's analysis, fixed before its runs (docs/studies/dose-protocol.md).

    python -m experiments.dose_analysis --runs runs/study_dose --out docs/studies/dose-study.md

Reads every ``<runs>/<dose>/<arm>.json`` of `experiments.dose_study`, and per dose:

* the flip's share: GRPO's per-seed mean over its batches, then the mean over seeds;
* the primary endpoint, ASPO − GRPO forking-position entropy, paired by seed: *final* (the last
  checkpoint; primary) and *averaged* (the mean over the checkpoints after the start; key
  secondary): the mean, its 95 % CI (t, n − 1), the TOST bound (`experiments.posthoc.compare`) and
  the verdict: **ASPO higher** (95 % CI above 0), **ASPO lower** (below 0), **equivalent** (TOST
  bound < ``DELTA``), else **inconclusive**;
* secondary, no verdict: final reward, valid modes kept, and the filler positions' final entropy
  (the control), ASPO − GRPO and GRPO w/o IS − GRPO;
* the estimator check on GRPO's checkpoint batches: how often each first-order gap estimate
  (pooled; state-centred under π_old and under π_θ) has the sign of the true one-batch gap, and
  Spearman's correlation with it.

Then the predictions P1-P6 by the protocol's rules (`predictions`).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.posthoc import compare

DELTA = 0.02          # nats: the equivalence margin of the entropy endpoints
LOW, HIGH = 0.03, 0.10  # flip shares: "a few percent" and "visible only at >= 10 %"
CONSEQUENTIAL = 0.01  # P1 and P5-P6 read the doses whose flip share is at least 1 %
ESTIMATES = ("gap_pooled", "gap_state_old", "gap_state")


@dataclass
class Dose:
    name: str
    epochs: int
    lr: float
    batches: int
    arms: dict[str, dict]        # arm -> {"record": {quantity: [C][S]}, "flip_share_mean": [S], ...}

    def final(self, arm: str, quantity: str) -> np.ndarray:
        return np.asarray(self.arms[arm]["record"][quantity][-1], np.float64)

    def averaged(self, arm: str, quantity: str) -> np.ndarray:
        return np.asarray(self.arms[arm]["record"][quantity][1:], np.float64).mean(0)

    @property
    def flip_share(self) -> float:
        return float(np.nanmean(np.asarray(self.arms["grpo"]["flip_share_mean"], np.float64)))


def load(root: Path) -> list[Dose]:
    """Every dose folder with all three arms, in increasing flip share."""
    doses = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        arms = {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}
        if not {"grpo", "aspo", "grpo_no_is"} <= set(arms):
            continue
        seeds = {tuple(a["seeds"]) for a in arms.values()}
        if len(seeds) != 1:
            raise ValueError(f"{folder}: the arms ran different seeds: {sorted(seeds)}")
        first = arms["grpo"]
        doses.append(Dose(folder.name, first["epochs"], first["lr"], first["batches"], arms))
    return sorted(doses, key=lambda d: d.flip_share)


@dataclass(frozen=True)
class Paired:
    mean: float
    ci95: tuple[float, float]
    tost: float
    n: int

    @property
    def verdict(self) -> str:
        if self.ci95[0] > 0:
            return "ASPO higher"
        if self.ci95[1] < 0:
            return "ASPO lower"
        if self.tost < DELTA:
            return "equivalent"
        return "inconclusive"


def paired(a: np.ndarray, b: np.ndarray) -> Paired:
    c = compare(list(a), list(b))
    return Paired(c.paired_diff, c.paired_ci95, c.paired_tost, c.n)


def slope_test(doses: Sequence[Dose], endpoint: str = "final") -> tuple[float, tuple[float, float]]:
    """Does the ASPO − GRPO fork-entropy gap grow with the flip's share? Each seed's OLS slope of
    its gaps on the doses' flip shares (the seed is paired across doses too: the same start), then
    the mean slope and its one-sided 95 % lower bound and upper bound (t over seeds)."""
    x = np.array([d.flip_share for d in doses])
    gaps = np.stack([getattr(d, endpoint)("aspo", "fork_entropy") - getattr(d, endpoint)("grpo", "fork_entropy")
                     for d in doses])                                    # [doses, seeds]
    xc = x - x.mean()
    slopes = (xc[:, None] * (gaps - gaps.mean(0))).sum(0) / (xc ** 2).sum()
    n = slopes.shape[0]
    from scipy.stats import t

    half = float(t.ppf(0.95, n - 1)) * slopes.std(ddof=1) / math.sqrt(n)
    return float(slopes.mean()), (float(slopes.mean() - half), float(slopes.mean() + half))


def estimator_check(dose: Dose) -> dict[str, tuple[float, float]]:
    """Per estimate: (share of GRPO's checkpoint batches whose estimate has the true gap's sign,
    Spearman's correlation with the true gap), over every checkpoint batch and seed."""
    from scipy.stats import spearmanr

    record = dose.arms["grpo"]["record"]
    true = np.asarray(record["gap_true"][1:], np.float64).ravel()
    out = {}
    for key in ESTIMATES:
        estimate = np.asarray(record[key][1:], np.float64).ravel()
        ok = np.isfinite(true) & np.isfinite(estimate) & (true != 0)
        agree = float((np.sign(estimate[ok]) == np.sign(true[ok])).mean()) if ok.any() else math.nan
        rho = float(spearmanr(estimate[ok], true[ok]).statistic) if ok.sum() > 2 else math.nan
        out[key] = (agree, rho)
    return out


def predictions(doses: Sequence[Dose]) -> list[tuple[str, str, str, str]]:
    """``(id, prediction, rule, outcome)`` for P1-P6; an outcome is "confirmed", "not confirmed"
    or "not testable" (no dose in its range)."""
    final = {d.name: paired(d.final("aspo", "fork_entropy"), d.final("grpo", "fork_entropy")) for d in doses}
    rows = []

    def rule(pid, text, how, selected, test):
        if not selected:
            rows.append((pid, text, how, "not testable"))
        else:
            rows.append((pid, text, how, "confirmed" if all(test(d) for d in selected) else "not confirmed"))

    consequential = [d for d in doses if d.flip_share >= CONSEQUENTIAL]
    rule("P1", "paper: ASPO keeps more forking-position entropy", "final gap's 95 % CI > 0 at every dose with flip share ≥ 1 %",
         consequential, lambda d: final[d.name].verdict == "ASPO higher")
    slope, (low, _) = slope_test(doses) if len(doses) > 1 else (math.nan, (math.nan, math.nan))
    rows.append(("P2", "paper: the gap grows with the flip's share",
                 "mean per-seed slope of the final gap on the flip share, one-sided 95 % lower bound > 0",
                 "not testable" if math.isnan(slope) else ("confirmed" if low > 0 else "not confirmed")))
    rule("P3", "second-order view: no gap where the flip is small",
         f"final gap equivalent to 0 within ±{DELTA} nats (TOST, 90 % CI) at every dose with flip share < 3 %",
         [d for d in doses if d.flip_share < LOW], lambda d: final[d.name].tost < DELTA)
    rule("P4", "second-order view: a gap only where the flip is large",
         "final gap's 95 % CI excludes 0 at every dose with flip share ≥ 10 %",
         [d for d in doses if d.flip_share >= HIGH], lambda d: final[d.name].verdict in ("ASPO higher", "ASPO lower"))
    checks = {d.name: estimator_check(d) for d in consequential}
    rule("P5", "the state-centred estimate (under π_old) has the true one-batch gap's sign more often than the pooled one",
         "sign agreement, state_old > pooled, at every dose with flip share ≥ 1 %", consequential,
         lambda d: checks[d.name]["gap_state_old"][0] > checks[d.name]["gap_pooled"][0])
    rule("P6", "the state-centred estimate (under π_old) ranks the true gap better than the pooled one",
         "Spearman with the true gap, state_old > pooled, at every dose with flip share ≥ 1 %", consequential,
         lambda d: checks[d.name]["gap_state_old"][1] > checks[d.name]["gap_pooled"][1])
    return rows


def _g(x: float) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def _ci(p: Paired) -> str:
    return f"{_g(p.mean)} [{_g(p.ci95[0])}, {_g(p.ci95[1])}]"


def render(doses: Sequence[Dose], runs: Path) -> str:
    n = len(doses[0].arms["grpo"]["seeds"]) if doses else 0
    lines = ["# The dose-response study: report", "",
             f"_Generated by `python -m experiments.dose_analysis --runs {runs}` from the runs of `make study-dose`; "
             "the protocol, committed before the runs: docs/studies/dose-protocol.md._", "",
             f"{n} paired seeds per cell; entropies in nats; a gap is ASPO − GRPO (paired by seed), its 95 % CI (t); "
             f"TOST: the smallest margin the 90 % CI excludes; equivalence margin ±{DELTA}.", "",
             "## Primary: forking-position entropy, ASPO − GRPO", "",
             "| dose (epochs × lr, batches) | flip share (GRPO) | GRPO final | ASPO final | final gap [95 % CI] | TOST | verdict | averaged gap [95 % CI] | TOST | verdict |",
             "|---|--:|--:|--:|---|--:|---|---|--:|---|"]
    for d in doses:
        f = paired(d.final("aspo", "fork_entropy"), d.final("grpo", "fork_entropy"))
        a = paired(d.averaged("aspo", "fork_entropy"), d.averaged("grpo", "fork_entropy"))
        lines.append(f"| {d.epochs} × {d.lr:g}, {d.batches} | {100 * d.flip_share:.2f} % | "
                     f"{_g(d.final('grpo', 'fork_entropy').mean())} | {_g(d.final('aspo', 'fork_entropy').mean())} | "
                     f"{_ci(f)} | {_g(f.tost)} | **{f.verdict}** | {_ci(a)} | {_g(a.tost)} | {a.verdict} |")
    if len(doses) > 1:
        slope, (low, high) = slope_test(doses)
        lines += ["", f"Slope of the final gap on the flip share (per seed, then over seeds): {_g(slope)} nats per unit "
                  f"share, one-sided 95 % bounds [{_g(low)}, {_g(high)}]. Averaged endpoint: "
                  f"{_g(slope_test(doses, 'averaged')[0])}."]
    lines += ["", "## Predictions", "", "| | prediction | rule | outcome |", "|---|---|---|---|"]
    lines += [f"| {pid} | {text} | {how} | **{outcome}** |" for pid, text, how, outcome in predictions(doses)]
    lines += ["", "## Secondary (no verdict): final values, paired by seed", "",
              "| dose | reward: ASPO − GRPO | no-IS − GRPO | modes kept: GRPO, ASPO, no-IS | ASPO − GRPO | filler entropy (control): ASPO − GRPO | no-IS − GRPO | fork entropy: no-IS − GRPO |",
              "|---|---|---|---|---|---|---|---|"]
    for d in doses:
        cells = [_ci(paired(d.final(arm, q), d.final("grpo", q)))
                 for q, arm in (("reward", "aspo"), ("reward", "grpo_no_is"))]
        modes = ", ".join(_g(d.final(arm, "modes_kept").mean()) for arm in ("grpo", "aspo", "grpo_no_is"))
        cells += [modes, _ci(paired(d.final("aspo", "modes_kept"), d.final("grpo", "modes_kept")))]
        cells += [_ci(paired(d.final(arm, q), d.final("grpo", q)))
                  for q, arm in (("filler_entropy", "aspo"), ("filler_entropy", "grpo_no_is"), ("fork_entropy", "grpo_no_is"))]
        lines.append(f"| {d.epochs} × {d.lr:g} | " + " | ".join(cells) + " |")
    lines += ["", "## The estimator check (GRPO's checkpoint batches)", "",
              "The true gap: the exact change of the mean entropy over the batch's states under GRPO's update minus "
              "under ASPO's update from the same tables, optimizer state, samples and mini-batch order. Per estimate: "
              "the share of batches whose sign agrees with it, and Spearman's correlation with it.", "",
              "| dose | true gap > 0 | pooled: sign agrees, ρ | state-centred (π_old): sign agrees, ρ | state-centred (π_θ): sign agrees, ρ |",
              "|---|--:|---|---|---|"]
    for d in doses:
        check = estimator_check(d)
        true = np.asarray(d.arms["grpo"]["record"]["gap_true"][1:], np.float64).ravel()
        cells = [f"{_g(check[k][0])}, {_g(check[k][1])}" for k in ESTIMATES]
        lines.append(f"| {d.epochs} × {d.lr:g} | {_g(float((true > 0).mean()))} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("runs/study_dose"))
    parser.add_argument("--out", type=Path, default=Path("docs/studies/dose-study.md"))
    args = parser.parse_args(argv)
    doses = load(args.runs)
    if not doses:
        raise SystemExit(f"no finished dose (all three arms) under {args.runs}")
    args.out.write_text(render(doses, args.runs))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
