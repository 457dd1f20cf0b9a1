"""`reference` and `compare`: does a run behave like the seeds of its config? (docs/compare.md)

    python -m aspo_lit reference runs/seeds/s*/version_0 --out my_ref.json   # >= 5 seeds of one config
    python -m aspo_lit compare runs/tiny_aspo/version_0 --reference demo     # a run against the shipped demo

``reference`` keeps every seed's window values (:mod:`aspo_lit.compare.run_reference`); ``compare`` scores
the run and the seeds over the windows the run has, tests each metric by its prediction interval,
flags the metrics Holm's step-down rejects at the family-wise ``alpha`` (:mod:`aspo_lit.maths.bands`), draws
the run over the seeds' range, and exits 1 on any departure (0 inside; 2 when nothing can be
compared). ``--reference NAME`` without a path names a reference shipped in the package
(``aspo_lit/references/NAME.json``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from aspo_lit.compare import run_reference
from aspo_lit.compare.run_reference import (
    MetricResult,
    Reference,
    build_reference,
    compare_run,
    config_matches,
    exit_code,
    read_reference,
)
from aspo_lit.compare.runlog import SPEED_ONLY_KEYS, STEP_KEY, CompareError, RunLog, config_differences, load_run
from aspo_lit.maths.bands import complete_windows, seed_range, window_values
from aspo_lit.training.figures import draw_seed_range


def format_table(results: Sequence[MetricResult]) -> str:
    rows = [("metric", "windows", "verdict", "run", "a seed's limits", "p")]
    for r in results:
        if r.status == "missing":
            rows.append((r.metric, "", f"missing: {r.reason}", "", "", ""))
            continue
        verdict = "inside" if r.status == "inside" else (
            "departs" + (f" from window {r.first_window}" if r.first_window is not None else ""))
        rows.append((r.metric, str(r.compared), verdict, f"{r.score:.4g}", f"[{r.limits[0]:.4g}, {r.limits[1]:.4g}]",
                     f"{r.p:.2g}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def coverage_note(run: RunLog, ref: Reference) -> str:
    """Which of the reference's windows the run has (a shorter run is compared on those only)."""
    have, total = min(complete_windows(run.last_step, ref.window), ref.windows), ref.windows
    note = f"run {run.source}: steps 0-{run.last_step:g}; {have} of the reference's {total} windows of {ref.window} steps"
    if have < total:
        note += f" (shorter than the reference: compared on windows 0-{have - 1})" if have else " (none complete)"
    elif complete_windows(run.last_step, ref.window) > total:
        note += " (longer than the reference: later windows not compared)"
    return note


