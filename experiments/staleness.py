"""The staleness study's analysis (docs/studies/staleness-protocol.md), written before its runs finished.

    python -m experiments.staleness [--root runs/study_staleness] [--out docs/studies/staleness-study.md]

Reads the four arms' runs (``<root>/k<k>/runs/<loss>_s<seed>``), checks the schedule in every
batch (``rollout/staleness`` = min(k, b - 1)), and applies the protocol's rules:

- per run, the mean over its rollout batches of S = ``flip/abs_log_ratio_pos_p90``, F =
  ``flip/weight_change``, C = ``clip/pos_high``, K = ``train/kl`` and G = log10 ``train/grad_norm``;
  the last ``val/avg@4`` and the mean ``train/entropy`` of the last 20 % of the batches;
- per loss and Q in (S, F, C): the per-seed differences Q(k = 4) - Q(k = 0), the one-sided paired
  t-test, Holm over the 6 (Q, loss) tests: *confirmed* (all three positive, Holm p <= 0.05),
  *refuted* (all three negative, Holm p of the opposite direction <= 0.05), else *inconclusive*;
  Spearman's rho of Q with k beside it;
- K and G: the paired k = 4 - k = 0 differences with 95 % CIs; ASPO - GRPO at each k, paired by
  seed: accuracy and late entropy with 95 % CIs and the TOST bound (:mod:`experiments.posthoc`).

Added on 2026-12-07, after the runs (the rules above are unchanged): the report says that the six
tests are manipulation checks (staleness widens the ratio by construction); prints each of the
protocol's predicted sizes (S and F at least double from k = 0 to k = 4, C up by at least 1
percentage point under GRPO) beside the measured one, met or missed; says which ASPO - GRPO
differences the secondary comparison could detect (its CI half-widths and TOST bounds) and the
direction of its accuracy point estimates with k against the paper's; and prints the protocol's
"Deviations" section.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.posthoc import compare, holm
from experiments.results import read_run, tail_mean

KS = (0, 1, 2, 4)
LOSSES = ("grpo", "aspo")
SEEDS = (6, 7, 8)
PRIMARY = {"S": "flip/abs_log_ratio_pos_p90", "F": "flip/weight_change", "C": "clip/pos_high"}
REPORTED = {"K": "train/kl", "G": "train/grad_norm"}
LABEL = {"grpo": "GRPO", "aspo": "ASPO"}
ALPHA = 0.05
PROTOCOL = Path(__file__).resolve().parents[1] / "docs" / "studies" / "staleness-protocol.md"
#: the protocol's predicted sizes, k = 4 against k = 0 on the means over seeds: (quantity, loss, kind, size);
#: "ratio": k = 4 at least ``size`` times k = 0; "rise": k = 4 minus k = 0 at least ``size`` (a share: 0.01 = 1 point)
PREDICTED_SIZES = (("S", "grpo", "ratio", 2.0), ("F", "grpo", "ratio", 2.0), ("S", "aspo", "ratio", 2.0),
                   ("F", "aspo", "ratio", 2.0), ("C", "grpo", "rise", 0.01))
NAMES = {"S": "S: p90 of \\|log r\\| on A > 0", "F": "F: the flip's weight change", "C": "C: `clip/pos_high`"}


def series(metrics, key: str) -> np.ndarray:
    rows = metrics[metrics["metric"] == key].sort_values("step")
    return rows["value"].to_numpy(dtype=np.float64)


def run_values(run_dir: Path, k: int) -> dict[str, float]:
    """The protocol's per-run quantities, and the schedule check (``schedule_ok``)."""
    m = read_run(run_dir)
    out = {q: float(np.mean(series(m, key))) for q, key in PRIMARY.items()}
    out["K"] = float(np.mean(series(m, REPORTED["K"])))
    out["G"] = float(np.mean(np.log10(series(m, REPORTED["G"]))))
    acc = series(m, "val/avg@4")
    out["acc"] = float(acc[-1]) * 100 if len(acc) else math.nan
    out["entropy"] = tail_mean(series(m, "train/entropy"), 0.2)
    batches = len(series(m, "train/reward_mean"))
    staleness = series(m, "rollout/staleness")
    expected = [min(k, b) for b in range(batches)] if k else []
    out["batches"] = batches
    out["schedule_ok"] = (len(staleness) == 0 and k == 0) or staleness.tolist() == [float(x) for x in expected]
    return out


