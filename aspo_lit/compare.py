"""Does a run behave like the reference runs of its config? Bands over seeds, per metric and window.

    python -m aspo_lit reference runs/tiny_aspo/version_* --out tiny_aspo.json   # >= 5 seeds of one config
    python -m aspo_lit compare runs/tiny_aspo/version_7 --reference tiny_aspo.json

``reference`` takes the median of each metric of each run over windows of W logged steps and stores, per
(metric, window), the seeds' mean, SD, SE and n, with the config, the commit, the seeds and the
band's k (the file format and k's derivation: docs/compare.md; the maths: :mod:`aspo_lit.bands`).
``compare`` reports per metric the first window where the run leaves ``mean ± k·SE`` (SE no lower
than the metric's median SE over windows), draws the
run over the bands, and exits 1 on any departure (0 inside; 2 when nothing can be compared).

A run is whatever :func:`aspo_lit.figures.read_metrics` reads: a log folder (``runs/NAME/version_K``),
its ``metrics.csv``, a TensorBoard folder, or ``wandb:ENTITY/PROJECT/RUN_ID``. Steps are the
logger's step, the rollout batch index (docs/metrics.md: every metric is logged once per rollout
batch), not the optimizer step. ``--reference NAME`` without a path names a reference shipped in
the package (``aspo_lit/references/NAME.json``).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from aspo_lit.bands import Cell, MetricBand, complete_windows, metric_band, prediction_k, summarize, window_medians
from aspo_lit.configs import REFERENCE_FORMAT, REFERENCE_VERSION, SHIPPED_REFERENCES, git_commit, shipped_reference
from aspo_lit.figures import WANDB_PREFIX, find_metrics_source, read_metrics

# Paper Fig. 2's dynamics plus what moves first when an update is wrong (docs/metrics.md names them).
# "@K" matches any K (val/avg@4 on the testbed, val/avg@16 on the paper's configs).
METRICS = ("train/reward_mean", "val/avg@K", "train/entropy", "clip/pos_high", "clip/neg_low", "ratio/pos_mean",
           "ratio/neg_mean", "ratio/off_policy_share", "train/kl", "train/grad_norm", "response/length_mean",
           "train/repetition_rate")
FORMAT, VERSION = REFERENCE_FORMAT, REFERENCE_VERSION
STEP_KEY = "step"
REFERENCES = SHIPPED_REFERENCES
DEFAULT_WINDOWS = 10  # --window's default: the shortest reference run in about this many windows
# config keys that differ between seeds of one config by construction (aspo_lit/seeding.py) or say
# only where the logs went
_PER_RUN_KEY = re.compile(r"^(seed_everything|ckpt_path|trainer\.logger(\..*)?|trainer\.default_root_dir|(.*\.)?seed)$")
#: Settings that keep the maths and change only the order of floating-point sums (how rows are
#: split into forward passes, whether a group's prompt is computed once; docs/performance.md): runs
#: that differ only in these draw from one distribution, so a reference's bands apply to both.
SPEED_ONLY_KEYS = frozenset({"model.share_prompt", "model.max_tokens_per_micro_batch", "model.micro_batch_size",
                             "model.logprob_chunk_size"})
#: Settings added after configs (and references) were recorded, with the value that keeps the old
#: behaviour: a config that lacks the key ran with that value (docs/staleness.md: k = 0 is the
#: synchronous loop bit for bit).
ADDED_SETTINGS = {"data.init_args.max_staleness": 0, "data.init_args.engine_threads": None}


class CompareError(ValueError):
    """Input that cannot be compared: the message names the file."""


# ----------------------------------------------------------------------------------------------
# runs

@dataclass
class RunLog:
    """One run's logged series, with what its log folder says about it."""
    path: str
    source: str                                     # the metrics file or folder read
    series: dict[str, tuple[np.ndarray, np.ndarray]]
    last_step: float
    seed: int | None = None
    config_path: str | None = None
    config_text: str | None = None

    @property
    def folder(self) -> str | None:
        """The log folder (figures go here by default); None for a W&B run."""
        if self.source.startswith(WANDB_PREFIX):
            return None
        return self.source if os.path.isdir(self.source) else os.path.dirname(self.source) or "."


