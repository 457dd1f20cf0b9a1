"""Where a `fit` spends its wall time, per stage of a rollout batch, sampled with py-spy.

    pip install py-spy                      # or the `perf` extra
    python -m tools.perf.profile_fit --config conf/tiny/grpo.yaml [--batches 10] [--rate 100]
        [--torch-threads N] [--keep-raw F | --from-raw F] [--out profile.json] [-- <fit arguments>]

Runs ``python -m aspo_lit fit`` under ``py-spy record --idle`` (idle samples included, so waiting
for the reward's worker processes or a file write counts as wall time), keeps the main thread's
samples, and gives each sample inside Lightning's fit loop to a stage: validation or checkpoint
when any frame is theirs, else the stage of the innermost frame that names one (a forward inside
the old-log-prob pass is "old log-probs"). Samples outside the loop (imports, model loading, the
figures of ``on_fit_end``) are reported apart. Prints each stage's share of the loop (and its
sampled seconds, which drift from wall seconds on a loaded machine) next to the ``timing/*``
columns of the run's ``metrics.csv`` (means over the batches after the first). Options:
``--torch-threads N`` (``OMP_NUM_THREADS`` of the run), ``--keep-raw FILE`` (py-spy's stacks),
``--from-raw FILE`` (analyse kept stacks instead of running).
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# (stage, frame substrings). py-spy's frames read "Class.method (package/path.py)" (--nolineno).
# A sample inside a validation loop or a checkpoint write belongs to it wherever it sits;
# otherwise the innermost frame that names a stage decides.
ANYWHERE: list[tuple[str, tuple[str, ...]]] = [
    ("validation", ("_EvaluationLoop.", "RolloutController.evaluate")),
    ("checkpoint", ("ModelCheckpoint.", "Trainer.save_checkpoint")),
]
INNERMOST: list[tuple[str, tuple[str, ...]]] = [
    ("reward", ("Reward.batch", "_grade_in_processes", "GradingPool.")),
    ("generate", ("Engine.generate (aspo_lit/rollout",)),
    ("rollout: pack/advantages", ("RolloutController.rollout", "on_after_batch_transfer")),
    ("old log-probs", ("ASPOModule._pre_update_pass",)),
    ("update", ("ASPOModule.training_step",)),
    ("logging", ("LightningModule.log", "_LoggerConnector.", "CSVLogger.", "ExperimentWriter.", "_ResultCollection.")),
    ("callbacks", ("(aspo_lit/callbacks", "(lightning/pytorch/callbacks")),
    ("optimizer/scheduler hooks", ("optimizer", "lr_scheduler")),
]
FIT_MARK = "_FitLoop."  # the training loop; outside it: imports, model loading, on_fit_end's figures
OUTSIDE = "outside the fit loop"


def classify(stack: list[str]) -> str:
    """The stage of one sample; `stack` runs root to leaf."""
    if not any(FIT_MARK in f for f in stack):
        return OUTSIDE
    for stage, marks in ANYWHERE:
        if any(m in f for f in stack for m in marks):
            return stage
    for frame in reversed(stack):
        for stage, marks in INNERMOST:
            if any(m in frame for m in marks):
                return stage
    return "loop: other"


def main_thread_samples(raw: Path) -> list[tuple[list[str], int]]:
    """(stack, count) of the thread with the most samples (the main thread runs the whole fit)."""
    by_thread: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in raw.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        frames = stack_text.split(";")
        # --threads puts "thread (<id>): <name>" first (the name is sometimes missing)
        thread = next((f.split(")")[0] for f in frames if f.startswith("thread (")), "?")
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
    p.add_argument("--torch-threads", type=int, default=None, help="OMP_NUM_THREADS for the run (default: torch's)")
    p.add_argument("--keep-raw", default=None, help="copy py-spy's raw stacks here")
    p.add_argument("--out", default=None, help="write the profile as JSON here")
    p.add_argument("--from-raw", default=None, help="analyse stacks kept by --keep-raw instead of running")
    p.add_argument("fit_args", nargs="*", help="more `fit` arguments (after --)")
    args = p.parse_args(argv)

    if args.from_raw:
        samples, timings = main_thread_samples(Path(args.from_raw)), {}
    else:
        samples, timings = record(args)
    report(args, samples, timings)
    return 0


def record(args) -> tuple[list[tuple[list[str], int]], dict[str, float]]:
    """Run the fit under py-spy; its main thread's samples and its metrics.csv timings."""
    with tempfile.TemporaryDirectory(prefix="profile_fit_") as tmp:
        raw = Path(tmp) / "stacks.txt"
        fit = [sys.executable, "-m", "aspo_lit", "fit", "--config", args.config,
               f"--trainer.max_steps={args.batches * args.steps_per_batch}",
               f"--trainer.logger.init_args.save_dir={tmp}", "--trainer.logger.init_args.name=run",
               "--trainer.logger.init_args.version=0", "--trainer.enable_progress_bar=false", *args.fit_args]
        cmd = [args.py_spy, "record", "--idle", "--threads", "--nolineno", "--nonblocking", "-r", str(args.rate),
               "-f", "raw", "-o", str(raw), "--", *fit]
        print(" ".join(cmd), flush=True)
        env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.torch_threads)} if args.torch_threads else {}))
        subprocess.run(cmd, check=True, cwd=REPO, env=env)
        if args.keep_raw:
            shutil.copy(raw, args.keep_raw)
        return main_thread_samples(raw), timing_means(Path(tmp) / "run" / "version_0" / "metrics.csv")


def report(args, samples, timings) -> None:
    seconds: dict[str, float] = collections.Counter()
    for stack, count in samples:
        seconds[classify(stack)] += count / args.rate
    in_loop = sum(v for k, v in seconds.items() if k != OUTSIDE)
    # sampled seconds are not wall seconds (py-spy's clock drifts on a loaded machine): read the
    # shares, and metrics.csv for seconds
    print(f"\n{args.config}: {args.batches} rollout batches, {in_loop:.1f} sampled s in the training loop "
          f"({in_loop / args.batches:.3f} per batch), outside it (start-up, fit-end figures) {seconds[OUTSIDE]:.1f} s")
    print("\n| stage | sampled s per rollout batch | share of the loop |")
    print("|---|---|---|")
    for stage, sec in sorted(seconds.items(), key=lambda kv: -kv[1]):
        if stage == OUTSIDE:
            continue
        print(f"| {stage} | {sec / args.batches:.3f} | {100 * sec / in_loop:.1f} % |")
    print("\nmetrics.csv (mean over batches 2..):")
    for key, value in timings.items():
        print(f"  {key}: {value:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"config": args.config, "batches": args.batches,
                                              "seconds": dict(seconds), "timings": timings}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