def collect(root: Path) -> dict[tuple[int, str, int], dict[str, float]]:
    values = {}
    for k in KS:
        for loss in LOSSES:
            for seed in SEEDS:
                run = root / f"k{k}" / "runs" / f"{loss}_s{seed}"
                if any(run.glob("version_*/metrics.csv")):
                    values[(k, loss, seed)] = run_values(run, k)
    return values


def verdicts(values) -> list[dict]:
    """The protocol's 6 tests, Holm-adjusted, with Spearman's rho beside them."""
    from scipy.stats import spearmanr

    tests = []
    for loss in LOSSES:
        for q in PRIMARY:
            k4, k0 = [values[(4, loss, s)][q] for s in SEEDS], [values[(0, loss, s)][q] for s in SEEDS]
            d = [a - b for a, b in zip(k4, k0, strict=True)]
            pairs = [(k, values[(k, loss, s)][q]) for k in KS for s in SEEDS]
            rho = float(spearmanr([k for k, _ in pairs], [v for _, v in pairs]).statistic)
            tests.append({"loss": loss, "q": q, "diffs": d, "p_up": compare(k4, k0).paired_p, "p_down": compare(k0, k4).paired_p,
                          "rho": rho, "k0": np.mean([values[(0, loss, s)][q] for s in SEEDS]),
                          "k4": np.mean([values[(4, loss, s)][q] for s in SEEDS])})
    up, _ = holm([t["p_up"] for t in tests], ALPHA)
    down, _ = holm([t["p_down"] for t in tests], ALPHA)
    for t, pu, pd in zip(tests, up, down, strict=True):
        t["holm_up"], t["holm_down"] = pu, pd
        if all(x > 0 for x in t["diffs"]) and pu <= ALPHA:
            t["verdict"] = "confirmed"
        elif all(x < 0 for x in t["diffs"]) and pd <= ALPHA:
            t["verdict"] = "refuted"
        else:
            t["verdict"] = "inconclusive"
    return tests


def _g(x: float) -> str:
    return f"{x:.3g}"


MANIPULATION_CHECK = (
    "These six tests are manipulation checks, not tests of ASPO: with π_old taken from the sampler "
    "(`model.old_logprobs: sampler`), a sampler k rollout batches behind the trained policy moves the ratio away "
    "from 1 by construction (protocol, \"Why\"), so S, F and C rising with k shows that the manipulation reached "
    "the ratio the losses clip and ASPO flips. Whether ASPO's flip then changes accuracy or entropy is the "
    "secondary comparison below.")


def size_lines(means: dict[tuple[int, str], dict[str, float]]) -> list[str]:
    """The protocol's predicted sizes against the measured ones; ``means[(k, loss)][q]`` is the mean over seeds."""
    lines = ["## The predicted sizes (k = 4 against k = 0)", "",
             "The protocol predicted sizes beside the directions: S and F at least double from k = 0 to k = 4 "
             "(under both losses), and C rises by at least 1 percentage point under GRPO. Measured on the means "
             "over the three seeds (the per-arm table):", "",
             "| quantity | loss | predicted | k = 0 | k = 4 | measured | met or missed |", "|---|---|---|--:|--:|---|---|"]
    missed = []
    for q, loss, kind, size in PREDICTED_SIZES:
        k0, k4 = means[(0, loss)][q], means[(4, loss)][q]
        if kind == "ratio":
            value = k4 / k0 if k0 > 0 else math.nan
            predicted, measured = f"k = 4 ≥ {size:g} × k = 0", f"{_g(value)} × k = 0"
        else:
            value = k4 - k0
            predicted, measured = f"a rise of ≥ {100 * size:g} percentage point{'' if 100 * size == 1 else 's'}", f"{100 * value:+.3g} percentage points"
        met = bool(value >= size)
        if not met:
            missed.append(f"{q} under {LABEL[loss]} ({measured}; predicted {predicted})")
        lines.append(f"| {NAMES[q]} | {LABEL[loss]} | {predicted} | {_g(k0)} | {_g(k4)} | {measured} | "
                     + ("met" if met else "**missed**") + " |")
    met_count = len(PREDICTED_SIZES) - len(missed)
    lines += ["", f"{met_count} of {len(PREDICTED_SIZES)} predicted sizes met"
              + (f"; missed: {'; '.join(missed)}." if missed else ".")
              + " The sizes carry no verdict under the protocol's rule (the verdicts above judge the direction); "
              "they are reported because the protocol stated them.",
              "", "The protocol based these sizes on the mechanism check's synchronous runs, taken as S ≈ 0.05-0.1 "
              f"and F ≈ 1-3 %; at k = 0 here S was {_g(means[(0, 'grpo')]['S'])} (GRPO) and {_g(means[(0, 'aspo')]['S'])} "
              f"(ASPO), F {_g(100 * means[(0, 'grpo')]['F'])} % and {_g(100 * means[(0, 'aspo')]['F'])} %.", ""]
    return lines


