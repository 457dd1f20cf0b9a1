"""A run's logged metrics as the study reads them: merged over its ``version_*`` folders (a resumed
run adds one), and the head and tail means its verdicts compare. Read by the report
(``experiments.report``) and the regime properties (``experiments.regime``)."""

from __future__ import annotations

import glob
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from aspo_lit.figures import read_metrics


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
