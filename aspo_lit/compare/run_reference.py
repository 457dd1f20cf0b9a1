"""Reference runs: the seeds of one config kept as a file, and a run compared with them (docs/compare.md).

A reference (JSON, format ``aspo-lit-reference``, kind ``run``, version 2) holds, per metric of
:data:`METRICS`, every seed's window values (:func:`aspo_lit.maths.bands.window_values`), with the config,
the testbed, the commit and the seeds they came from. :func:`compare_run` scores a run and each
reference seed over the windows the run has (:func:`aspo_lit.maths.bands.trajectory_score`), tests each
metric by its t prediction interval and flags the metrics Holm's step-down rejects at the family-wise
``alpha`` (:mod:`aspo_lit.maths.bands`). For a flagged metric it also says from which window on a run cut
there would already have been flagged. :func:`leave_one_out` compares each seed with the reference of
the others.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aspo_lit.compare.runlog import (
    SPEED_ONLY_KEYS,
    STEP_KEY,
    CompareError,
    RunLog,
    config_differences,
    load_yaml,
    resolve_metrics,
)
from aspo_lit.configs import REFERENCE_FORMAT, SHIPPED_REFERENCES, git_commit, shipped_reference
from aspo_lit.maths.bands import (
    MIN_CALIBRATION_SEEDS,
    Departure,
    MetricSpec,
    calibrated_df,
    complete_windows,
    holm,
    prediction_test,
    t_p_value,
    trajectory_score,
    window_values,
)

__all__ = ["METRICS", "VERSION", "Reference", "RefMetric", "MetricResult", "build_reference", "parse_reference",
           "read_reference", "compare_run", "exit_code", "leave_one_out", "family_p", "matching_reference",
           "comparable_config", "default_window"]

# Paper Fig. 2's dynamics plus what moves first when an update is wrong (docs/metrics.md names them),
# each with its window summary and transform (aspo_lit.maths.bands): medians where a batch's spike should
# not count, means where most batches log exactly 0 (the clip shares, repetition), log for positive
# right-skewed metrics, sqrt for the zero-inflated shares. "@K" matches any K.
METRICS: dict[str, MetricSpec] = {
    "train/reward_mean": MetricSpec("median", "identity"),
    "val/avg@K": MetricSpec("median", "identity"),
    "train/entropy": MetricSpec("median", "log"),
    "clip/pos_high": MetricSpec("mean", "sqrt"),
    "clip/neg_low": MetricSpec("mean", "sqrt"),
    "ratio/pos_mean": MetricSpec("median", "identity"),
    "ratio/neg_mean": MetricSpec("median", "identity"),
    "ratio/off_policy_share": MetricSpec("median", "identity"),
    "train/kl": MetricSpec("median", "log"),
    "train/grad_norm": MetricSpec("median", "log"),
    "response/length_mean": MetricSpec("median", "log"),
    "train/repetition_rate": MetricSpec("mean", "sqrt"),
}
FORMAT, VERSION, KIND = REFERENCE_FORMAT, 2, "run"
REFERENCES = SHIPPED_REFERENCES
DEFAULT_WINDOWS = 10   # the default window puts the shortest reference run in about this many windows
#: keys that say how long a run is, not what it trains: a shorter run of a config is compared on its windows
LENGTH_KEYS = frozenset({"trainer.max_steps", "trainer.max_epochs", "trainer.limit_train_batches"})
#: diagnostics that read the run and never steer it (no random numbers, no state the update reads): their
#: settings (say, the health rules) change no metric
LOGGING_ONLY_CALLBACKS = ("aspo_lit.callbacks.CounterfactualWeights", "aspo_lit.callbacks.HealthMonitor")


@dataclass
class RefMetric:
    """One metric of a reference: its summary, the windows it has, each seed's window values."""
    spec: MetricSpec
    windows: list[int]
    values: list[dict[int, float]]

    def seed_scores(self, windows: Sequence[int]) -> list[float]:
        return [trajectory_score(v, windows, self.spec.transform) for v in self.values]