def reach_and_direction_lines(acc: dict[int, tuple[float, tuple[float, float], float]],
                              ent: dict[int, tuple[float, tuple[float, float], float]]) -> list[str]:
    """What the ASPO − GRPO comparison could detect, and the direction of its accuracy point estimates with k;
    ``acc[k]`` / ``ent[k]`` = (paired mean, its 95 % CI, the TOST bound)."""
    ks = sorted(acc)
    half = {k: (acc[k][1][1] - acc[k][1][0]) / 2 for k in ks}
    ent_half = {k: (ent[k][1][1] - ent[k][1][0]) / 2 for k in ks}
    tost, ent_tost = [acc[k][2] for k in ks], [ent[k][2] for k in ks]
    diffs = [acc[k][0] for k in ks]
    slope = float(np.polyfit(ks, diffs, 1)[0]) if len(ks) > 1 else math.nan
    trend = "fall" if slope < 0 else "rise" if slope > 0 else "do not move"
    relation = ("opposite to" if slope < 0 else "in" if slope > 0 else "not in") + " the direction the protocol takes from the paper"
    excludes = [k for k in ks if not acc[k][1][0] <= 0 <= acc[k][1][1]]
    ci_text = ("every 95 % CI contains 0" if not excludes
               else f"the 95 % CI excludes 0 at k = {', '.join(map(str, excludes))}")
    return [
        "**What this comparison could detect.** With 3 seeds per arm, the 95 % CIs of the accuracy difference "
        "have half-widths of "
        + ", ".join(f"{_g(half[k])}" for k in ks) + f" points at k = {', '.join(map(str, ks))}, and the TOST bounds "
        f"are ±{_g(min(tost))} to ±{_g(max(tost))} points (the narrowest equivalence margins the data support: "
        "differences that large were not excluded). Only an observed difference larger than the CI half-width would "
        f"have excluded 0, so a difference smaller than about {_g(min(half.values()))} points could not have been "
        f"detected at any k; for late entropy the TOST bounds are ±{_g(min(ent_tost))} to "
        f"±{_g(max(ent_tost))} nats (CI half-widths {_g(min(ent_half.values()))} to {_g(max(ent_half.values()))}). "
        "A difference the study did not see is not shown to be absent.",
        "",
        "**Direction of the accuracy point estimates.** ASPO − GRPO is "
        + ", ".join(f"{d:+.3g}" for d in diffs) + f" points at k = {', '.join(map(str, ks))} (least-squares slope "
        f"{slope:+.2g} points per unit of k): the point estimates {trend} with k, {relation} (ASPO's advantage "
        f"growing as the ratios spread). {ci_text[0].upper() + ci_text[1:]}; with 3 seeds this is the direction of "
        "point estimates, not a significant trend (the protocol makes it a description, not a test).",
        ""]