def load_run(path: str) -> RunLog:
    """Read a run (:func:`aspo_lit.figures.read_metrics`) and its ``config.yaml`` (LightningCLI writes it
    next to the logs) for the seed; errors name the file."""
    path = os.fspath(path)
    try:
        source = find_metrics_source(path)
    except FileNotFoundError as err:
        raise CompareError(f"run {path}: {err}") from None
    try:
        series = read_metrics(source)
    except ImportError as err:
        raise CompareError(str(err)) from None
    except (OSError, UnicodeDecodeError, csv.Error, ValueError) as err:
        raise CompareError(f"run {source}: cannot read its metrics ({type(err).__name__}: {err})") from None
    if not series:
        raise CompareError(f"run {source}: no metric values with a '{STEP_KEY}' (not a CSVLogger metrics.csv "
                           "or TensorBoard log?)")
    run = RunLog(path, source, series, max(float(steps.max()) for steps, _ in series.values()))
    folder = run.folder
    config = os.path.join(folder, "config.yaml") if folder else None
    if config and os.path.isfile(config):
        run.config_path, run.config_text = config, Path(config).read_text()
        seed = _load_yaml(run.config_text, config).get("seed_everything")
        run.seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else None
    return run


def _load_yaml(text: str, where: str) -> dict:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise CompareError(f"{where}: not YAML ({err})") from None
    return data if isinstance(data, dict) else {}


def _flatten(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _flatten(item, f"{prefix}{i}.").items()}
    return {prefix[:-1]: value}


def config_differences(text_a: str, text_b: str, where: str = "config") -> list[str]:
    """``key: a != b`` for every config key that differs, leaving out the keys that differ between
    seeds of one config (the seeds, the logger's folder)."""
    a, b = (_flatten(_load_yaml(t, where)) for t in (text_a, text_b))

    def value(config: dict, key: str):
        return config.get(key, ADDED_SETTINGS.get(key, "<unset>"))

    keys = sorted(k for k in set(a) | set(b) if not _PER_RUN_KEY.match(k) and value(a, k) != value(b, k))
    return [f"{k}: {value(a, k)!r} != {value(b, k)!r}" for k in keys]


def resolve_metrics(names: Sequence[str], keys) -> dict[str, list[str]]:
    """``{name: the logged keys it names}``: itself, or for a name with ``@K`` every ``@<number>`` key."""
    keys = sorted(keys)
    out = {}
    for name in names:
        if "@K" in name:
            pattern = re.compile("^" + re.escape(name).replace("@K", r"@\d+") + "$")
            out[name] = [k for k in keys if pattern.match(k)]
        else:
            out[name] = [name] if name in keys else []
    return out


# ----------------------------------------------------------------------------------------------
# the reference

def default_window(runs: Sequence[RunLog]) -> int:
    """About :data:`DEFAULT_WINDOWS` windows over the shortest run."""
    return max(1, round((min(r.last_step for r in runs) + 1) / DEFAULT_WINDOWS))


def reference_cells(runs: Sequence[RunLog], key: str, window: int, min_seeds: int) -> list[Cell]:
    """The cells of one metric: each complete window that at least ``min_seeds`` runs logged it in."""
    per_run = [window_medians(*run.series[key], window, run.last_step) for run in runs if key in run.series]
    windows = sorted({w for means in per_run for w in means})
    seed_means = {w: [means[w] for means in per_run if w in means] for w in windows}
    return [summarize(w, x) for w, x in seed_means.items() if len(x) >= max(min_seeds, 2)]


