"""A study's results as its report reads them: each run's logged metrics merged over its
``version_*`` folders (a resumed run adds one), the head and tail means its verdicts compare, and
:func:`collect`, every planned run's status with the finished runs' metrics in one DataFrame.
Read by the claims (``experiments.claims``), the page (``experiments.render``) and the regime
properties (``experiments.regime``)."""

from __future__ import annotations

import glob
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from aspo_lit.training.figures import accuracy_key, read_metrics
from experiments.runner import read_json, run_name

if TYPE_CHECKING:
    from experiments.study import Study

ACCURACY = "val/avg@K"  # placeholder resolved to the runs' val/avg@<K> column
COLUMNS = ["run", "metric", "step", "value"]


def version_dirs(run_dir: Path) -> list[Path]:
    """The run's ``version_*`` folders in numeric order (a resume adds one)."""
    def number(path: str) -> int:
        match = re.search(r"version_(\d+)$", path)
        return int(match.group(1)) if match else -1

    return [Path(p) for p in sorted(glob.glob(str(Path(run_dir) / "version_*")), key=number)]


def read_run(run_dir: str | os.PathLike) -> pd.DataFrame:
    """``metric, step, value`` of a run, merged over its ``version_*/metrics.csv``: a step logged
    twice keeps the later version's value; sorted by metric and step."""
    frames = [pd.DataFrame({"metric": key, "step": steps, "value": values})
              for version in version_dirs(Path(run_dir)) if (version / "metrics.csv").is_file()
              for key, (steps, values) in read_metrics(str(version / "metrics.csv")).items()]
    if not frames:
        return pd.DataFrame({"metric": pd.Series(dtype=str), "step": pd.Series(dtype=float),
                             "value": pd.Series(dtype=float)})
    merged = pd.concat(frames, ignore_index=True).drop_duplicates(["metric", "step"], keep="last")
    return merged.sort_values(["metric", "step"], kind="stable", ignore_index=True)


def head_mean(values: Sequence[float], fraction: float = 0.2) -> float:
    """Mean over the first ``fraction`` of the logged points (at least one)."""
    values = np.asarray(values, dtype=np.float64)
    return float(np.mean(values[:max(1, math.ceil(fraction * len(values)))])) if len(values) else math.nan


def tail_mean(values: Sequence[float], fraction: float = 0.2) -> float:
    """Mean over the last ``fraction`` of the logged points (at least one)."""
    values = np.asarray(values, dtype=np.float64)
    return float(np.mean(values[-max(1, math.ceil(fraction * len(values))):])) if len(values) else math.nan


def run_statistics(metrics: pd.DataFrame, fraction: float) -> pd.DataFrame:
    """Per ``(run, metric)``: the reductions of its logged values the report uses."""
    if metrics.empty:
        return pd.DataFrame(columns=["head_mean", "tail_mean", "last_eval", "max", "mean", "first"],
                            index=pd.MultiIndex.from_tuples([], names=["run", "metric"]), dtype=float)
    return metrics.groupby(["run", "metric"], sort=False)["value"].agg(
        head_mean=lambda v: head_mean(v.to_numpy(), fraction), tail_mean=lambda v: tail_mean(v.to_numpy(), fraction),
        last_eval="last", max="max", mean="mean", first="first")


@dataclass
class Results:
    study: Study
    runs: pd.DataFrame          # per planned run (index: name): kind, loss, seed, status, rc, log, wall_s, health
    metrics: pd.DataFrame       # run, metric, step, value: finished runs only
    stats: pd.DataFrame         # run_statistics(metrics)
    accuracy_key: str
    config: dict                # the first fit run's saved LightningCLI config (budget section)
    invocations: list[dict]
    rows: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rows = self.metrics.groupby(["run", "metric"], sort=False).indices if len(self.metrics) else {}

    @property
    def pass_key(self) -> str:
        return self.accuracy_key.replace("avg@", "pass@")

    @property
    def val_k(self) -> str:
        return self.accuracy_key.rsplit("@", 1)[-1]

    @property
    def fit_names(self) -> list[str]:
        return [run_name(loss, s) for s in self.study.seeds for loss in self.study.losses]

    def series(self, run: str, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(steps, values)`` of a finished run's metric."""
        rows = self.rows.get((run, metric))
        if rows is None:
            return None
        return self.metrics["step"].to_numpy()[rows], self.metrics["value"].to_numpy()[rows]

    def per_seed(self, loss: str, metric: str, statistic: str) -> np.ndarray:
        """One number per seed of ``loss`` (NaN where the run has no such metric)."""
        key = self.accuracy_key if metric == ACCURACY else metric
        index = pd.MultiIndex.from_tuples([(run_name(loss, s), key) for s in self.study.seeds])
        return self.stats[statistic].reindex(index).to_numpy(dtype=np.float64)

    def by_seed(self, columns: Mapping[str, tuple[str, str]]) -> pd.DataFrame:
        """One row per ``(loss, seed)`` of the grid, one column per ``name: (metric, statistic)``."""
        index = pd.MultiIndex.from_product([self.study.losses, self.study.seeds], names=["loss", "seed"])
        return pd.DataFrame({name: np.concatenate([self.per_seed(loss, metric, stat) for loss in self.study.losses])
                             for name, (metric, stat) in columns.items()}, index=index)


def saved_config(run_dir: Path) -> dict:
    import yaml

    for version in reversed(version_dirs(run_dir)):
        path = version / "config.yaml"
        if path.is_file():
            try:
                return yaml.safe_load(path.read_text()) or {}
            except Exception:  # noqa: BLE001 - a config we cannot parse only costs the budget table
                return {}
    return {}


def collect(study: Study) -> Results:
    """Every planned run's status and markers; the metrics of the finished ones (a partial run's
    last value is not final, so only finished runs enter the figures, tables and verdicts)."""
    rows, frames = [], []
    for run in study.plan():
        metrics = read_run(run.dir)
        failure = read_json(run.failed_marker) if run.failed_marker.exists() else {}
        status = ("done" if run.done_marker.exists() else "failed" if run.failed_marker.exists()
                  else "partial" if len(metrics) else "missing")
        health = next((read_json(v / "health.json") for v in reversed(version_dirs(run.dir))
                       if (v / "health.json").is_file()), {})
        rows.append({"name": run.name, "kind": run.kind, "loss": run.loss, "seed": run.seed, "status": status,
                     "rc": str(failure.get("rc")), "log": str(failure.get("log")),
                     "wall_s": read_json(run.done_marker).get("wall_s") if status == "done" else None,
                     "health": health.get("verdict")})
        if status == "done":
            frames.append(metrics.assign(run=run.name)[COLUMNS])
    runs = pd.DataFrame(rows).set_index("name")
    metrics = (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)).sort_values(
        ["run", "metric", "step"], kind="stable", ignore_index=True)
    acc_key = accuracy_key([set(g) for _, g in metrics.groupby("run", sort=False)["metric"]]) if len(metrics) else ""
    if not acc_key.startswith("val/"):
        acc_key = "val/avg@4"
    config = next((c for c in (saved_config(r.dir) for r in study.plan() if r.kind == "fit") if c), {})
    return Results(study, runs, metrics, run_statistics(metrics, float(study.tail_fraction)), acc_key, config,
                   read_json(study.out_dir / "study.json").get("invocations", []))
