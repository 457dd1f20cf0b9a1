"""Where a `fit` spends its wall time, per stage of a rollout batch, sampled with py-spy.

    pip install py-spy                      # or the `perf` extra
    python perf/profile_fit.py --config conf/tiny/grpo.yaml [--batches 10] [--rate 100]
        [--out profile.json] [-- <more fit arguments>]

Runs ``python -m aspo_lit fit`` under ``py-spy record --idle`` (idle samples included, so waiting
for the reward's worker processes or a file write counts as wall time), keeps the main thread's
samples, and gives each sample to the stage of the innermost frame that names one (a forward
inside the old-log-prob pass is "old log-probs", a ``generate`` inside validation is
"validation"). Samples before the first rollout batch and after the last are start-up and
tear-down. Prints seconds per rollout batch for each stage next to the ``timing/*`` columns of
the run's ``metrics.csv`` (means over the batches after the first), so the two can be checked
against each other.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (stage, frame substrings): the innermost frame that matches any substring names the stage.
# Frames read "function (path)" with py-spy's --nolineno, paths shortened to the package.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("validation", ("_run_validation", "_evaluation_loop", "evaluation_loop.py")),
    ("checkpoint", ("_save_checkpoint", "save_checkpoint (", "_save_last_checkpoint", "_save_topk_checkpoint")),
    ("logging", ("log_metrics (lightning", "save (lightning", "_CSVExperimentWriter", "logger_connector")),
    ("reward", ("batch (aspo_lit/rewards", "_grade_in_processes")),
    ("generate", ("generate (aspo_lit/rollout",)),
    ("rollout: pack/advantages", ("rollout (data_modules",)),
    ("old log-probs", ("_pre_update_pass",)),
    ("update", ("training_step (aspo_lit",)),
    ("callbacks", ("aspo_lit/callbacks",)),
    ("optimizer/scheduler hooks", ("optimizer", "lr_scheduler")),
]
LOOP_MARK = "run_training_batch"  # Lightning's per-batch entry (advance of the training epoch loop)
FIT_MARK = "_run_stage"


def classify(stack: list[str]) -> str:
    """The stage of one sample; `stack` runs root to leaf."""
    for stage, marks in STAGES[:1]:
        if any(m in f for f in stack for m in marks):
            return stage
    for frame in reversed(stack):
        for stage, marks in STAGES[1:]:
            if any(m in frame for m in marks):
                return stage
    if any(FIT_MARK in f for f in stack):
        return "loop: other"
    return "start-up / tear-down"


def main_thread_samples(raw: Path) -> list[tuple[list[str], int]]:
    """(stack, count) of the thread with the most samples (the main thread runs the whole fit)."""
    by_thread: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in raw.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        frames = stack_text.split(";")
        # --threads puts "thread (0x...)" (or the process line with --subprocesses) first
        thread = next((f for f in frames if f.startswith("thread (")), "?")
        by_thread[thread].append(([f for f in frames if not f.startswith(("thread (", "process "))], int(count)))
    return max(by_thread.values(), key=lambda rows: sum(c for _, c in rows))


def timing_means(metrics_csv: Path) -> dict[str, float]:
    rows = [r for r in csv.DictReader(metrics_csv.open()) if r.get("timing/step_s")]
    rows = rows[1:] or rows
    keys = sorted(k for k in rows[0] if k.startswith("timing/"))
    return {k: statistics.fmean(float(r[k]) for r in rows if r.get(k)) for k in keys}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a fit config, e.g. conf/tiny/grpo.yaml")
    p.add_argument("--batches", type=int, default=10, help="rollout batches to run")
    p.add_argument("--steps-per-batch", type=int, default=4, help="optimizer steps per rollout batch")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"))
    p.add_argument("--out", default=None, help="write the profile as JSON here")
    p.add_argument("fit_args", nargs="*", help="more `fit` arguments (after --)")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="profile_fit_") as tmp:
        raw = Path(tmp) / "stacks.txt"
        fit = [sys.executable, "-m", "aspo_lit", "fit", "--config", args.config,
               f"--trainer.max_steps={args.batches * args.steps_per_batch}",
               f"--trainer.logger.init_args.save_dir={tmp}", "--trainer.logger.init_args.name=run",
               "--trainer.logger.init_args.version=0", "--trainer.enable_progress_bar=false", *args.fit_args]
        cmd = [args.py_spy, "record", "--idle", "--threads", "--nolineno", "--nonblocking", "-r", str(args.rate),
               "-f", "raw", "-o", str(raw), "--", *fit]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=REPO)
        samples = main_thread_samples(raw)
        timings = timing_means(Path(tmp) / "run" / "version_0" / "metrics.csv")

    seconds: dict[str, float] = collections.Counter()
    for stack, count in samples:
        seconds[classify(stack)] += count / args.rate
    in_loop = sum(v for k, v in seconds.items() if k != "start-up / tear-down")
    print(f"\n{args.config}: {args.batches} rollout batches, {in_loop:.1f} s in the training loop "
          f"({in_loop / args.batches:.3f} s per batch), start-up + tear-down {seconds['start-up / tear-down']:.1f} s")
    print("\n| stage | s per rollout batch | share of the loop |")
    print("|---|---|---|")
    for stage, sec in sorted(seconds.items(), key=lambda kv: -kv[1]):
        if stage == "start-up / tear-down":
            continue
        print(f"| {stage} | {sec / args.batches:.3f} | {100 * sec / in_loop:.1f} % |")
    print("\nmetrics.csv (mean over batches 2..):")
    for key, value in timings.items():
        print(f"  {key}: {value:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"config": args.config, "batches": args.batches,
                                              "seconds": dict(seconds), "timings": timings}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
