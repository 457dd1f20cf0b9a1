"""The demo reference's false-alarm rate and what its bands detect, measured (docs/compare.md).

    python -m experiments.bands --runs runs/bands                      # the report, from the runs below
    python -m experiments.bands --runs runs/bands --write_reference    # also (re)write aspo_lit/references/demo.json

The runs (``make study-bands`` trains them, ~2 h on 2 cores), each ``<folder>/s<seed>/version_0``: the
reference's 40 seeds of ``conf/tiny/aspo.yaml`` (:data:`REFERENCE_RUNS`: seeds 0-19 and 100-109 on one torch
thread, 110-119 on two); 50 held-out seeds of the same config under a CPU setting per folder
(:data:`HELD_OUT_RUNS`: ATen's scalar or AVX2 kernels, one or two threads: what another machine changes);
``<runs>/sensitivity/<regression>``, the regressions of :mod:`experiments.sensitivity`. The report gives:

* the false-alarm rate: the held-out seeds that depart at the reference's alpha, per setting and in all, with
  the exact (Clopper-Pearson) 95 % interval; the same for the first two windows (the CI check's length);
* the detection rate of each regression and the first window from which a run cut there departs, beside
  what the per-window bands of reference format 1 (a t band per window, Bonferroni over every cell, SE
  floored at the metric's median) detect on the same runs: the statistic was chosen by this power;
* whether ASPO and GRPO can be told apart on the demo (the ``grpo`` regression).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from aspo_lit.compare.run_reference import (
    METRICS,
    build_reference,
    compare_run,
    family_p,
    leave_one_out,
    parse_reference,
)
from aspo_lit.compare.runlog import load_run, resolve_metrics
from aspo_lit.maths.bands import window_values
from experiments.sensitivity import REGRESSIONS

REFERENCE = Path(__file__).resolve().parents[1] / "aspo_lit" / "references" / "demo.json"
CI_WINDOWS = 2   # the CI check trains the first 8 rollout batches: two windows of 4


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact two-sided interval of a binomial proportion ``k / n``."""
    from scipy import stats

    a = 1 - level
    low = 0.0 if k == 0 else float(stats.beta.ppf(a / 2, k, n - k + 1))
    high = 1.0 if k == n else float(stats.beta.ppf(1 - a / 2, k + 1, n - k))
    return low, high


def runs_in(folder: Path) -> list:
    return [load_run(str(d)) for d in sorted(folder.glob("s*/version_0"), key=lambda p: int(p.parent.name[1:]))
            if (d.parent / "done").exists()]


def truncated(run, windows: int, window: int):
    """``run`` as if it had stopped after ``windows`` windows."""
    from dataclasses import replace

    last = windows * window - 1
    series = {k: (s[s <= last], v[s <= last]) for k, (s, v) in run.series.items() if (s <= last).any()}
    return replace(run, series=series, last_step=float(min(run.last_step, last)))


def v1_departs(run, ref_runs, window: int, alpha: float) -> tuple[bool, int | None]:
    """Reference format 1's rule, for comparison: per (metric, window) cell of the seeds' window medians a
    t band ``mean ± t_{n-1, 1-alpha/(2m)}·√(n+1)·max(SE, SE_floor)``, m the cells compared, SE_floor the
    metric's median SE. Whether the run leaves any cell, and the first window it leaves."""
    from scipy import stats

    keys = [k for ks in resolve_metrics(METRICS, run.series).values() for k in ks]
    cells = []
    for key in keys:
        seeds = [window_values(*r.series[key], window, r.last_step) for r in ref_runs if key in r.series]
        mine = window_values(*run.series[key], window, run.last_step)
        common = sorted(set(mine).intersection(*map(set, seeds)))
        rows = [(w, np.array([s[w] for s in seeds])) for w in common]
        if not rows:
            continue
        se = [x.std(ddof=1) / math.sqrt(x.size) for _, x in rows]
        floor = float(np.median(se))
        cells += [(w, mine[w], x.mean(), max(s, floor)) for (w, x), s in zip(rows, se)]
    n = len(ref_runs)
    k = stats.t.ppf(1 - alpha / (2 * len(cells)), n - 1) * math.sqrt(n + 1)
    out = sorted(w for w, y, mean, se in cells
                 if abs(y - mean) > max(k * se, 2 * np.finfo(np.float32).eps * abs(mean)))
    return bool(out), (out[0] if out else None)


