"""Seconds per rollout batch at ``data.max_staleness`` k = 0, 1, 2, side by side in one run.

    python -m tools.perf.bench_staleness [--config conf/tiny/aspo.yaml] [--ks 0 1 2] [--rounds 2]
        [--lengths 3 9] [--out results.json]

k = 0 is the synchronous loop (the trainer's process generates, with its one torch thread); k >= 1
generates in the engine process with one thread of its own while the trainer trains with one
(``OMP_NUM_THREADS=1``, ``data.engine_threads=1``): on a 2-core machine, a core each. Per k and
round, two fits (``--lengths`` short and long, in rollout batches, no validation) run as
subprocesses; the seconds per rollout batch are ``(t_long - t_short) / (n_long - n_short)``, so
start-up (imports, the engine process's start, model loading) cancels. The order of the k values
rotates between rounds, so a change of load hits each alike. Beside it, from the long run's
metrics: the mean time the trainer waited for a batch (``timing/rollout_wait_s``), the engine's
generation seconds (``timing/rollout_s``), and the mean staleness.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def updates_per_batch(config: str) -> int:
    import yaml

    cfg = yaml.safe_load((REPO / config).read_text())
    data, model = cfg["data"]["init_args"], cfg["model"]
    return data["batch_size"] // model.get("mini_batch_size", data["batch_size"]) * model.get("ppo_epochs", 1)


def fit(config: str, k: int, batches: int, out: Path) -> float:
    """Wall seconds of one fit of ``batches`` rollout batches at staleness ``k``."""
    args = [sys.executable, "-m", "aspo_lit", "fit", "--config", config,
            f"--trainer.max_steps={batches * updates_per_batch(config)}", "--trainer.val_check_interval=null",
            "--data.init_args.num_val=0", "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={out}", f"--trainer.logger.init_args.name=k{k}_n{batches}",
            f"--data.init_args.max_staleness={k}", "--data.init_args.engine_threads=1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"fit failed (k={k}, {batches} batches):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def means(run: Path, keys: tuple[str, ...]) -> dict[str, float]:
    values: dict[str, list[float]] = {k: [] for k in keys}
    for path in run.glob("version_*/metrics.csv"):
        with path.open() as f:
            for row in csv.DictReader(f):
                for k in keys:
                    if row.get(k):
                        values[k].append(float(row[k]))
    return {k: statistics.fmean(v) if v else float("nan") for k, v in values.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="conf/tiny/aspo.yaml")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs=2, default=[3, 9])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    short, long = args.lengths
    keys = ("timing/rollout_wait_s", "timing/rollout_s", "rollout/staleness")
    per_batch: dict[int, list[float]] = {k: [] for k in args.ks}
    inside: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = args.ks[r % len(args.ks):] + args.ks[:r % len(args.ks)]
            for k in order:
                out = Path(tmp) / f"round{r}"
                t_short, t_long = fit(args.config, k, short, out), fit(args.config, k, long, out)
                per_batch[k].append((t_long - t_short) / (long - short))
                inside[k] = means(out / f"k{k}_n{long}", keys)
                print(f"round {r} k={k}: {per_batch[k][-1]:.3f} s per rollout batch", flush=True)
    base = statistics.median(per_batch[args.ks[0]])
    print(f"\n{args.config}, seconds per rollout batch by difference ({long} - {short} batches), "
          f"{args.rounds} rounds; trainer and engine one torch thread each")
    print("| k | per round (s) | median (s) | vs k=" + str(args.ks[0]) + " | trainer waited (s/batch) | engine generated (s/batch) | staleness |")
    print("|---|---|---|---|---|---|---|")
    table = []
    for k in args.ks:
        med = statistics.median(per_batch[k])
        m = inside[k]
        table.append({"k": k, "rounds": per_batch[k], "median": med, "ratio": med / base, **m})
        print(f"| {k} | {' / '.join(f'{x:.2f}' for x in per_batch[k])} | {med:.2f} | {med / base:.2f} | "
              f"{m['timing/rollout_wait_s']:.2f} | {m['timing/rollout_s']:.2f} | {m['rollout/staleness']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"config": args.config, "lengths": args.lengths, "cores": os.cpu_count(),
                                        "results": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