def build_reference(runs: Sequence[RunLog], window: int | None = None, metrics: Sequence[str] = METRICS,
                    alpha: float = 0.05, min_seeds: int = 5, allow_mixed_configs: bool = False) -> dict:
    """The reference of ``runs`` (seeds of one config) as a JSON-ready dict (docs/compare.md)."""
    runs = list(runs)
    if len(runs) < max(min_seeds, 2):
        raise CompareError(f"a reference needs >= {max(min_seeds, 2)} runs (seeds), got {len(runs)}")
    _check_same_config(runs, allow_mixed_configs)
    window = default_window(runs) if window is None else int(window)
    if window < 1:
        raise CompareError(f"--window must be >= 1 step, got {window}")
    resolved = resolve_metrics(metrics, {k for run in runs for k in run.series})
    cells: dict[str, list[Cell]] = {}
    for keys in resolved.values():
        for key in keys:
            found = reference_cells(runs, key, window, min_seeds)
            if found:
                cells[key] = found
    if not cells:
        raise CompareError(f"runs {', '.join(r.source for r in runs)}: no metric of {list(metrics)} has a complete "
                           f"window of {window} steps in >= {max(min_seeds, 2)} runs")
    n = min(c.n for found in cells.values() for c in found)
    m = sum(len(found) for found in cells.values())
    first = next((r for r in runs if r.config_text is not None), None)
    return {
        "format": FORMAT, "version": VERSION,
        "config": {"path": first.config_path, "sha256": _sha256(first.config_text), "text": first.config_text}
        if first else None,
        "commit": git_commit(),
        "seeds": [r.seed for r in runs],
        "runs": [{"path": r.source, "seed": r.seed, "last_step": r.last_step,
                  "config_sha256": _sha256(r.config_text) if r.config_text else None} for r in runs],
        "step_key": STEP_KEY, "step_unit": "rollout batch",
        "window": window,
        "band": {"k": prediction_k(n, m, alpha), "alpha": alpha, "n": n, "cells": m,
                 "rule": "mean +/- k * max(se, se_floor); k = t_{n-1, 1-alpha/(2 cells)} * sqrt(n+1): t prediction "
                         "interval, Bonferroni over cells; se_floor = the median se of the metric's windows"},
        "metrics": {key: {"se_floor": metric_band(found).se_floor, "windows": [_cell_json(c, window) for c in found]}
                    for key, found in cells.items()},
        "missing": [name for name, keys in resolved.items() if not any(k in cells for k in keys)],
    }


def _check_same_config(runs: Sequence[RunLog], allow_mixed: bool) -> None:
    texts = [r for r in runs if r.config_text is not None]
    seeds = [r.seed for r in runs if r.seed is not None]
    if len(set(seeds)) < len(seeds):
        raise CompareError(f"runs share a seed ({seeds}): a reference's runs are distinct seeds of one config")
    for run in texts[1:]:
        diff = config_differences(texts[0].config_text, run.config_text, run.config_path)
        if diff and not allow_mixed:
            raise CompareError(f"{run.config_path} differs from {texts[0].config_path} beyond the seed: "
                               + "; ".join(diff[:5]) + (" ..." if len(diff) > 5 else "")
                               + " (a reference is seeds of one config; --allow_mixed_configs true to build it anyway)")


def _cell_json(cell: Cell, window: int) -> dict:
    return {"window": cell.window, "first_step": cell.window * window, "last_step": (cell.window + 1) * window - 1,
            "mean": cell.mean, "sd": cell.sd, "se": cell.se, "n": cell.n}


def _sha256(text: str | None) -> str | None:
    return hashlib.sha256(text.encode()).hexdigest() if text is not None else None


def shipped_references() -> list[str]:
    return sorted(p.stem for p in REFERENCES.glob("*.json")) if REFERENCES.is_dir() else []


def resolve_reference(name: str) -> Path:
    """A file path as given, else a shipped reference's name (``demo`` → ``aspo_lit/references/demo.json``)."""
    path = Path(name)
    if path.is_file():
        return path
    if (shipped_path := shipped_reference(name, REFERENCES)) is not None:
        return shipped_path
    shipped = shipped_references()
    raise CompareError(f"reference {name}: no such file" + (f"; shipped references: {', '.join(shipped)}" if shipped
                                                             else "; no reference is shipped in this install"))