def held_out_table(ref, ref_runs, settings: dict[str, list]) -> tuple[list[str], dict]:
    lines = ["| setting | seeds | departed (all windows) | departed (first 2 windows, the CI check) | "
             "format 1's per-window bands (all windows) |", "|---|---|---|---|---|"]
    total = {"runs": 0, "departed": 0, "departed_ci": 0, "v1": 0, "family_p": [], "departures": {}}
    for setting, runs in settings.items():
        dep = dep_ci = v1 = 0
        for run in runs:
            results = compare_run(run, ref)
            departed = [r.metric for r in results if r.status == "departs"]
            total["family_p"].append(family_p(results))
            if departed:
                dep += 1
                total["departures"][run.source] = departed
            dep_ci += any(r.status == "departs" for r in compare_run(truncated(run, CI_WINDOWS, ref.window), ref))
            v1 += v1_departs(run, ref_runs, ref.window, ref.alpha)[0]
        lines.append(f"| {setting} | {len(runs)} | {dep} | {dep_ci} | {v1} |")
        total["runs"] += len(runs)
        total["departed"] += dep
        total["departed_ci"] += dep_ci
        total["v1"] += v1
    n = total["runs"]
    lines.append(f"| all | {n} | {total['departed']} ({_ci(total['departed'], n)}) | "
                 f"{total['departed_ci']} ({_ci(total['departed_ci'], n)}) | {total['v1']} ({_ci(total['v1'], n)}) |")
    return lines, total


def _ci(k: int, n: int) -> str:
    low, high = clopper_pearson(k, n)
    return f"{100 * k / n:.1f} %, 95 % interval {100 * low:.1f}-{100 * high:.1f} %"


def sensitivity_table(ref, ref_runs, folder: Path) -> list[str]:
    lines = ["| regression | seeds | detected (Holm over trajectory scores) | first window that departs | "
             "metrics that depart | format 1's per-window bands: detected, first window |", "|---|---|---|---|---|---|"]
    for name, (what, _) in REGRESSIONS.items():
        runs = runs_in(folder / name)
        if not runs:
            continue
        detected, firsts, metrics, v1, v1_firsts = 0, [], {}, 0, []
        for run in runs:
            results = compare_run(run, ref)
            departed = [r for r in results if r.status == "departs"]
            if departed:
                detected += 1
                firsts.append(min(r.first_window for r in departed))
                for r in departed:
                    metrics[r.metric] = metrics.get(r.metric, 0) + 1
            hit, first = v1_departs(run, ref_runs, ref.window, ref.alpha)
            v1 += hit
            if hit:
                v1_firsts.append(first)
        top = ", ".join(f"{m} {c}/{len(runs)}" for m, c in sorted(metrics.items(), key=lambda kv: -kv[1])[:4]) or "-"
        lines.append(f"| {what} | {len(runs)} | {detected}/{len(runs)} | {_windows(firsts)} | {top} | "
                     f"{v1}/{len(runs)}, {_windows(v1_firsts)} |")
    return lines


def _windows(firsts: list[int]) -> str:
    return ", ".join(str(w) for w in sorted(firsts)) if firsts else "-"


def health_table(runs: list) -> list[str]:
    """The health verdict (``HealthMonitor`` as the demo config sets it: window 10, every 5 batches)
    replayed over each run's logged series with today's rules: how many runs that learned (held-out
    accuracy and reward both up from start to end) read ``watch`` or worse at the end, and at any check
    along the run, with the exact 95 % interval."""
    from aspo_lit.callbacks.health import CLIP, ENTROPY, KL, REWARD, assess_health

    learned = end = along = 0
    reasons: dict[str, int] = {}
    for run in runs:
        series = {k: run.series[k][1] for k in (ENTROPY, REWARD, CLIP, KL) if k in run.series}
        val = next((v for k, (_, v) in run.series.items() if k.startswith("val/avg@")), None)
        reward = series.get(REWARD)
        if val is None or reward is None or not (val[-1] > val[0] and reward[-10:].mean() > reward[:10].mean()):
            continue
        learned += 1
        verdicts = [assess_health({k: v[:b] for k, v in series.items()}, window=10)
                    for b in range(10, len(series[ENTROPY]) + 1, 5)]
        end += verdicts[-1][0] != "healthy"
        if any(v != "healthy" for v, _ in verdicts):
            along += 1
            for v, why in verdicts:
                if v != "healthy":
                    clause = why.split(" (")[0]
                    reasons[clause] = reasons.get(clause, 0) + 1
    lines = [f"Runs that learned: {learned} of {len(runs)}. Read watch or collapsed at the end: {end} "
             f"({_ci(end, learned)}); at any check along the run: {along} ({_ci(along, learned)})."]
    if reasons:
        lines.append("Checks that read watch, by their first sign: " + "; ".join(f"{k}: {v}" for k, v in reasons.items()))
    return lines


