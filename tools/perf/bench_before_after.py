"""This checkout against an earlier one on the same work: seconds per rollout batch, side by side.

    git worktree add ../before 52bf3ba          # the code before the performance work
    python -m tools.perf.bench_before_after --before ../before [--config conf/tiny/aspo_long.yaml]
        [--batches 6] [--rounds 2] [--variant NAME="ARGS"]... [--out results.json] [-- <fit arguments>]

Each side is one ``python -m aspo_lit fit`` in its own process, from its own checkout
(``PYTHONPATH`` and working directory), with one torch thread (``OMP_NUM_THREADS=1``: the
engine's sampling loop then draws ``generate``'s samples bit for bit, so both sides train on the
same responses), no held-out evaluation, and the testbed models of this checkout's cache
(``$ASPO_LIT_CACHE``, so both load the same weights). Sides: ``before`` (the other checkout),
``now`` (this one), and every ``--variant NAME="ARGS"`` (this checkout with more fit arguments,
e.g. ``--variant share="--model.share_prompt=true"``). The fit arguments after ``--`` go to
every side. Sides run one after another, in an order rotated every round, so a change of load
hits each alike; run nothing else meanwhile.

Per run it reads ``metrics.csv``: the medians over the rollout batches after the first of
``timing/rollout_s`` (generation), ``timing/reward_s``, ``timing/old_logprob_s`` and
``timing/update_s``, and their sum (the stages of a batch). It prints, per round, each side's
stages and its ratio to ``before``, and whether the sides drew the same samples (their
``response/length_mean`` per batch equal): when they did, they did the same work.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAGES = ("timing/rollout_s", "timing/reward_s", "timing/old_logprob_s", "timing/update_s")


def run_fit(checkout: Path, args: list[str], out_dir: Path, log: Path) -> dict:
    """One `fit` from ``checkout``; the medians of its stage timings and its samples' lengths."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(checkout),
               ASPO_LIT_CACHE=os.environ.get("ASPO_LIT_CACHE", str(REPO / ".cache" / "aspo_lit")))
    cmd = [sys.executable, "-m", "aspo_lit", "fit", *args, f"--trainer.logger.init_args.save_dir={out_dir}",
           "--trainer.enable_progress_bar=false", "--data.init_args.num_val=0"]
    with log.open("w") as handle:
        done = subprocess.run(cmd, cwd=checkout, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"fit from {checkout} failed (exit {done.returncode}); its output: {log}")
    rows = list(csv.DictReader(next(out_dir.glob("*/version_*/metrics.csv")).open()))
    timed = [r for r in rows if r.get("timing/update_s")]
    if len(timed) < 2:
        raise SystemExit(f"{log}: fewer than 2 rollout batches logged; raise --batches")
    result = {key: statistics.median(float(r[key]) for r in timed[1:]) for key in STAGES}
    result["stages_s"] = sum(result[key] for key in STAGES)
    result["lengths"] = [float(r["response/length_mean"]) for r in timed]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, type=Path, help="the earlier checkout (a git worktree)")
    p.add_argument("--config", default="conf/tiny/aspo_long.yaml")
    p.add_argument("--batches", type=int, default=6, help="rollout batches per run")
    p.add_argument("--steps-per-batch", type=int, default=None,
                   help="optimizer steps per rollout batch (default: read from --print_config)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variant", action="append", default=[], metavar='NAME="ARGS"')
    p.add_argument("--out", default=None)
    p.add_argument("fit_args", nargs="*", help="fit arguments for every side (after --)")
    args = p.parse_args(argv)

    before = args.before.resolve()
    if not (before / "aspo_lit").is_dir():
        raise SystemExit(f"--before {before}: not an aspo-lit checkout")
    sides = {"before": (before, []), "now": (REPO, [])}
    for spec in args.variant:
        name, _, extra = spec.partition("=")
        if not name or name in sides:
            raise SystemExit(f"--variant {spec!r}: give NAME=\"ARGS\" with a new name")
        sides[name] = (REPO, shlex.split(extra))
    steps = args.steps_per_batch or _steps_per_batch(args.config, args.fit_args)
    common = ["--config", args.config, f"--trainer.max_steps={args.batches * steps}", *args.fit_args]

    results: list[dict] = []
    names = list(sides)
    with tempfile.TemporaryDirectory(prefix="before_after_") as tmp:
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                checkout, extra = sides[name]
                run_dir = Path(tmp) / f"r{round_}_{name}"
                result = run_fit(checkout, common + extra, run_dir, Path(tmp) / f"r{round_}_{name}.log")
                results.append({"round": round_, "side": name, **result})
                print(f"round {round_} {name}: {result['stages_s']:.3f} s per batch", flush=True)

    print(f"\n{args.config} {' '.join(args.fit_args)}: {args.batches} rollout batches, medians of batches 2-{args.batches}, "
          "one torch thread\n")
    print("| round | side | rollout_s | reward_s | old_logprob_s | update_s | stages per batch | ratio to before |"
          " same samples |")
    print("|---|---|---|---|---|---|---|---|---|")
    for round_ in range(args.rounds):
        row = {r["side"]: r for r in results if r["round"] == round_}
        for name in names:
            r = row[name]
            cells = " | ".join(f"{r[key]:.3f}" for key in STAGES)
            print(f"| {round_} | {name} | {cells} | {r['stages_s']:.3f} | **{r['stages_s'] / row['before']['stages_s']:.2f}**"
                  f" | {'yes' if r['lengths'] == row['before']['lengths'] else 'no'} |")
    for name in names[1:]:
        ratios = [r["stages_s"] / b["stages_s"] for r in results if r["side"] == name
                  for b in results if b["side"] == "before" and b["round"] == r["round"]]
        print(f"\n{name} / before: " + ", ".join(f"{x:.2f}" for x in ratios) + f" (median {statistics.median(ratios):.2f})")
    if args.out:
        Path(args.out).write_text(json.dumps({"config": args.config, "fit_args": args.fit_args, "sides":
                                              {n: [str(c), e] for n, (c, e) in sides.items()}, "results": results},
                                             indent=2))
    return 0


def _steps_per_batch(config: str, fit_args: list[str]) -> int:
    """Optimizer steps per rollout batch of the effective config: prompts / mini-batch x epochs."""
    import yaml

    out = subprocess.run([sys.executable, "-m", "aspo_lit", "fit", "--config", config, *fit_args, "--print_config"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    cfg = yaml.safe_load(out)
    prompts = cfg["data"]["init_args"]["batch_size"]
    model = cfg["model"]
    return (prompts // model["mini_batch_size"]) * model["ppo_epochs"]


if __name__ == "__main__":
    sys.exit(main())