def read_reference(name: str) -> dict:
    """Load and check a reference file (or a shipped one by name); errors name the file and field."""
    path = resolve_reference(name)
    try:
        ref = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CompareError(f"reference {path}: not JSON ({err})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CompareError(f"reference {path}: cannot read it ({err})") from None
    if not isinstance(ref, dict) or ref.get("format") != FORMAT:
        raise CompareError(f"reference {path}: not an aspo-lit reference (its 'format' must be {FORMAT!r})")
    if ref.get("kind", "run") != "run":
        raise CompareError(f"reference {path}: a {ref.get('kind')!r} reference, not bands over runs' windows "
                           "(a table's: python -m aspo_lit table1 --reference FILE; docs/evaluation.md)")
    if ref.get("version") != VERSION:
        raise CompareError(f"reference {path}: version {ref.get('version')!r}; this aspo-lit reads version {VERSION}")
    if ref.get("step_key") != STEP_KEY:
        raise CompareError(f"reference {path}: step_key {ref.get('step_key')!r}; runs are read by {STEP_KEY!r}")
    for where, value, kind in (("window", ref.get("window"), int), ("band.k", (ref.get("band") or {}).get("k"), float),
                               ("metrics", ref.get("metrics"), dict)):
        if not isinstance(value, kind if kind is not float else (int, float)) or isinstance(value, bool):
            raise CompareError(f"reference {path}: field {where!r} missing or not {kind.__name__}")
    ref["bands"] = parse_bands(ref["metrics"], str(path))
    ref["path"] = str(path)
    return ref


def parse_bands(metrics: dict, where: str) -> dict[str, MetricBand]:
    """A reference's ``metrics`` field as ``{metric: MetricBand}``; errors name ``where`` and the cell."""
    out = {}
    for key, entry in metrics.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("windows"), list):
            raise CompareError(f"reference {where}: metrics[{key!r}] must be {{se_floor, windows: [...]}}")
        cells = {}
        for i, cell in enumerate(entry["windows"]):
            try:
                parsed = Cell(int(cell["window"]), float(cell["mean"]), float(cell["sd"]), float(cell["se"]),
                              int(cell["n"]))
            except (KeyError, TypeError, ValueError) as err:
                raise CompareError(f"reference {where}: metrics[{key!r}] window entry {i} lacks a numeric "
                                   f"{err}") from None
            if not (math.isfinite(parsed.mean) and math.isfinite(parsed.se) and parsed.se >= 0):
                raise CompareError(f"reference {where}: metrics[{key!r}] window entry {i} has a non-finite mean "
                                   "or a bad SE")
            cells[parsed.window] = parsed
        floor = entry.get("se_floor", 0.0)
        if not isinstance(floor, (int, float)) or isinstance(floor, bool) or not (math.isfinite(floor) and floor >= 0):
            raise CompareError(f"reference {where}: metrics[{key!r}].se_floor must be a number >= 0")
        out[key] = MetricBand(cells, float(floor))
    return out


# ----------------------------------------------------------------------------------------------
# comparing

@dataclass
class MetricResult:
    """One metric's verdict: ``inside``, ``departs`` (at ``window``) or ``missing`` (``reason``)."""
    metric: str
    status: str
    compared: int = 0                   # windows both the run and the reference have
    window: int | None = None           # the first window outside the band
    steps: tuple[int, int] | None = None
    value: float | None = None          # the run's mean in that window
    band: tuple[float, float] | None = None
    reason: str = ""


def run_window_values(run: RunLog, ref: dict) -> dict[str, dict[int, float]]:
    """The run's window medians of every metric both it and ``ref`` have, on the windows they share."""
    window, out = int(ref["window"]), {}
    for key, band in ref["bands"].items():
        if key in run.series:
            means = window_medians(*run.series[key], window, run.last_step)
            out[key] = {w: v for w, v in means.items() if w in band.cells}
    return out


def band_k(run: RunLog, ref: dict, alpha: float | None = None) -> float:
    """The band's k for the cells this run is compared on: the reference's rule (``prediction_k``)
    with the Bonferroni count of *those* cells, so a run shorter than the reference (a CI check of its
    first windows) is tested at the same family-wise rate, not at the wider k of every cell.
    ``alpha``: that rate (default: the reference's)."""
    band = ref["band"]
    cells = sum(len(means) for means in run_window_values(run, ref).values())
    if cells == 0 or "n" not in band or (alpha is None and "alpha" not in band):
        return float(band["k"])
    return prediction_k(int(band["n"]), cells, float(band["alpha"] if alpha is None else alpha))