@dataclass
class Reference:
    """A reference, parsed (:func:`parse_reference`); ``data`` is the file's JSON."""
    path: str
    data: dict
    window: int
    alpha: float
    metrics: dict[str, RefMetric]
    missing: list[str] = field(default_factory=list)

    @property
    def seeds(self) -> list:
        return list(self.data.get("seeds") or [])

    @property
    def testbed(self) -> str | None:
        return self.data.get("testbed")

    @property
    def config_text(self) -> str | None:
        return (self.data.get("config") or {}).get("text")

    @property
    def df(self) -> float:
        """The Student-t degrees of freedom of the prediction tests (calibrated by leaving one seed out)."""
        return float((self.data.get("calibration") or {}).get("df") or min(len(m.values) for m in self.metrics.values()) - 1)

    @property
    def windows(self) -> int:
        """Windows 0..windows-1 hold values."""
        return 1 + max((w for m in self.metrics.values() for w in m.windows), default=-1)


# ----------------------------------------------------------------------------------------------
# building and reading

def default_window(runs: Sequence[RunLog]) -> int:
    """About :data:`DEFAULT_WINDOWS` windows over the shortest run."""
    return max(1, round((min(r.last_step for r in runs) + 1) / DEFAULT_WINDOWS))


def _metric_values(runs: Sequence[RunLog], key: str, spec: MetricSpec, window: int) -> tuple[list[int], list[dict]]:
    """The complete windows every run has for ``key``, and each run's values there."""
    per_run = [window_values(*run.series[key], window, run.last_step, spec.window) for run in runs]
    common = sorted(set.intersection(*(set(v) for v in per_run))) if per_run else []
    return common, [{w: v[w] for w in common} for v in per_run]


def build_reference(runs: Sequence[RunLog], window: int | None = None, alpha: float = 0.05, min_seeds: int = 5,
                    allow_mixed_configs: bool = False, calibrate: bool = True) -> dict:
    """The reference of ``runs`` (seeds of one config) as a JSON-ready dict (docs/compare.md), its
    tests' degrees of freedom calibrated by leaving one seed out (:func:`calibrate`) unless ``calibrate``
    is false (the normal model's n - 1)."""
    runs = list(runs)
    if len(runs) < max(min_seeds, 2):
        raise CompareError(f"a reference needs >= {max(min_seeds, 2)} runs (seeds), got {len(runs)}")
    _check_same_config(runs, allow_mixed_configs)
    window = default_window(runs) if window is None else int(window)
    if window < 1:
        raise CompareError(f"--window must be >= 1 step, got {window}")
    if not 0 < alpha < 1:
        raise CompareError(f"--alpha must be in (0, 1), got {alpha}")
    keys = {k for run in runs for k in run.series}
    metrics, missing = {}, []
    for name, logged in resolve_metrics(METRICS, keys).items():
        found = False
        for key in logged:
            holders = [r for r in runs if key in r.series]
            if len(holders) < len(runs):
                continue   # a metric some seed did not log: its scores would not be of the same seeds
            windows, values = _metric_values(holders, key, METRICS[name], window)
            if windows:
                metrics[key] = {"window_summary": METRICS[name].window, "transform": METRICS[name].transform,
                                "windows": windows, "values": [[v[w] for w in windows] for v in values]}
                found = True
        if not found:
            missing.append(name)
    if not metrics:
        raise CompareError(f"runs {', '.join(r.source for r in runs)}: no metric of {list(METRICS)} has a complete "
                           f"window of {window} steps in every run")
    first = next((r for r in runs if r.config_text is not None), None)
    testbeds = sorted({r.testbed for r in runs if r.testbed})
    data = {
        "format": FORMAT, "kind": KIND, "version": VERSION,
        "config": {"path": first.config_path, "sha256": _sha256(first.config_text), "text": first.config_text}
        if first else None,
        "testbed": testbeds[0] if len(testbeds) == 1 else (testbeds or None),
        "commit": git_commit(),
        "seeds": [r.seed for r in runs],
        "runs": [{"path": r.source, "seed": r.seed, "last_step": r.last_step, "testbed": r.testbed,
                  "config_sha256": _sha256(r.config_text) if r.config_text else None} for r in runs],
        "step_key": STEP_KEY, "step_unit": "rollout batch", "window": window, "alpha": alpha,
        "rule": "per metric, the mean over the run's complete windows of each window's median (mean for the "
                "zero-inflated metrics), transformed; a two-sided t prediction interval over the seeds' scores on "
                "the same windows; Holm's step-down over the metrics at family-wise alpha",
        "metrics": metrics,
        "missing": missing,
    }
    data["calibration"] = calibration(runs, window, alpha) if calibrate else {
        "df": float(len(runs) - 1), "rule": "the normal model's n - 1 (not calibrated)"}
    return data