def deviation_lines(protocol: Path) -> list[str]:
    """The protocol's "Deviations" section, verbatim (the report must not drop any of them)."""
    head = ["## Deviations from the protocol", ""]
    text = protocol.read_text() if protocol.is_file() else ""
    match = re.search(r"^## Deviations[^\n]*\n(.*?)(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    if not match or not match.group(1).strip():
        return head + [f"The protocol ({protocol.name}) records no deviation" + ("" if text else " (file not found)") + ".", ""]
    return head + [f"As recorded in the protocol's \"Deviations\" section ({protocol.name}), verbatim:", "",
                   *match.group(1).strip().splitlines(), ""]


def render(values, root: Path, protocol: Path = PROTOCOL) -> str:
    missing = [(k, loss, s) for k in KS for loss in LOSSES for s in SEEDS if (k, loss, s) not in values]
    lines = ["# The staleness study: report", "",
             "_Generated by `python -m experiments.staleness` from the runs of `make study-staleness` "
             f"(`{root}`); the protocol, committed before the runs: docs/studies/staleness-protocol.md._", ""]
    if missing:
        return "\n".join(lines + [f"Not every run has finished: missing {missing}.", ""])
    bad = [(k, loss, s) for (k, loss, s), v in values.items() if not v["schedule_ok"]]
    lines += ["## The schedule", "",
              "Every batch b (from 0) of every run had `rollout/staleness` = min(k, b): "
              + ("**yes**, in all 24 runs." if not bad else f"**no** in {bad}: those runs are invalid (protocol)."), ""]
    tests = verdicts(values)
    lines += ["## Primary: does the quantity rise with k?", "",
              "Per loss, the mean over seeds at k = 0 and k = 4, the three per-seed differences (k = 4 − k = 0, "
              "paired by seed), the one-sided paired t-test's p and its Holm adjustment over the 6 tests, "
              "Spearman's ρ of the quantity with k over the 12 runs of the loss (not tested), and the verdict "
              "by the protocol's rule.", "",
              "| quantity | loss | k = 0 | k = 4 | differences (seeds 6 / 7 / 8) | p (one-sided) | Holm p | ρ with k | verdict |",
              "|---|---|--:|--:|---|--:|--:|--:|---|"]
    for t in tests:
        lines.append(f"| {NAMES[t['q']]} | {LABEL[t['loss']]} | {_g(t['k0'])} | {_g(t['k4'])} | "
                     f"{' / '.join(_g(x) for x in t['diffs'])} | {t['p_up']:.2g} | {t['holm_up']:.2g} | "
                     f"{t['rho']:+.2f} | **{t['verdict']}** |")
    lines += ["", MANIPULATION_CHECK, "", "Per arm, the mean over the three seeds:", "",
              "| k | loss | S | F | C | K (`train/kl`) | G (log10 grad norm) | held-out avg@4 (%) | late entropy |",
              "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    means = {(k, loss): {q: float(np.mean([values[(k, loss, s)][q] for s in SEEDS]))
                         for q in ("S", "F", "C", "K", "G", "acc", "entropy")} for k in KS for loss in LOSSES}
    for k in KS:
        for loss in LOSSES:
            cells = [_g(means[(k, loss)][q]) for q in ("S", "F", "C", "K", "G", "acc", "entropy")]
            lines.append(f"| {k} | {LABEL[loss]} | " + " | ".join(cells) + " |")
    lines += ["", *size_lines(means)]
    lines += ["## Reported without a prediction: KL and grad norm (k = 4 − k = 0, paired)", "",
              "| quantity | loss | paired mean | 95 % CI |", "|---|---|--:|---|"]
    for q in ("K", "G"):
        for loss in LOSSES:
            c = compare([values[(4, loss, s)][q] for s in SEEDS], [values[(0, loss, s)][q] for s in SEEDS])
            lines.append(f"| {q} | {LABEL[loss]} | {_g(c.paired_diff)} | [{_g(c.paired_ci95[0])}, {_g(c.paired_ci95[1])}] |")
    lines += ["", "## Secondary: ASPO − GRPO at each k (paired by seed; no verdict)", "",
              "| k | held-out avg@4, ASPO − GRPO (points) | 95 % CI | TOST ±δ | late entropy, ASPO − GRPO | 95 % CI | TOST ±δ |",
              "|---|--:|---|--:|--:|---|--:|"]
    acc, ent = {}, {}
    for k in KS:
        a = compare([values[(k, "aspo", s)]["acc"] for s in SEEDS], [values[(k, "grpo", s)]["acc"] for s in SEEDS])
        e = compare([values[(k, "aspo", s)]["entropy"] for s in SEEDS], [values[(k, "grpo", s)]["entropy"] for s in SEEDS])
        acc[k], ent[k] = (a.paired_diff, a.paired_ci95, a.paired_tost), (e.paired_diff, e.paired_ci95, e.paired_tost)
        lines.append(f"| {k} | {_g(a.paired_diff)} | [{_g(a.paired_ci95[0])}, {_g(a.paired_ci95[1])}] | {_g(a.paired_tost)} | "
                     f"{_g(e.paired_diff)} | [{_g(e.paired_ci95[0])}, {_g(e.paired_ci95[1])}] | {_g(e.paired_tost)} |")
    lines += ["", *reach_and_direction_lines(acc, ent), *deviation_lines(protocol)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.staleness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("runs/study_staleness"))
    parser.add_argument("--out", type=Path, default=Path("docs/studies/staleness-study.md"))
    parser.add_argument("--protocol", type=Path, default=PROTOCOL, help="the protocol whose Deviations the report lists")
    args = parser.parse_args(argv)
    text = render(collect(args.root), args.root, args.protocol)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