#: the reference's runs and the held-out ones, under ``--runs`` (make study-bands trains them)
REFERENCE_RUNS = ("ref_demo", "heldout/t1", "heldout/t2")
HELD_OUT_RUNS = ("heldout/aten_default", "heldout/aten_avx2", "heldout2/t1", "heldout2/t2", "heldout2/aten_avx2")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bands", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("runs/bands"))
    parser.add_argument("--reference", nargs="+", default=list(REFERENCE_RUNS),
                        help="folders (under --runs) of the reference's seeds")
    parser.add_argument("--held_out", nargs="+", default=list(HELD_OUT_RUNS),
                        help="folders (under --runs) of held-out seeds, one CPU setting each")
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--write_reference", action="store_true", help=f"write {REFERENCE} with the measured rates")
    parser.add_argument("--testbed", help="the testbed of runs that do not record theirs (made before runs logged "
                                          "it), e.g. 'testbed v1'")
    args = parser.parse_args(argv)
    ref_runs = [run for folder in args.reference for run in runs_in(args.runs / folder)]
    settings = {folder: runs_in(args.runs / folder) for folder in args.held_out}
    settings = {k: v for k, v in settings.items() if v}
    for run in ref_runs + [r for v in settings.values() for r in v]:
        run.testbed = run.testbed or args.testbed
    data = build_reference(ref_runs, args.window, args.alpha, min_seeds=len(ref_runs), allow_mixed_configs=False)
    data["leave_one_out"] = leave_one_out(ref_runs, args.window, args.alpha)
    ref = parse_reference(data, "demo (built from the runs)")
    calibration = data["calibration"]
    print(f"# The demo reference: {len(ref_runs)} seeds ({', '.join(args.reference)}), window {args.window}, "
          f"alpha {args.alpha}, testbed {data['testbed']}\n")
    print(f"Degrees of freedom, calibrated by leaving one seed out: {calibration['df']:g} (normal model: "
          f"{len(ref_runs) - 1}); held-out share departing at them, by windows compared: "
          + ", ".join(f"{r:.3f}" for r in calibration.get("held_out_rate_by_windows", [])) + ".")
    loo = data["leave_one_out"]
    print(f"Leave one seed out at that df, all windows: {loo['departed']} of {loo['seeds']} seeds departed.\n")
    lines, total = held_out_table(ref, ref_runs, settings)
    print("## False alarms: held-out seeds of the shipped config\n")
    print("\n".join(lines))
    ps = np.asarray(total["family_p"])
    print(f"\nThe smallest family-wise alpha at which each held-out seed would depart (M · min p): median "
          f"{np.median(ps):.2f}; at alpha 0.01 {int((ps <= 0.01).sum())}, 0.1 {int((ps <= 0.1).sum())}, "
          f"0.2 {int((ps <= 0.2).sum())} of {ps.size} depart.")
    for source, metrics in total["departures"].items():
        print(f"- departed: {source}: {', '.join(metrics)}")
    print("\n## Health verdicts over the seeds that learned\n")
    print("\n".join(health_table(ref_runs + [r for v in settings.values() for r in v])))
    print("\n## What the bands detect\n")
    print("\n".join(sensitivity_table(ref, ref_runs, args.runs / "sensitivity")))
    if args.write_reference:
        low, high = clopper_pearson(total["departed"], total["runs"])
        data["held_out"] = {"runs": total["runs"], "departed": total["departed"], "rate": total["departed"] / total["runs"],
                            "ci95": [low, high], "alpha": args.alpha, "settings": {k: len(v) for k, v in settings.items()},
                            "seeds": sorted(r.seed for v in settings.values() for r in v)}
        REFERENCE.write_text(json.dumps(data, indent=1) + "\n")
        print(f"\nwrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