def plot_bands(run: RunLog, ref: Reference, results: Sequence[MetricResult], path: str) -> str:
    """One panel per metric of ``ref``: the seeds' range (5th-95th percentile) and mean per window, the
    run's per-step values and its window values (red when the metric departs). Writes a PNG at ``path``."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    verdicts = {r.metric: r for r in results}
    keys = list(ref.metrics)
    cols = min(4, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig = Figure(figsize=(4 * cols, 3 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for ax, key in zip(axes, keys):
        metric, verdict = ref.metrics[key], verdicts.get(key)
        draw_seed_range(ax, seed_range(metric.values), ref.window)
        if key in run.series:
            steps, values = run.series[key]
            ax.plot(steps, values, color="0.5", lw=0.8, alpha=0.6, label="run")
            mine = window_values(steps, values, ref.window, run.last_step, metric.spec.window)
            colour = "C3" if verdict and verdict.status == "departs" else "C2"
            ax.plot([w * ref.window + (ref.window - 1) / 2 for w in mine], list(mine.values()), "o", ms=4,
                    color=colour, label=f"run's window {metric.spec.window}s")
        title = f"{key}: {verdict.status if verdict else '?'}"
        if verdict and verdict.p is not None:
            title += f" (p={verdict.p:.2g})"
        ax.set_title(title, fontsize=9, color="C3" if verdict and verdict.status == "departs" else "black")
        ax.set_xlabel(f"{STEP_KEY} (rollout batch)")
        ax.grid(alpha=0.3)
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


# ----------------------------------------------------------------------------------------------
# the commands

def reference(runs: list[str], out: str | None = None, window: int | None = None, alpha: float = 0.05,
              min_seeds: int = 5, allow_mixed_configs: bool = False, leave_one_out: bool = True) -> int:
    """Build a reference file from seeds of one config: every seed's window values per metric.

    Args:
        runs: the runs, one per seed: log folders (runs/NAME/version_K), metrics.csv files, TensorBoard
            folders or wandb:ENTITY/PROJECT/RUN_ID.
        out: the reference file to write (JSON; docs/compare.md).
        window: logged steps (rollout batches) per window (default: the shortest run in about 10 windows).
        alpha: the family-wise false-alarm rate `compare` tests at by default (docs/compare.md).
        min_seeds: the fewest runs.
        allow_mixed_configs: build it even if the runs' configs (or testbeds) differ beyond the seed.
        leave_one_out: also compare each seed with the reference of the others and store the result.
    """
    try:
        if out is None:
            raise CompareError("--out FILE (the reference file to write) is required")
        logs = [load_run(r) for r in ([runs] if isinstance(runs, str) else runs)]
        ref = build_reference(logs, window, alpha, min_seeds, allow_mixed_configs)
        if leave_one_out and len(logs) >= 3:
            ref["leave_one_out"] = run_reference.leave_one_out(logs, ref["window"], alpha)
    except CompareError as err:
        print(f"aspo-lit reference: error: {err}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    Path(out).write_text(json.dumps(ref, indent=1) + "\n")
    print(f"{out}: {len(logs)} seeds {ref['seeds']}, window {ref['window']} steps, {len(ref['metrics'])} metrics, "
          f"alpha {alpha}, testbed {ref['testbed']}")
    if ref["missing"]:
        print(f"  not in the runs: {', '.join(ref['missing'])}")
    if "leave_one_out" in ref:
        loo = ref["leave_one_out"]
        print(f"  leave one seed out: {loo['departed']} of {loo['seeds']} held-out seeds departed at alpha {alpha}")
        for source, metrics in loo["departures"].items():
            print(f"    {source}: {', '.join(metrics)}")
    return 0


def compare(run: str, reference: str | None = None, alpha: float | None = None, out: str | None = None) -> int:
    """Compare a run with a reference: per metric, inside or departs (and from which window); exit 1 if any departs.

    Args:
        run: the run: a log folder (runs/NAME/version_K), its metrics.csv, a TensorBoard folder or
            wandb:ENTITY/PROJECT/RUN_ID.
        reference: a reference file (python -m aspo_lit reference), or the name of one shipped in the
            package (e.g. demo).
        alpha: the family-wise false-alarm rate (default: the reference's, 0.05 for the shipped ones).
        out: the folder for the figure compare-<reference>.png (default: the run's log folder, or
            runs/compare for a W&B run).
    """
    try:
        if reference is None:
            raise CompareError("--reference FILE (or a shipped reference's name) is required")
        if alpha is not None and not 0 < alpha < 1:
            raise CompareError(f"--alpha must be in (0, 1), got {alpha}")
        ref = read_reference(reference)
        log = load_run(run)
    except CompareError as err:
        print(f"aspo-lit compare: error: {err}", file=sys.stderr)
        return 2
    results = compare_run(log, ref, alpha)
    print(coverage_note(log, ref))
    print(f"reference {ref.path}: {len(ref.seeds)} seeds, testbed {ref.testbed}, commit {ref.data.get('commit')}; "
          f"Holm over the metrics at alpha {ref.alpha if alpha is None else alpha:g}")
    measured = ref.data.get("held_out")
    if measured:
        print(f"  its false-alarm rate, measured on {measured['runs']} held-out seeds: {measured['departed']} departed "
              f"(95 % interval {100 * measured['ci95'][0]:.1f}-{100 * measured['ci95'][1]:.1f} %)")
    if ref.testbed and log.testbed and ref.testbed != log.testbed:
        print(f"note: the reference's runs started from {ref.testbed}, this run from {log.testbed}: another starting "
              "policy, whose runs the bands do not describe")
    if log.config_text and ref.config_text:
        diff = config_differences(ref.config_text, log.config_text, log.config_path)
        speed = [d for d in diff if d.split(":", 1)[0] in SPEED_ONLY_KEYS]
        other = [d for d in config_matches(ref.config_text, log.config_text) if d not in speed]
        if other:
            print(f"note: the run's config differs from the reference's: {'; '.join(other[:5])}"
                  + (" ..." if len(other) > 5 else ""))
        if speed:
            print(f"note: the run differs from the reference's config in speed settings that keep the maths "
                  f"(other floating-point sums, the same distribution of runs): {'; '.join(speed)}")
    print(format_table(results))
    code = exit_code(results)
    if code == 2:
        print(f"aspo-lit compare: error: nothing to compare: no metric of {ref.path} has a complete window "
              f"in {log.source}", file=sys.stderr)
        return 2
    folder = out or log.folder or os.path.join("runs", "compare")
    print(plot_bands(log, ref, results, os.path.join(folder, f"compare-{Path(ref.path).stem}.png")))
    departed = [r.metric for r in results if r.status == "departs"]
    print(f"{'DEPARTS' if departed else 'inside'}: {len(departed)} of {len(results)} metrics outside the band"
          + (f" ({', '.join(departed)})" if departed else ""))
    return code
