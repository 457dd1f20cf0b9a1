"""One config over seeds: the runs, then what each run's end-of-run summary says, with the spread.

    python -m experiments.seeds --config conf/tiny/aspo.yaml --seeds 0 1 2 3 4 --out runs/demo_seeds
    make demo-seeds                      # the demo config over seeds 0-4 (docs/demo.md)

Each seed is one ``python -m aspo_lit fit`` with ``--seed_everything=<seed>`` (the run's one seed,
aspo_lit/maths/seeding.py) into ``<out>/s<seed>/version_0``; words after ``--`` are passed to every run
(e.g. ``-- --model.lr=3e-4``). A seed that finished (its ``done`` marker, written when its fit exits
0) is not run again. The table gives per seed what ``RunSummary`` prints: held-out ``val/avg@K`` at the first
and last evaluation (the first is the untrained policy when the config has ``ValBeforeTrain``), the
reward as the mean of the first and last batches (``end_window``), and the health verdict (replayed by
today's rules over the series the run logged, in the run's own window); then the
mean and SD of each rise over seeds and how many seeds rose. A claim about the demo is a claim about
this table, not about one seed. The runs double as a reference's seeds:
``python -m aspo_lit reference <out>/s*/version_0 --out ref.json`` (docs/compare.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aspo_lit.callbacks.health import CLIP, ENTROPY, KL, REWARD, assess_health
from aspo_lit.callbacks.summary import SUMMARY_WINDOW, end_window
from aspo_lit.training.figures import read_metrics
from experiments.runner import run_env

VAL_PREFIX = "val/avg@"


@dataclass(frozen=True)
class SeedOutcome:
    """What one seed's run ended with (``nan`` where the run did not log it)."""
    seed: int
    val_key: str
    val_start: float
    val_end: float
    reward_start: float
    reward_end: float
    batches: int
    health: str
    reason: str

    @property
    def val_rise(self) -> float:
        return self.val_end - self.val_start

    @property
    def reward_rise(self) -> float:
        return self.reward_end - self.reward_start


def seed_outcome(run_dir: str | os.PathLike, seed: int, window: int = SUMMARY_WINDOW) -> SeedOutcome:
    """Read a finished run (``metrics.csv`` and ``health.json`` in its log folder)."""
    run_dir = Path(run_dir)
    series = read_metrics(str(run_dir / "metrics.csv"))
    val_keys = sorted(k for k in series if k.startswith(VAL_PREFIX))
    val = np.asarray(series[val_keys[0]][1], dtype=np.float64) if val_keys else np.array([])
    reward = np.asarray(series.get(REWARD, ((), ()))[1], dtype=np.float64)
    w = end_window(reward.size, window) if reward.size else 1
    health_file = run_dir / "health.json"
    health = json.loads(health_file.read_text()) if health_file.exists() else {}
    if "thresholds" in health:   # the verdict by today's rules, from the series the run logged, in its window
        history = {k: np.asarray(series[k][1]) for k in (ENTROPY, REWARD, CLIP, KL) if k in series}
        health["verdict"], health["reason"] = assess_health(history, window=health["thresholds"]["window"])
    nan = float("nan")
    return SeedOutcome(
        seed, val_keys[0] if val_keys else "val/avg@K",
        float(val[0]) if val.size else nan, float(val[-1]) if val.size else nan,
        float(reward[:w].mean()) if reward.size else nan, float(reward[-w:].mean()) if reward.size else nan,
        int(reward.size), str(health.get("verdict", "n/a")), str(health.get("reason", "")))


def _spread(values: list[float]) -> str:
    x = np.asarray(values, dtype=np.float64)
    sd = float(x.std(ddof=1)) if x.size > 1 else float("nan")
    return f"{x.mean():+.3f} (SD {sd:.3f}), {int((x > 0).sum())}/{x.size} up"


def outcomes_table(outcomes: list[SeedOutcome]) -> str:
    """Markdown: one row per seed, then the spread over seeds."""
    if not outcomes:
        return "(no finished runs)"
    val_key, w = outcomes[0].val_key, end_window(outcomes[0].batches)
    lines = [f"| seed | {val_key} first → last evaluation | reward, first → last {w} batches | health |",
             "|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.seed} | {o.val_start:.3f} → {o.val_end:.3f} ({o.val_rise * 100:+.1f} pts) | "
                     f"{o.reward_start:.3f} → {o.reward_end:.3f} ({o.reward_rise:+.3f}) | {o.health} |")
    healthy = sum(o.health == "healthy" for o in outcomes)
    lines.append(f"| over {len(outcomes)} seeds | {_spread([o.val_rise for o in outcomes])} | "
                 f"{_spread([o.reward_rise for o in outcomes])} | {healthy}/{len(outcomes)} healthy |")
    return "\n".join(lines)


def fit_command(configs: list[str], seed: int, out: Path, extra: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "aspo_lit", "fit"]
    for config in configs:
        argv += ["--config", config]
    return argv + [f"--seed_everything={seed}", f"--trainer.logger.init_args.save_dir={out}",
                   f"--trainer.logger.init_args.name=s{seed}", "--trainer.logger.init_args.version=0",
                   "--trainer.enable_progress_bar=false", *extra]


def run_seeds(configs: list[str], seeds: list[int], out: Path, extra: list[str], jobs: int) -> list[int]:
    """Train every seed not finished yet, ``jobs`` at a time (the cores shared out); the seeds that failed."""
    todo = [s for s in seeds if not (out / f"s{s}" / "done").exists()]
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))

    def one(seed: int) -> int:
        log = out / f"s{seed}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as handle:
            code = subprocess.call(fit_command(configs, seed, out, extra), stdout=handle, stderr=subprocess.STDOUT,
                                   env=run_env(threads, os.environ))
        if code == 0:
            (out / f"s{seed}" / "done").write_text("")
        print(f"seed {seed}: {'done' if code == 0 else f'failed (exit {code}), see {log}'}", flush=True)
        return code

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        codes = list(pool.map(one, todo))
    return [s for s, code in zip(todo, codes) if code != 0]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m experiments.seeds", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True, help="a fit config (several compose)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", type=Path, required=True, help="the runs' folder (<out>/s<seed>/version_0)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (the cores are shared out)")
    parser.add_argument("--table_only", action="store_true", help="print the table of the finished runs only")
    args = parser.parse_args(argv)
    failed = [] if args.table_only else run_seeds(args.config, args.seeds, args.out, extra, args.jobs)
    done = [s for s in args.seeds if (args.out / f"s{s}" / "done").exists()]
    print(outcomes_table([seed_outcome(args.out / f"s{s}" / "version_0", s) for s in done]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