def held_out_t(runs: Sequence[RunLog], window: int) -> list[list[dict[str, float]]]:
    """Leaving one seed out: ``[L][i]``, seed ``i``'s t per metric against the reference of the others
    on the first ``L + 1`` windows (what :func:`aspo_lit.maths.bands.calibrated_df` calibrates on)."""
    runs = list(runs)
    prefixes: dict[int, list[dict[str, float]]] = {}
    for i, held in enumerate(runs):
        others = runs[:i] + runs[i + 1:]
        ref = parse_reference(build_reference(others, window, min_seeds=len(others), allow_mixed_configs=True,
                                              calibrate=False), f"without {held.source}")
        values = run_window_values(held, ref)
        for upto in range(1, complete_windows(held.last_step, window) + 1):
            prefixes.setdefault(upto, []).append({k: d.t for k, (_, d) in _tests(values, ref, upto).items()})
    return [prefixes[upto] for upto in sorted(prefixes)]


def calibration(runs: Sequence[RunLog], window: int, alpha: float) -> dict:
    """The reference's degrees of freedom (:func:`aspo_lit.maths.bands.calibrated_df` on :func:`held_out_t`)
    and, at them, the share of held-out seeds that depart on each prefix of windows."""
    n = len(runs)
    if n < MIN_CALIBRATION_SEEDS:
        return {"df": float(n - 1), "rule": f"the normal model's n - 1 (fewer than {MIN_CALIBRATION_SEEDS} seeds)"}
    t = held_out_t(runs, window)
    df = calibrated_df(t, n, alpha)
    rates = [float(np.mean([bool(holm({k: t_p_value(v, df) for k, v in seed.items()}, alpha)) for seed in prefix]))
             for prefix in t]
    return {"df": df, "rule": "the largest df whose Student-t keeps every seed held out of the others to alpha on every "
                              "prefix of windows (Holm over the metrics)",
            "held_out_rate_by_windows": rates}


def _check_same_config(runs: Sequence[RunLog], allow_mixed: bool) -> None:
    texts = [r for r in runs if r.config_text is not None]
    seeds = [r.seed for r in runs if r.seed is not None]
    if len(set(seeds)) < len(seeds):
        raise CompareError(f"runs share a seed ({seeds}): a reference's runs are distinct seeds of one config")
    for run in texts[1:]:
        diff = [d for d in config_differences(texts[0].config_text, run.config_text, run.config_path)
                if d.split(":", 1)[0] not in SPEED_ONLY_KEYS]
        if diff and not allow_mixed:
            raise CompareError(f"{run.config_path} differs from {texts[0].config_path} beyond the seed: "
                               + "; ".join(diff[:5]) + (" ..." if len(diff) > 5 else "")
                               + " (a reference is seeds of one config; --allow_mixed_configs true to build it anyway)")
    testbeds = {r.testbed for r in runs if r.testbed}
    if len(testbeds) > 1 and not allow_mixed:
        raise CompareError(f"runs started from different testbeds ({', '.join(sorted(testbeds))}): a reference is "
                           "seeds of one config on one testbed (--allow_mixed_configs true to build it anyway)")


def _sha256(text: str | None) -> str | None:
    return hashlib.sha256(text.encode()).hexdigest() if text is not None else None