def compare_run(run: RunLog, ref: dict, k: float | None = None) -> list[MetricResult]:
    """Per metric of ``ref``: the first window where ``run`` leaves ``mean ± k·SE`` (k: :func:`band_k`)."""
    k = band_k(run, ref) if k is None else float(k)
    window = int(ref["window"])
    results = []
    for key, band in ref["bands"].items():
        if key not in run.series:
            results.append(MetricResult(key, "missing", reason="not logged by the run"))
            continue
        means = window_medians(*run.series[key], window, run.last_step)
        common = sorted(set(means) & set(band.cells))
        if not common:
            results.append(MetricResult(key, "missing", reason="no complete window in common"))
            continue
        first = band.first_departure(means, k)
        if first is None:
            results.append(MetricResult(key, "inside", len(common)))
            continue
        cell, half = band.cells[first], band.halfwidth(first, k)
        results.append(MetricResult(key, "departs", len(common), first, (first * window, (first + 1) * window - 1),
                                    means[first], (cell.mean - half, cell.mean + half)))
    results += [MetricResult(name, "missing", reason="not in the reference") for name in ref.get("missing", [])]
    return results


def exit_code(results: Sequence[MetricResult]) -> int:
    """1 on any departure, else 0; 2 when every metric is missing (nothing was compared)."""
    if any(r.status == "departs" for r in results):
        return 1
    return 2 if all(r.status == "missing" for r in results) else 0


