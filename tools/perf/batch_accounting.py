"""Where a rollout batch's wall clock goes: the ``timing/*`` accounting of a fit, part by part.

    python -m tools.perf.batch_accounting --config conf/tiny/aspo.yaml [--torch-threads 1] [--skip-first 1]
        [-- <more fit arguments, e.g. --trainer.max_steps=80>]
    python -m tools.perf.batch_accounting --metrics runs/NAME/version_0/metrics.csv [...]

Runs ``python -m aspo_lit fit`` in this process (or reads a run's ``metrics.csv``) and prints the
mean over its rollout batches, after the first ``--skip-first``, of ``timing/batch_s`` (the wall
clock between two batches' statistics) and of the parts that sum to it (`TrainingStats`, through
`aspo_lit.callbacks.batch_timer`): the DataModule (rollout, reward and weight push inside it), the
training step (old log-probs and update inside it), each callback, validation, Lightning's loop and
what no hook covers, each with its share of the batch. ``tools/perf/bench_peer.py`` prints the same table
for its aspo-lit runs.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: The stages measured inside a part of the accounting (in it, not beside it).
INSIDE = {"timing/rollout_s": "timing/data_s", "timing/reward_s": "timing/data_s",
          "timing/weight_sync_s": "timing/data_s", "timing/engine_wake_s": "timing/data_s",
          "timing/engine_sleep_s": "timing/data_s", "timing/old_logprob_s": "timing/train_step_s",
          "timing/update_s": "timing/train_step_s"}


def stage_means(metrics_csv: Path, skip_first: int = 1) -> dict[str, float]:
    """Mean of every ``timing/*`` column over the rollout batches after the first `skip_first`."""
    rows = [r for r in csv.DictReader(Path(metrics_csv).open()) if r.get("timing/step_s")]
    rows = rows[skip_first:] or rows
    keys = sorted(k for k in rows[0] if k.startswith("timing/"))
    return {k: statistics.fmean(float(r[k]) for r in rows if r.get(k)) for k in keys}


def accounting_table(columns: dict[str, dict[str, float]]) -> str:
    """A Markdown table: one column per run (``{name: stage_means(...)}``), a row per part of
    ``timing/batch_s`` (largest first, the stages inside a part indented under it), seconds and
    share of the batch. Runs without ``timing/batch_s`` are left out."""
    columns = {name: s for name, s in columns.items() if s.get("timing/batch_s")}
    if not columns:
        return "(no timing/batch_s in these runs)\n"
    first = next(iter(columns.values()))
    parts = sorted((k for k in first if k not in INSIDE and k not in ("timing/batch_s", "timing/step_s")),
                   key=lambda k: -first[k])
    logged = {k for stages in columns.values() for k in stages}   # an engine without sleep mode logs no wake/sleep
    rows = ["timing/batch_s"] + [r for k in parts
                                 for r in [k] + [i for i, part in INSIDE.items() if part == k and i in logged]]
    out = ["| part | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for key in rows:
        label = f"&nbsp;&nbsp;&nbsp;{key}" if key in INSIDE else f"`{key}`"
        cells = []
        for stages in columns.values():
            seconds = stages.get(key, float("nan"))
            cells.append(f"{seconds:.3f} ({seconds / stages['timing/batch_s']:.0%})")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def run_fit(config: str, extra: list[str], out: Path) -> Path:
    """One fit of ``config`` in this process, logging to ``out``; its metrics.csv."""
    from aspo_lit.__main__ import main

    args = ["fit", "--config", config, *extra, f"--trainer.logger.init_args.save_dir={out}",
            "--trainer.logger.init_args.name=accounting", "--trainer.logger.init_args.version=0",
            "--trainer.enable_progress_bar=false"]
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    if code not in (0, None):
        raise SystemExit(f"fit failed ({code}): {' '.join(args)}")
    return out / "accounting" / "version_0" / "metrics.csv"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a fit config to run (conf/tiny/aspo.yaml)")
    source.add_argument("--metrics", type=Path, nargs="+", help="metrics.csv of runs already made")
    p.add_argument("--skip-first", type=int, default=1, help="batches left out of the means (start-up)")
    p.add_argument("--torch-threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    if args.metrics:
        columns = {str(path): stage_means(path, args.skip_first) for path in args.metrics}
    else:
        with tempfile.TemporaryDirectory(prefix="accounting_") as tmp:
            metrics = run_fit(args.config, extra, Path(tmp))
            columns = {args.config: stage_means(metrics, args.skip_first)}
    print(accounting_table(columns))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