def parse_reference(data: dict, where: str) -> Reference:
    """Check a reference's JSON and parse it; errors name ``where`` and the field."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CompareError(f"reference {where}: not an aspo-lit reference (its 'format' must be {FORMAT!r})")
    if data.get("kind", KIND) != KIND:
        raise CompareError(f"reference {where}: a {data.get('kind')!r} reference, not bands over runs' windows "
                           "(a table's: python -m aspo_lit table1 --reference FILE; docs/evaluation.md)")
    if data.get("version") != VERSION:
        raise CompareError(f"reference {where}: version {data.get('version')!r}; this aspo-lit reads version {VERSION} "
                           "(per-seed window values); build it again from its runs: python -m aspo_lit reference RUNS "
                           "--out FILE")
    if data.get("step_key") != STEP_KEY:
        raise CompareError(f"reference {where}: step_key {data.get('step_key')!r}; runs are read by {STEP_KEY!r}")
    for name, kind in (("window", int), ("alpha", float), ("metrics", dict)):
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
            raise CompareError(f"reference {where}: field {name!r} missing or not {kind.__name__}")
    metrics = {}
    for key, entry in data["metrics"].items():
        try:
            spec = MetricSpec(entry["window_summary"], entry["transform"])
            windows = [int(w) for w in entry["windows"]]
            values = [{w: float(v) for w, v in zip(windows, row, strict=True)} for row in entry["values"]]
        except (KeyError, TypeError, ValueError) as err:
            raise CompareError(f"reference {where}: metrics[{key!r}] needs window_summary, transform, windows and one "
                               f"row of values per seed, one per window ({type(err).__name__}: {err})") from None
        if len(values) < 2 or any(not all(math.isfinite(x) for x in v.values()) for v in values):
            raise CompareError(f"reference {where}: metrics[{key!r}] needs >= 2 seeds of finite values")
        metrics[key] = RefMetric(spec, windows, values)
    return Reference(where, data, int(data["window"]), float(data["alpha"]), metrics, list(data.get("missing") or []))


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


def shipped_references() -> list[str]:
    """The names of the run references shipped in the package (the tables' references aside)."""
    import json

    names = []
    for path in sorted(REFERENCES.glob("*.json")) if REFERENCES.is_dir() else []:
        try:
            if json.loads(path.read_text()).get("kind", KIND) == KIND:
                names.append(path.stem)
        except (OSError, ValueError):
            continue
    return names


def read_reference(name: str) -> Reference:
    """Load and check a reference file (or a shipped one by name); errors name the file and field."""
    import json

    path = resolve_reference(name)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CompareError(f"reference {path}: not JSON ({err})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CompareError(f"reference {path}: cannot read it ({err})") from None
    return parse_reference(data, str(path))


# ----------------------------------------------------------------------------------------------
# comparing

@dataclass
class MetricResult:
    """One metric's verdict: ``inside``, ``departs`` or ``missing`` (``reason``). ``score`` and
    ``limits`` are in the metric's own units (the transform undone: a geometric mean for ``log``);
    ``limits`` hold a same-config seed at the first Holm step (alpha / metrics compared)."""
    metric: str
    status: str
    compared: int = 0                   # windows the score is over
    score: float | None = None
    limits: tuple[float, float] | None = None
    p: float | None = None
    first_window: int | None = None     # departs: a run cut after this window would already depart
    reason: str = ""


_UNDO = {"identity": lambda x: x, "log": math.exp, "sqrt": lambda x: x * x if x >= 0 else -(x * x)}


def run_window_values(run: RunLog, ref: Reference) -> dict[str, dict[int, float]]:
    """The run's window values of every metric both it and ``ref`` have."""
    return {key: window_values(*run.series[key], ref.window, run.last_step, m.spec.window)
            for key, m in ref.metrics.items() if key in run.series}


def _tests(values: dict[str, dict[int, float]], ref: Reference, upto: int) -> dict[str, tuple[list[int], Departure]]:
    """Each metric's prediction test over the windows below ``upto`` that the run and the reference have."""
    out = {}
    for key, metric in ref.metrics.items():
        windows = [w for w in metric.windows if w < upto and w in values.get(key, {})]
        if not windows:
            continue
        seeds = [s for s in metric.seed_scores(windows) if math.isfinite(s)]
        if len(seeds) >= 2:
            out[key] = (windows, prediction_test(trajectory_score(values[key], windows, metric.spec.transform), seeds,
                                                 ref.df))
    return out


def compare_run(run: RunLog, ref: Reference, alpha: float | None = None) -> list[MetricResult]:
    """Per metric of ``ref``: inside, departs (Holm at ``alpha``, default the reference's) or missing."""
    alpha = ref.alpha if alpha is None else float(alpha)
    values = run_window_values(run, ref)
    complete = complete_windows(run.last_step, ref.window)
    tests = _tests(values, ref, complete)
    departed = holm({k: d.p for k, (_, d) in tests.items()}, alpha)
    first: dict[str, int] = {}
    for upto in range(1, complete + 1) if departed else ():
        prefix = _tests(values, ref, upto)
        for key in holm({k: d.p for k, (_, d) in prefix.items()}, alpha) & departed:
            first.setdefault(key, upto - 1)
    results = []
    for key, metric in ref.metrics.items():
        if key not in run.series:
            results.append(MetricResult(key, "missing", reason="not logged by the run"))
        elif key not in tests:
            results.append(MetricResult(key, "missing", reason="no complete window in common"))
        else:
            windows, test = tests[key]
            undo = _UNDO[metric.spec.transform]
            lo, hi = test.limits(alpha / len(tests))
            results.append(MetricResult(key, "departs" if key in departed else "inside", len(windows),
                                        undo(test.score) if math.isfinite(test.score) else math.nan,
                                        (undo(lo), undo(hi)), test.p, first.get(key)))
    results += [MetricResult(name, "missing", reason="not in the reference") for name in ref.missing]
    return results


def family_p(results: Sequence[MetricResult]) -> float:
    """The smallest family-wise alpha at which the run departs on some metric: ``M · min p`` (Holm's
    first step), 1 when nothing was compared."""
    ps = [r.p for r in results if r.p is not None]
    return min(1.0, len(ps) * min(ps)) if ps else 1.0


def exit_code(results: Sequence[MetricResult]) -> int:
    """1 on any departure, else 0; 2 when every metric is missing (nothing was compared)."""
    if any(r.status == "departs" for r in results):
        return 1
    return 2 if all(r.status == "missing" for r in results) else 0


def leave_one_out(runs: Sequence[RunLog], window: int, alpha: float = 0.05) -> dict:
    """Each seed compared with the reference of the others, at the degrees of freedom calibrated on all
    of them: how many depart (the false-alarm rate the reference's alpha bounds, on its own seeds; the
    calibration saw these seeds, so this is no out-of-sample rate) and each seed's :func:`family_p`."""
    if len(runs) < 3:
        raise CompareError(f"leaving one seed out needs >= 3 runs, got {len(runs)}")
    departures, ps = {}, []
    df = calibration(runs, window, alpha)["df"]
    for i, held_out in enumerate(runs):
        others = list(runs[:i]) + list(runs[i + 1:])
        data = build_reference(others, window, alpha, min_seeds=len(others), allow_mixed_configs=True, calibrate=False)
        data["calibration"] = {"df": df}
        results = compare_run(held_out, parse_reference(data, f"without {held_out.source}"))
        ps.append(family_p(results))
        departed = [r.metric for r in results if r.status == "departs"]
        if departed:
            departures[held_out.source] = departed
    return {"seeds": len(runs), "departed": len(departures), "alpha": alpha, "departures": departures,
            "family_p": ps}


# ----------------------------------------------------------------------------------------------
# which reference a run's config is

def comparable_config(text: str) -> str:
    """A config without what says only how it was run: the progress bar (on in a terminal, off in
    the reference runs) and the diagnostics that only log (:data:`LOGGING_ONLY_CALLBACKS`)."""
    import yaml

    def name(callback) -> str:
        return str(callback.get("class_path", callback) if isinstance(callback, dict) else callback)

    cfg = load_yaml(text, "config")
    trainer = cfg.get("trainer") or {}
    if isinstance(trainer.get("callbacks"), list):
        trainer["callbacks"] = [c for c in trainer["callbacks"]
                                if not name(c).endswith("ProgressBar") and name(c) not in LOGGING_ONLY_CALLBACKS]
    trainer.pop("enable_progress_bar", None)
    return yaml.safe_dump(cfg)


def config_matches(reference_text: str, run_text: str) -> list[str]:
    """The differences between a reference's config and a run's that change what is trained (not the
    seed, the logger, the progress bar, logging-only diagnostics, speed settings or the run's length)."""
    differences = config_differences(comparable_config(reference_text), comparable_config(run_text))
    return [d for d in differences if d.split(":", 1)[0] not in SPEED_ONLY_KEYS | LENGTH_KEYS]


def matching_reference(config_text: str) -> Reference | None:
    """The shipped reference whose config trains what ``config_text`` trains, if any."""
    for name in shipped_references():
        try:
            ref = read_reference(name)
        except CompareError:
            continue
        if ref.config_text and not config_matches(ref.config_text, config_text):
            return ref
    return None