def format_table(results: Sequence[MetricResult]) -> str:
    rows = [("metric", "windows", "verdict", "run", "band")]
    for r in results:
        if r.status == "departs":
            verdict = f"departs at window {r.window} (steps {r.steps[0]}-{r.steps[1]})"
            rows.append((r.metric, str(r.compared), verdict, f"{r.value:.4g}", f"[{r.band[0]:.4g}, {r.band[1]:.4g}]"))
        else:
            verdict = r.status if r.status == "inside" else f"missing: {r.reason}"
            rows.append((r.metric, str(r.compared), verdict, "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def coverage_note(run: RunLog, ref: dict) -> str:
    """Which of the reference's windows the run has (a shorter run is compared on those only)."""
    window = int(ref["window"])
    ref_windows = 1 + max((w for band in ref["bands"].values() for w in band.cells), default=-1)
    have = min(complete_windows(run.last_step, window), ref_windows)
    note = (f"run {run.source}: steps 0-{run.last_step:g}; {have} of the reference's {ref_windows} windows "
            f"of {window} steps")
    if have < ref_windows:
        note += f" (shorter than the reference: compared on windows 0-{have - 1})" if have else " (none complete)"
    elif complete_windows(run.last_step, window) > ref_windows:
        note += " (longer than the reference: later windows not compared)"
    return note


# ----------------------------------------------------------------------------------------------
# leave one seed out

@dataclass
class LeaveOneOut:
    """Each seed compared with the reference of the others (the band's empirical false-alarm rate)."""
    rate: float                                   # held-out seeds that left some band / seeds
    k: float                                      # the k of the n-1 seed references (the same rule)
    n: int                                        # seeds in each held-out reference
    cells_compared: int
    cells_outside: int                            # over all held-out seeds: (metric, window) cells left
    departures: dict[str, list[str]] = field(default_factory=dict)   # held-out run -> metrics that left

    def as_dict(self) -> dict:
        return asdict(self)


def false_alarm_rate(runs: Sequence[RunLog | str], window: int | None = None, metrics: Sequence[str] = METRICS,
                     alpha: float = 0.05, k: float | None = None) -> LeaveOneOut:
    """Leave one seed out: for each run, build the reference of the other n-1 (its k from the same
    rule, or ``k``) and compare the held-out run; the rate is the share of runs that leave some band.
    It estimates the family-wise rate ``alpha`` bounds (docs/compare.md)."""
    runs = [r if isinstance(r, RunLog) else load_run(r) for r in runs]
    if len(runs) < 3:
        raise CompareError(f"leaving one seed out needs >= 3 runs, got {len(runs)}")
    window = default_window(runs) if window is None else window
    failed, compared, outside, ks = {}, 0, 0, []
    for i, held_out in enumerate(runs):
        ref = build_reference(runs[:i] + runs[i + 1:], window, metrics, alpha, min_seeds=len(runs) - 1,
                              allow_mixed_configs=True)
        ref["bands"] = parse_bands(ref["metrics"], f"without {held_out.source}")
        k_i = ref["band"]["k"] if k is None else k
        ks.append(k_i)
        results = compare_run(held_out, ref, k_i)
        departed = [r.metric for r in results if r.status == "departs"]
        if departed:
            failed[held_out.source] = departed
        for key, band in ref["bands"].items():
            if key in held_out.series:
                means = window_medians(*held_out.series[key], window, held_out.last_step)
                common = set(means) & set(band.cells)
                compared += len(common)
                outside += sum(not band.contains(w, means[w], k_i) for w in common)
    return LeaveOneOut(len(failed) / len(runs), max(ks), len(runs) - 1, compared, outside, failed)


# ----------------------------------------------------------------------------------------------
# the figure

def plot_bands(run: RunLog, ref: dict, results: Sequence[MetricResult], path: str, k: float | None = None) -> str:
    """One panel per metric of ``ref``: the band ``mean ± k·max(SE, SE_floor)`` per window, the reference mean, the
    run's per-step values and its window medians (red where outside). Writes a PNG at ``path``."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    k = band_k(run, ref) if k is None else float(k)
    window = int(ref["window"])
    verdicts = {r.metric: r for r in results}
    keys = list(ref["bands"])
    cols = min(4, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig = Figure(figsize=(4 * cols, 3 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for ax, key in zip(axes, keys):
        band = ref["bands"][key]
        cells = [band.cells[w] for w in sorted(band.cells)]
        lo = np.array([c.mean - band.halfwidth(c.window, k) for c in cells])
        hi = np.array([c.mean + band.halfwidth(c.window, k) for c in cells])
        x = np.array([c.window * window for c in cells], dtype=float)
        for i, (xi, low, high) in enumerate(zip(x, lo, hi)):  # a window's band spans its steps
            ax.fill_between([xi - 0.5, xi + window - 0.5], [low, low], [high, high], color="C0", alpha=0.2, lw=0,
                            label=f"band (k = {k:.3g})" if i == 0 else None)
        ax.plot(x + (window - 1) / 2, [c.mean for c in cells], color="C0", ls="--", lw=1, label="reference mean")
        if key in run.series:
            steps, values = run.series[key]
            ax.plot(steps, values, color="0.5", lw=0.8, alpha=0.6, label="run")
            means = window_medians(steps, values, window, run.last_step)
            for w, value in means.items():
                if w in band.cells:
                    inside = band.contains(w, value, k)
                    ax.plot(w * window + (window - 1) / 2, value, "o", ms=4, color="C2" if inside else "C3")
        verdict = verdicts.get(key)
        ax.set_title(f"{key}: {verdict.status if verdict else '?'}", fontsize=9,
                     color="C3" if verdict and verdict.status == "departs" else "black")
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
    """Build a reference file from seeds of one config: per metric and window, the seeds' mean, SD, SE, n.

    Args:
        runs: the runs, one per seed: log folders (runs/NAME/version_K), metrics.csv files, TensorBoard
            folders or wandb:ENTITY/PROJECT/RUN_ID.
        out: the reference file to write (JSON; docs/compare.md).
        window: logged steps (rollout batches) per window (default: the shortest run in about 10 windows).
        alpha: the family-wise false-alarm rate the band's k is derived for (docs/compare.md).
        min_seeds: the fewest runs, and the fewest seeds a (metric, window) cell needs.
        allow_mixed_configs: build it even if the runs' configs differ beyond the seed.
        leave_one_out: also compare each seed with the reference of the others and store the rate.
    """
    try:
        if out is None:
            raise CompareError("--out FILE (the reference file to write) is required")
        logs = [load_run(r) for r in ([runs] if isinstance(runs, str) else runs)]
        ref = build_reference(logs, window, METRICS, alpha, min_seeds, allow_mixed_configs)
        if leave_one_out and len(logs) >= 3:
            ref["leave_one_out"] = false_alarm_rate(logs, ref["window"], METRICS, alpha).as_dict()
    except CompareError as err:
        print(f"aspo-lit reference: error: {err}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    Path(out).write_text(json.dumps(ref, indent=1) + "\n")
    band = ref["band"]
    print(f"{out}: {len(logs)} seeds {ref['seeds']}, window {ref['window']} steps, {len(ref['metrics'])} metrics, "
          f"{band['cells']} cells, k = {band['k']:.2f} SE (alpha {alpha}, n {band['n']})")
    if ref["missing"]:
        print(f"  not in the runs: {', '.join(ref['missing'])}")
    if "leave_one_out" in ref:
        loo = ref["leave_one_out"]
        print(f"  leave one seed out: {len(loo['departures'])} of {len(logs)} held-out seeds left a band "
              f"(rate {loo['rate']:.2f}; {loo['cells_outside']} of {loo['cells_compared']} cells, k = {loo['k']:.2f})")
        for source, metrics in loo["departures"].items():
            print(f"    {source}: {', '.join(metrics)}")
    return 0


def compare(run: str, reference: str | None = None, k: float | None = None, alpha: float | None = None,
            out: str | None = None) -> int:
    """Compare a run with a reference: per metric, the first window outside mean +/- k*SE; exit 1 if any.

    Args:
        run: the run: a log folder (runs/NAME/version_K), its metrics.csv, a TensorBoard folder or
            wandb:ENTITY/PROJECT/RUN_ID.
        reference: a reference file (python -m aspo_lit reference), or the name of one shipped in the
            package (e.g. demo).
        k: the band's half-width in SE units (default: the reference's rule for the cells compared,
            docs/compare.md).
        alpha: the family-wise false-alarm rate k is derived for (default: the reference's); a CI
            check on another CPU than the reference's takes a smaller one (docs/compare.md).
        out: the folder for the figure compare-<reference>.png (default: the run's log folder, or
            runs/compare for a W&B run).
    """
    try:
        if reference is None:
            raise CompareError("--reference FILE (or a shipped reference's name) is required")
        ref = read_reference(reference)
        log = load_run(run)
    except CompareError as err:
        print(f"aspo-lit compare: error: {err}", file=sys.stderr)
        return 2
    if k is not None and not k > 0:
        print(f"aspo-lit compare: error: --k must be > 0, got {k}", file=sys.stderr)
        return 2
    if alpha is not None and not 0 < alpha < 1:
        print(f"aspo-lit compare: error: --alpha must be in (0, 1), got {alpha}", file=sys.stderr)
        return 2
    k_used = band_k(log, ref, alpha) if k is None else float(k)
    results = compare_run(log, ref, k_used)
    print(coverage_note(log, ref))
    print(f"reference {ref['path']}: seeds {ref.get('seeds')}, commit {ref.get('commit')}, "
          f"band mean +/- {k_used:.2f} SE" + (" (k for the cells compared)" if k is None else ""))
    if log.config_text and ref.get("config") and ref["config"].get("text"):
        diff = config_differences(ref["config"]["text"], log.config_text, log.config_path)
        speed = [d for d in diff if d.split(":", 1)[0] in SPEED_ONLY_KEYS]
        other = [d for d in diff if d not in speed]
        if other:
            print(f"note: the run's config differs from the reference's: {'; '.join(other[:5])}"
                  + (" ..." if len(other) > 5 else ""))
        if speed:
            print(f"note: the run differs from the reference's config in speed settings that keep the maths "
                  f"(other floating-point sums, the same distribution of runs): {'; '.join(speed)}")
    print(format_table(results))
    code = exit_code(results)
    if code == 2:
        print(f"aspo-lit compare: error: nothing to compare: no metric of {ref['path']} has a complete window "
              f"in {log.source}", file=sys.stderr)
        return 2
    folder = out or log.folder or os.path.join("runs", "compare")
    path = plot_bands(log, ref, results, os.path.join(folder, f"compare-{Path(ref['path']).stem}.png"), k_used)
    print(path)
    departed = [r.metric for r in results if r.status == "departs"]
    print(f"{'DEPARTS' if departed else 'inside'}: {len(departed)} of {len(results)} metrics outside the band"
          + (f" ({', '.join(departed)})" if departed else ""))
    return code
