"""The CPU-scale study: do the paper's training dynamics show up on the testbed?

    python -m aspo_lit study --config conf/study/default.yaml [--jobs 2] [--report-only]

Trains every ``(loss, seed)`` of a study YAML with identical data, seeds and budget (one
``python -m aspo_lit fit`` subprocess each, at most ``jobs`` at a time, ``cores // jobs`` threads
each), validates the untrained testbed once per seed with the same held-out settings (the
"initial model" row), then writes a report (``docs/study.md`` + PNG figures beside it):

* Fig. 2-style overlays, one line per loss, mean ± std over seeds: held-out ``val/avg@K``,
  ``train/entropy``, ``train/repetition_rate``, ``clip/pos_high``, ``train/kl``, ``train/grad_norm``;
* the Fig. 4 token-weight surfaces (last ``token_weights_step*.png`` of seed 0 of grpo and aspo);
* a Table 4-style table of final held-out avg@K / pass@K per loss;
* the run budget and the measured wall time;
* one verdict line per claim of the paper (:data:`CLAIMS`), by :func:`verdict`.

Study YAML keys (paths in ``base_config`` are relative to the study file, the others to the
working directory)::

    name: default                 # a label for the report
    description: "..."            # free text, copied into the report (budget rationale)
    base_config: ../tiny/aspo.yaml   # fit config (str or list, composed left to right)
    losses: [grpo, grpo_no_is, grpo_pos_mean, aspo, aspo_no_dual_clip]
    seeds: [0, 1, 2]
    max_steps: 256                # optimizer steps of every run
    overrides: ["--data.init_args.levels=[1,2,3]", ...]   # CLI overrides for every fit/validate
    out_dir: runs/study           # runs, logs, markers
    jobs: 2                       # runs in parallel
    threads: null                 # threads per run (default cpu_count // jobs)
    report: docs/study.md         # figures go to <report without .md>/
    tail_fraction: 0.2            # "final" train metric = mean over the last 20% of logged steps
    smooth: 0.6                   # EMA weight of the plotted curves (display only)
    base_eval: true               # validate the untrained model once per seed
    prebuild_testbed: true        # build/find the testbed once, pin its folder for every run
    model_path: null              # (set by the prebuild) the model folder every run gets

Resumable: a run whose ``done`` marker exists is skipped, a run with ``checkpoints/last.ckpt`` but
no marker continues with ``--ckpt_path last`` (its metrics are merged over version folders by
step, later versions winning). A failing run is reported with its log path; the others go on.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aspo_lit.figures import PANELS, accuracy_key, ema_smooth, read_metrics

REPO = Path(__file__).resolve().parents[1]

LABELS = {
    "grpo": "GRPO",
    "grpo_no_is": "GRPO w/o IS",
    "grpo_pos_mean": "GRPO w/ Pos. Resp. IS Mean",
    "aspo": "ASPO",
    "aspo_no_dual_clip": "ASPO w/o dual clip",
    "cispo": "CISPO",
    "gspo": "GSPO",
}
#: Paper Table 4 (Qwen3-4B, average over the six math benchmarks), for reference in the table.
PAPER_TABLE4_AVG = {"grpo": 61.6, "grpo_no_is": 63.5, "grpo_pos_mean": 64.0}

ACCURACY = "val/avg@K"  # placeholder resolved to the runs' val/avg@<K> column
#: Figure panels: (metric, title); the accuracy key is resolved from the runs.
STUDY_PANELS = tuple(PANELS) + (("train/grad_norm", "Grad norm"),)
#: Training metrics tabulated in the report (first 20% -> last 20% of logged steps).
#: Plotted raw (spikes are the point of Fig. 8).
UNSMOOTHED = ("train/grad_norm",)
DYNAMICS = ("train/entropy", "train/repetition_rate", "clip/pos_high", "train/kl", "train/reward_mean")


def label(loss: str) -> str:
    return LABELS.get(loss, loss)


def _show(path: str | os.PathLike) -> str:
    """A path relative to the repository when it lies inside it, else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


# =========================================================================== the study config

@dataclass
class Study:
    path: Path
    name: str = "study"
    description: str = ""
    base_config: list[Path] = field(default_factory=list)
    losses: list[str] = field(default_factory=lambda: ["grpo", "grpo_no_is", "grpo_pos_mean", "aspo",
                                                       "aspo_no_dual_clip"])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    max_steps: int = 80
    overrides: list[str] = field(default_factory=list)
    out_dir: Path = Path("runs/study")
    jobs: int = 2
    threads: int | None = None
    report: Path = Path("docs/study.md")
    tail_fraction: float = 0.2
    smooth: float = 0.6
    base_eval: bool = True
    prebuild_testbed: bool = True
    model_path: str | None = None   # set by prebuild_testbed: every run gets the same built testbed

    @property
    def runs_dir(self) -> Path:
        return self.out_dir / "runs"

    @property
    def logs_dir(self) -> Path:
        return self.out_dir / "logs"

    @property
    def figures_dir(self) -> Path:
        return self.report.with_suffix("")

    @property
    def threads_per_job(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // max(1, self.jobs))


def load_study(path: str | os.PathLike, *, jobs: int | None = None, out_dir: str | None = None,
               report: str | None = None) -> Study:
    """Read a study YAML (module docstring); command-line values override the file's."""
    import yaml

    path = Path(path).resolve()
    raw = yaml.safe_load(path.read_text()) or {}
    known = set(Study.__dataclass_fields__) - {"path"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown study key(s) {unknown}; known: {sorted(known)}")
    study = Study(path=path)
    for key, value in raw.items():
        setattr(study, key, value)
    base = raw.get("base_config", str(REPO / "conf" / "tiny" / "aspo.yaml"))
    study.base_config = [(path.parent / b).resolve() for b in ([base] if isinstance(base, str) else base)]
    study.losses = [str(x) for x in study.losses]
    study.seeds = [int(x) for x in study.seeds]
    study.overrides = [str(x) for x in (study.overrides or [])]
    study.max_steps = int(study.max_steps)
    study.jobs = int(jobs if jobs is not None else study.jobs)
    study.out_dir = Path(out_dir if out_dir is not None else study.out_dir).resolve()
    study.report = Path(report if report is not None else study.report).resolve()
    if study.report.suffix != ".md":
        raise ValueError(f"report must be a .md path, got {study.report}")
    if not study.losses or not study.seeds:
        raise ValueError("a study needs at least one loss and one seed")
    if study.max_steps < 1 or study.jobs < 1:
        raise ValueError("max_steps and jobs must be positive")
    if not 0 < float(study.tail_fraction) <= 1:
        raise ValueError("tail_fraction must be in (0, 1]")
    for b in study.base_config:
        if not b.is_file():
            raise ValueError(f"base_config {b} not found")
    return study


# =========================================================================== the runs

@dataclass
class Run:
    name: str             # experiment folder under runs_dir: <loss>_s<seed> or base_s<seed>
    kind: str             # "fit" | "base"
    loss: str | None
    seed: int

    def dir(self, study: Study) -> Path:
        return study.runs_dir / self.name

    def log(self, study: Study) -> Path:
        return study.logs_dir / f"{self.name}.log"

    def done_marker(self, study: Study) -> Path:
        return self.dir(study) / "done"

    def failed_marker(self, study: Study) -> Path:
        return self.dir(study) / "failed"

    def checkpoint(self, study: Study) -> Path:
        return self.dir(study) / "checkpoints" / "last.ckpt"


def plan(study: Study) -> list[Run]:
    """Base evaluations first (short), then the fits seed-major (a partial study stays balanced)."""
    runs = [Run(f"base_s{s}", "base", None, s) for s in study.seeds] if study.base_eval else []
    runs += [Run(f"{loss}_s{s}", "fit", loss, s) for s in study.seeds for loss in study.losses]
    return runs


def state(run: Run, study: Study) -> str:
    """``done`` | ``resume`` (checkpoint, no marker) | ``fresh``."""
    if run.done_marker(study).exists():
        return "done"
    if run.kind == "fit" and run.checkpoint(study).exists():
        return "resume"
    return "fresh"


def command(run: Run, study: Study, resume: bool = False) -> list[str]:
    """The subprocess command line of a run (identical data and budget for every loss)."""
    argv = [sys.executable, "-m", "aspo_lit", "fit" if run.kind == "fit" else "validate"]
    for config in study.base_config:
        argv += ["--config", str(config)]
    argv += list(study.overrides)
    if study.model_path:
        argv += [f"--model.model_name_or_path={study.model_path}"]
    argv += [f"--seed_everything={run.seed}", f"--data.init_args.seed={run.seed}", f"--model.seed={run.seed}",
             f"--trainer.logger.init_args.save_dir={study.runs_dir}",
             f"--trainer.logger.init_args.name={run.name}",
             "--trainer.enable_progress_bar=false"]
    if run.kind == "fit":
        argv += [f"--model.loss={run.loss}", f"--trainer.max_steps={study.max_steps}"]
        if resume:
            argv += ["--ckpt_path=last"]
    return argv


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                "VECLIB_MAXIMUM_THREADS"):
        env[key] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _fingerprint(study: Study, run: Run) -> str:
    """What a run's result depends on (paths excluded): recorded in its marker."""
    import hashlib

    argv = [a for a in command(run, study) if "save_dir=" not in a]
    text = json.dumps([argv[3:], [Path(c).read_text() for c in study.base_config]])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class Executor:
    """Runs the planned subprocesses, at most ``jobs`` at a time; SIGTERM/Ctrl-C stop cleanly
    (see :meth:`_signal`)."""

    def __init__(self, study: Study, echo=print) -> None:
        self.study = study
        self.echo = echo
        self.stop = threading.Event()
        self.live: set[subprocess.Popen] = set()
        self.lock = threading.Lock()

    def run_one(self, run: Run) -> dict[str, Any]:
        study = self.study
        status = state(run, study)
        if status == "done":
            marker = _read_json(run.done_marker(study))
            if marker.get("fingerprint") not in (None, _fingerprint(study, run)):
                self.echo(f"[study] {run.name}: done under a different config (delete {run.dir(study)} to rerun)")
            return {"name": run.name, "status": "skipped (done)", "rc": 0}
        if self.stop.is_set():
            return {"name": run.name, "status": "not started", "rc": None}
        resume = status == "resume"
        argv = command(run, study, resume=resume)
        log = run.log(study)
        log.parent.mkdir(parents=True, exist_ok=True)
        run.dir(study).mkdir(parents=True, exist_ok=True)
        run.failed_marker(study).unlink(missing_ok=True)
        self.echo(f"[study] start {run.name}{' (resume)' if resume else ''}  log: {log}")
        start = time.time()
        with open(log, "a") as handle:
            handle.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n")
            handle.flush()
            # own session: a terminal Ctrl-C reaches the study only, which forwards exactly one
            # SIGINT (a second one would make GracefulInterrupt abort without saving)
            proc = subprocess.Popen(argv, cwd=str(REPO), env=_env(study.threads_per_job), stdout=handle,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            with self.lock:
                self.live.add(proc)
            rc = proc.wait()
            with self.lock:
                self.live.discard(proc)
        wall = time.time() - start
        attempt = {"started": start, "wall_s": round(wall, 1), "rc": rc, "resumed": resume,
                   "threads": study.threads_per_job, "jobs": study.jobs}
        with open(run.dir(study) / "attempts.jsonl", "a") as f:
            f.write(json.dumps(attempt) + "\n")
        if rc == 0 and not self.stop.is_set():
            attempts = _read_jsonl(run.dir(study) / "attempts.jsonl")
            _write_json(run.done_marker(study), {
                "name": run.name, "loss": run.loss, "seed": run.seed, "kind": run.kind,
                "max_steps": study.max_steps if run.kind == "fit" else None,
                "wall_s": round(sum(a["wall_s"] for a in attempts), 1), "attempts": len(attempts),
                "fingerprint": _fingerprint(study, run), "finished": time.time(), "log": str(log)})
            self.echo(f"[study] done  {run.name} in {wall / 60:.1f} min")
            return {"name": run.name, "status": "done", "rc": 0, "wall_s": wall}
        if self.stop.is_set():
            self.echo(f"[study] stopped {run.name} (rc {rc}); rerun the study to resume it")
            return {"name": run.name, "status": "interrupted", "rc": rc, "wall_s": wall}
        _write_json(run.failed_marker(study), {"rc": rc, "log": str(log), "wall_s": round(wall, 1)})
        self.echo(f"[study] FAILED {run.name} (exit {rc}); see {log}")
        return {"name": run.name, "status": "failed", "rc": rc, "log": str(log), "wall_s": wall}

    def _signal(self, signum, frame) -> None:
        """First SIGINT/SIGTERM: every live run gets one SIGINT (GracefulInterrupt: finish the step,
        save ``last.ckpt``, exit); no new run starts. A second one kills the runs."""
        again = self.stop.is_set()
        self.stop.set()
        with self.lock:
            for proc in self.live:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL if again else signal.SIGINT)

    def run_all(self, runs: Sequence[Run]) -> list[dict[str, Any]]:
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._signal)
        try:
            with ThreadPoolExecutor(max_workers=self.study.jobs) as pool:
                return list(pool.map(self.run_one, runs))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def model_name(study: Study) -> str:
    """The ``model.model_name_or_path`` every run gets: the last one written by the base configs
    (their own ``config:`` bases included) or the overrides; ``testbed`` when none writes it."""
    import yaml

    from aspo_lit.cli import expand_base_configs

    name = "testbed"
    argv = expand_base_configs([w for b in study.base_config for w in ("--config", str(b))])
    for path in argv[1::2]:
        name = ((yaml.safe_load(Path(path).read_text()) or {}).get("model") or {}).get("model_name_or_path", name)
    for arg in study.overrides:
        if arg.startswith("--model.model_name_or_path="):
            name = arg.split("=", 1)[1]
    return name


def prebuild_testbed(study: Study, echo=print) -> int:
    """Build (or find) the cached testbed once, so parallel runs never build it twice, and pin its
    folder for every run (``study.model_path``): all runs train the very same model even if the
    testbed's defaults change while the study runs."""
    from aspo_lit.testbed import PROFILES

    name = model_name(study)
    if name not in PROFILES:
        return 0
    log = study.logs_dir / "build_testbed.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    echo(f"[study] testbed model {name!r} (cached after the first build)  log: {log}")
    with open(log, "a") as handle:
        proc = subprocess.run([sys.executable, "-m", "aspo_lit", "build-testbed", "--profile", name], cwd=str(REPO),
                              env=_env(os.cpu_count() or 1), stdout=subprocess.PIPE, stderr=handle, text=True)
        handle.write(proc.stdout)
    for line in proc.stdout.splitlines():
        if line.strip() and (Path(line.strip()) / "testbed.json").is_file():
            study.model_path = line.strip()
            echo(f"[study] testbed: {study.model_path}")
    return proc.returncode


# =========================================================================== metrics

Series = dict[str, tuple[np.ndarray, np.ndarray]]


def _version_number(path: str) -> int:
    match = re.search(r"version_(\d+)", path)
    return int(match.group(1)) if match else -1


def version_dirs(run_dir: Path) -> list[Path]:
    return [Path(p) for p in sorted(glob.glob(str(run_dir / "version_*")), key=_version_number)]


def load_run_metrics(run_dir: str | os.PathLike) -> Series:
    """``{metric: (steps, values)}`` merged over the run's ``version_*/metrics.csv`` by step
    (a resumed run adds a version folder; for a step logged twice the later version wins)."""
    merged: dict[str, dict[float, float]] = defaultdict(dict)
    for version in version_dirs(Path(run_dir)):
        path = version / "metrics.csv"
        if path.is_file():
            for key, (steps, values) in read_metrics(str(path)).items():
                merged[key].update(zip(steps.tolist(), values.tolist()))
    out: Series = {}
    for key, points in merged.items():
        steps = np.array(sorted(points), dtype=np.float64)
        out[key] = (steps, np.array([points[s] for s in steps], dtype=np.float64))
    return out


def tail_mean(series: tuple[np.ndarray, np.ndarray] | None, fraction: float = 0.2) -> float:
    """Mean over the last ``fraction`` of the logged points (at least one)."""
    if series is None or len(series[1]) == 0:
        return math.nan
    values = series[1]
    n = max(1, int(math.ceil(fraction * len(values))))
    return float(np.mean(values[-n:]))


def head_mean(series: tuple[np.ndarray, np.ndarray] | None, fraction: float = 0.2) -> float:
    """Mean over the first ``fraction`` of the logged points (at least one)."""
    if series is None or len(series[1]) == 0:
        return math.nan
    values = series[1]
    n = max(1, int(math.ceil(fraction * len(values))))
    return float(np.mean(values[:n]))


def last_value(series: tuple[np.ndarray, np.ndarray] | None) -> float:
    return float(series[1][-1]) if series is not None and len(series[1]) else math.nan


def max_value(series: tuple[np.ndarray, np.ndarray] | None) -> float:
    return float(np.max(series[1])) if series is not None and len(series[1]) else math.nan


STATISTICS = {"tail_mean": tail_mean, "last_eval": last_value, "max": max_value}


# =========================================================================== the decision rule

@dataclass(frozen=True)
class Claim:
    """``value(higher) > value(lower)`` per seed, for ``metric`` reduced by ``statistic``."""

    id: str
    text: str
    source: str
    metric: str          # a logged key, or ACCURACY (resolved to val/avg@K)
    statistic: str       # tail_mean | last_eval | max
    higher: str          # the loss the paper says ends higher
    lower: str


CLAIMS = (
    Claim("1", "GRPO's entropy falls faster / lower than ASPO's", "Sec. 7.3, Fig. 2",
          "train/entropy", "tail_mean", higher="aspo", lower="grpo"),
    Claim("2", "GRPO's repetition rate grows more than ASPO's", "Sec. 7.3, Fig. 2, App. C",
          "train/repetition_rate", "tail_mean", higher="grpo", lower="aspo"),
    Claim("3", "GRPO's positive clip ratio rises more than ASPO's", "Sec. 7.3, Fig. 2",
          "clip/pos_high", "tail_mean", higher="grpo", lower="aspo"),
    Claim("4", "ASPO ends with higher held-out accuracy than GRPO", "Sec. 7.2-7.3, Table 1, Fig. 2",
          ACCURACY, "last_eval", higher="aspo", lower="grpo"),
    Claim("5a", "GRPO w/o IS ends higher than GRPO (held-out accuracy)", "Table 4",
          ACCURACY, "last_eval", higher="grpo_no_is", lower="grpo"),
    Claim("5b", "GRPO w/o IS is more stable than GRPO (slower entropy decay)", "Sec. 4.2.1, Fig. 2",
          "train/entropy", "tail_mean", higher="grpo_no_is", lower="grpo"),
    Claim("6a", "GRPO w/ Pos. Resp. IS Mean ends higher than GRPO (held-out accuracy)", "Table 4, Sec. 5.3.1",
          ACCURACY, "last_eval", higher="grpo_pos_mean", lower="grpo"),
    Claim("6b", "GRPO w/ Pos. Resp. IS Mean is more stable than GRPO (slower entropy decay)",
          "Sec. 5.3.1, Fig. 2", "train/entropy", "tail_mean", higher="grpo_pos_mean", lower="grpo"),
    Claim("7", "Without dual clip, grad-norm spikes are larger (max grad norm)", "App. C, Fig. 8",
          "train/grad_norm", "max", higher="aspo_no_dual_clip", lower="aspo"),
)


@dataclass
class Verdict:
    verdict: str          # supported | not supported | inconclusive | no data
    diff: float           # mean(higher) - mean(lower): > 0 is the claimed direction
    margin: float         # k x pooled standard error
    n_higher: int
    n_lower: int
    mean_higher: float
    mean_lower: float
    std_higher: float
    std_lower: float
    p_value: float = math.nan  # Welch's t-test, two-sided (information only: the 2xSE rule decides)


def pooled_se(a: Sequence[float], b: Sequence[float]) -> float:
    """Standard error of ``mean(a) - mean(b)`` with the pooled variance (NaN if n_a + n_b < 3)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    na, nb = len(a), len(b)
    if na < 1 or nb < 1 or na + nb < 3:
        return math.nan
    ss = (np.var(a, ddof=1) * (na - 1) if na > 1 else 0.0) + (np.var(b, ddof=1) * (nb - 1) if nb > 1 else 0.0)
    sp2 = ss / (na + nb - 2)
    return float(math.sqrt(sp2 * (1.0 / na + 1.0 / nb)))


def verdict(higher: Sequence[float], lower: Sequence[float], k: float = 2.0) -> Verdict:
    """The decision rule: the claim is ``mean(higher) > mean(lower)``.

    *supported* when the difference is positive and larger than ``k`` x the pooled standard error,
    *not supported* when it is negative by more than that margin, else *inconclusive* (also with
    fewer than 2 seeds for either loss: no spread, no test). NaN values are dropped.
    """
    a = [float(x) for x in higher if x is not None and math.isfinite(x)]
    b = [float(x) for x in lower if x is not None and math.isfinite(x)]

    def _std(x):
        return float(np.std(x, ddof=1)) if len(x) > 1 else math.nan

    ma = float(np.mean(a)) if a else math.nan
    mb = float(np.mean(b)) if b else math.nan
    if not a or not b:
        return Verdict("no data", math.nan, math.nan, len(a), len(b), ma, mb, _std(a), _std(b))
    diff = ma - mb
    margin = k * pooled_se(a, b) if len(a) >= 2 and len(b) >= 2 else math.nan
    if not math.isfinite(margin):
        word = "inconclusive"
    elif diff > margin:
        word = "supported"
    elif diff < -margin:
        word = "not supported"
    else:
        word = "inconclusive"
    return Verdict(word, diff, margin, len(a), len(b), ma, mb, _std(a), _std(b), welch_p(a, b))


def welch_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of Welch's t-test (unequal variances) of ``mean(a) - mean(b)``; NaN with
    fewer than 2 values per side or no spread at all."""
    from scipy.stats import ttest_ind

    if len(a) < 2 or len(b) < 2 or (np.ptp(a) == 0 and np.ptp(b) == 0):
        return math.nan
    return float(ttest_ind(a, b, equal_var=False).pvalue)


# =========================================================================== collecting results

@dataclass
class Results:
    study: Study
    metrics: dict[str, Series]                  # run name -> merged series
    status: dict[str, str]                      # run name -> done | failed | running/partial | missing
    accuracy_key: str
    pass_key: str
    val_k: str
    configs: dict[str, dict]                    # run name -> saved LightningCLI config (parsed)
    health: dict[str, dict]                     # run name -> health.json
    markers: dict[str, dict]
    failures: dict[str, dict]
    invocations: list[dict]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def _saved_config(run_dir: Path) -> dict:
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
    metrics, status, configs, health, markers, failures = {}, {}, {}, {}, {}, {}
    for run in plan(study):
        directory = run.dir(study)
        metrics[run.name] = load_run_metrics(directory) if directory.is_dir() else {}
        if run.done_marker(study).exists():
            status[run.name] = "done"
            markers[run.name] = _read_json(run.done_marker(study))
        elif run.failed_marker(study).exists():
            status[run.name] = "failed"
            failures[run.name] = _read_json(run.failed_marker(study))
        elif metrics[run.name]:
            status[run.name] = "partial"
        else:
            status[run.name] = "missing"
        configs[run.name] = _saved_config(directory) if directory.is_dir() else {}
        for version in reversed(version_dirs(directory)):
            if (version / "health.json").is_file():
                health[run.name] = _read_json(version / "health.json")
                break
    # only finished runs enter the figures, tables and verdicts (a partial run's last value is not final)
    metrics = {name: (m if status[name] == "done" else {}) for name, m in metrics.items()}
    fits = [m for name, m in metrics.items() if m]
    acc_key = accuracy_key(fits) if fits else "val/avg@4"
    if not acc_key.startswith("val/"):
        acc_key = "val/avg@4"
    val_k = acc_key.rsplit("@", 1)[-1]
    pass_key = acc_key.replace("avg@", "pass@")
    invocations = _read_json(study.out_dir / "study.json").get("invocations", [])
    return Results(study, metrics, status, acc_key, pass_key, val_k, configs, health, markers,
                   failures, invocations)


def per_seed(results: Results, loss: str, metric: str, statistic: str) -> list[float]:
    """One number per seed of ``loss`` (NaN where the run has no such metric)."""
    key = results.accuracy_key if metric == ACCURACY else metric
    fn = STATISTICS[statistic]
    out = []
    for seed in results.study.seeds:
        series = results.metrics.get(f"{loss}_s{seed}", {}).get(key)
        out.append(fn(series, results.study.tail_fraction) if statistic == "tail_mean" else fn(series))
    return out


def base_accuracy(results: Results, key: str) -> list[float]:
    return [last_value(results.metrics.get(f"base_s{s}", {}).get(key)) for s in results.study.seeds]


def judge(results: Results) -> list[tuple[Claim, Verdict]]:
    out = []
    for claim in CLAIMS:
        if claim.higher not in results.study.losses or claim.lower not in results.study.losses:
            out.append((claim, verdict([], [])))
            continue
        out.append((claim, verdict(per_seed(results, claim.higher, claim.metric, claim.statistic),
                                   per_seed(results, claim.lower, claim.metric, claim.statistic))))
    return out


# =========================================================================== figures

def _aggregate(curves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean and std over seeds at each step (steps any seed logged), and the seed count."""
    by_step: dict[float, list[float]] = defaultdict(list)
    for steps, values in curves:
        for s, v in zip(steps.tolist(), values.tolist()):
            by_step[s].append(v)
    steps = np.array(sorted(by_step), dtype=np.float64)
    mean = np.array([np.mean(by_step[s]) for s in steps])
    std = np.array([np.std(by_step[s], ddof=1) if len(by_step[s]) > 1 else 0.0 for s in steps])
    count = np.array([len(by_step[s]) for s in steps])
    return steps, mean, std, count


def plot_overlays(results: Results, path: Path) -> Path:
    """Fig. 2-style panels, one line per loss: mean over seeds, band = ± 1 std over seeds.
    Train curves are EMA-smoothed per seed (``smooth``) before averaging; accuracy and grad norm are not."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    study = results.study
    fig = Figure(figsize=(15, 8), layout="constrained")
    axes = fig.subplots(2, 3).reshape(-1)
    for ax, (key, title) in zip(axes, STUDY_PANELS):
        is_accuracy = key is None
        key = results.accuracy_key if is_accuracy else key
        for i, loss in enumerate(study.losses):
            curves = []
            for seed in study.seeds:
                series = results.metrics.get(f"{loss}_s{seed}", {}).get(key)
                if series is None or not len(series[0]):
                    continue
                steps, values = series
                if is_accuracy:  # start every curve at the untrained model's accuracy (step 0)
                    base = results.metrics.get(f"base_s{seed}", {}).get(key)
                    if base is not None and len(base[1]) and (not len(steps) or steps[0] > 0):
                        steps, values = np.r_[0.0, steps], np.r_[base[1][-1], values]
                elif key not in UNSMOOTHED:
                    values = ema_smooth(values, study.smooth)
                curves.append((steps, values))
            if not curves:
                continue
            steps, mean, std, _ = _aggregate(curves)
            color = f"C{i}"
            ax.plot(steps, mean, color=color, lw=1.5, label=f"{label(loss)} (n={len(curves)})",
                    marker="o" if is_accuracy else None, ms=3)
            ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.15, lw=0)
        ylabel = key if not is_accuracy else f"{key} (held-out)"
        ax.set(title=title if not is_accuracy else f"Held-out accuracy (avg@{results.val_k})",
               xlabel="training step (rollout batch, as logged)", ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{study.name}: mean ± 1 std over seeds {study.seeds}"
                 f" (train curves EMA {study.smooth:g}, grad norm raw); accuracy at step 0 = untrained testbed")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _token_weight_figures(run_dir: Path) -> list[Path]:
    found = [Path(p) for p in glob.glob(str(run_dir / "version_*" / "figures" / "token_weights_step*.png"))]

    def key(p: Path):
        match = re.search(r"step(\d+)", p.name)
        return (int(match.group(1)) if match else -1, _version_number(str(p)))

    return sorted(found, key=key)


def copy_fig4(results: Results, figures_dir: Path) -> dict[str, Path]:
    """The last token-weight surface of the first seed of grpo and aspo -> ``fig4_<loss>.png``."""
    out = {}
    seed = results.study.seeds[0]
    for loss in ("grpo", "aspo"):
        if loss not in results.study.losses:
            continue
        found = _token_weight_figures(results.study.runs_dir / f"{loss}_s{seed}")
        if found:
            target = figures_dir / f"fig4_{loss}.png"
            figures_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(found[-1], target)
            out[loss] = target
    return out


# =========================================================================== the report

def _fmt(x: float, pct: bool = False) -> str:
    """3 significant digits (accuracy in % with one decimal); n/a for NaN."""
    if x is None or not math.isfinite(x):
        return "n/a"
    if pct:
        return f"{x:.1f}"
    return f"{x:.3g}"


def _mean_std(values: Sequence[float], scale: float = 1.0) -> str:
    """``mean ± std`` over seeds (sample std; ``(n=1)`` for one value)."""
    v = [x * scale for x in values if x is not None and math.isfinite(x)]
    pct = scale != 1.0
    if not v:
        return "n/a"
    if len(v) == 1:
        return f"{_fmt(v[0], pct)} (n=1)"
    mean, std = float(np.mean(v)), float(np.std(v, ddof=1))
    if std < 1e-9 * max(1.0, abs(mean)):
        std = 0.0
    return f"{_fmt(mean, pct)} ± {_fmt(std, pct)}"


def _get(d: Mapping, *keys, default=None):
    for k in keys:
        if not isinstance(d, Mapping) or k not in d:
            return default
        d = d[k]
    return d


def _budget_lines(results: Results) -> list[str]:
    study = results.study
    fit_names = [f"{loss}_s{s}" for s in study.seeds for loss in study.losses]
    cfg = next((results.configs[n] for n in fit_names if results.configs.get(n)), {})
    data = _get(cfg, "data", "init_args", default={}) or {}
    model = _get(cfg, "model", default={}) or {}
    trainer = _get(cfg, "trainer", default={}) or {}
    batch, mini = data.get("batch_size"), model.get("mini_batch_size")
    epochs = model.get("ppo_epochs", 1)
    per_batch = (batch // mini) * epochs if batch and mini else None
    rollouts = study.max_steps // per_batch if per_batch else None
    lines = [
        f"* Runs: {len(study.losses)} losses × {len(study.seeds)} seeds = {len(fit_names)} `fit` runs"
        + (f" + {len(study.seeds)} `validate` runs of the untrained testbed" if study.base_eval else "")
        + f"; every run: `trainer.max_steps={study.max_steps}` optimizer steps.",
    ]
    if per_batch:
        group = data.get("group_size")
        lines.append(
            f"* Per run: {rollouts} rollout batches × {batch} prompts × G = {group} responses "
            f"(≤ {data.get('max_response_length')} tokens, temperature {data.get('temperature')}); "
            f"{per_batch} optimizer steps per rollout batch (mini-batch {mini} prompts, "
            f"ppo_epochs {epochs}); lr {model.get('lr')}, ε = "
            f"{_get(model, 'loss_kwargs', 'eps_high', default='?')}, dual clip "
            f"{_get(model, 'loss_kwargs', 'dual_clip', default='?')}, KL β = {model.get('kl_coef')}.")
        lines.append(
            f"* Data: {_task(data)}, {data.get('num_train')} training problems; "
            f"held-out evaluation on {data.get('num_val')} problems × K = {data.get('val_k')} samples at "
            f"temperature {data.get('val_temperature')}, every {trainer.get('val_check_interval')} rollout "
            f"batches and at the end. A logged step (the figures' x axis) is one rollout batch.")
    model = model.get("model_name_or_path")
    if model:
        meta = _read_json(Path(model) / "testbed.json") if Path(str(model)).is_dir() else {}
        extra = (f" ({meta.get('num_parameters', 0) / 1e6:.2f}M parameters, warm-started for "
                 f"{meta.get('sft_steps')} SFT steps)") if meta else ""
        lines.append(f"* Model: `{_show(model) if Path(str(model)).is_dir() else model}`{extra}, the same "
                     "folder for every run.")
    lines.append(f"* Parallelism: {study.jobs} runs at a time, {study.threads_per_job} thread(s) each "
                 f"(`OMP_NUM_THREADS`), on a machine with {os.cpu_count()} cores.")
    walls = [m.get("wall_s") for m in results.markers.values() if m.get("kind") == "fit" and m.get("wall_s")]
    by_loss = {}
    for loss in study.losses:
        w = [results.markers.get(f"{loss}_s{s}", {}).get("wall_s") for s in study.seeds]
        w = [x for x in w if x]
        if w:
            by_loss[loss] = float(np.mean(w))
    if walls:
        lines.append(f"* Measured wall time per `fit` run: mean {np.mean(walls) / 60:.1f} min "
                     f"(min {min(walls) / 60:.1f}, max {max(walls) / 60:.1f}); per loss: "
                     + ", ".join(f"{label(k)} {v / 60:.1f}" for k, v in by_loss.items()) + " min.")
    step_s = [float(np.mean(results.metrics[n]["timing/step_s"][1])) for n in fit_names
              if "timing/step_s" in results.metrics.get(n, {})]
    lengths = [float(np.mean(results.metrics[n]["response/length_mean"][1])) for n in fit_names
               if "response/length_mean" in results.metrics.get(n, {})]
    longest = [max_value(results.metrics[n].get("response/length_max")) for n in fit_names
               if "response/length_max" in results.metrics.get(n, {})]
    if lengths:
        lines.append(f"* Measured response length: {np.mean(lengths):.1f} tokens on average, longest "
                     f"{_fmt(max(longest, default=math.nan))} (`response/length_mean`, `response/length_max`).")
    rollout_s = [float(np.mean(results.metrics[n]["timing/rollout_s"][1])) for n in fit_names
                 if "timing/rollout_s" in results.metrics.get(n, {})]
    if step_s and rollout_s:
        lines.append(f"* Mean time per rollout batch: generation {np.mean(rollout_s):.1f} s (`timing/rollout_s`) "
                     f"+ old log-probs and updates {np.mean(step_s):.1f} s (`timing/step_s`).")
    if results.invocations:
        total = sum(inv.get("wall_s", 0.0) for inv in results.invocations)
        loads = [inv.get("load_start") for inv in results.invocations if inv.get("load_start") is not None]
        lines.append(
            f"* Measured wall time of the study: {total / 60:.1f} min over {len(results.invocations)} "
            f"invocation(s) of `python -m aspo_lit study` (load average at start: "
            + ", ".join(f"{x:.1f}" for x in loads) + ").")
    return lines


def _task(data: Mapping) -> str:
    """The testbed task of a run's data section, in words."""
    if data.get("ops") is not None:
        return f"multi-step chains of {data['ops']} operations (values 0–{data.get('max_value', 99)})"
    return f"arithmetic levels {data.get('levels')}"


def _regime_lines(results: Results) -> list[str]:
    """How far off-policy the updates were: the range of the per-step mean IS ratios and the
    largest dual-clip fractions over all finished runs (what the losses can differ on)."""
    study = results.study
    runs = [results.metrics.get(f"{loss}_s{s}", {}) for loss in study.losses for s in study.seeds]

    def span(key):
        v = np.concatenate([m[key][1] for m in runs if key in m]) if any(key in m for m in runs) else np.array([])
        return (float(v.min()), float(v.max())) if v.size else None

    pos, neg = span("ratio/pos_mean"), span("ratio/neg_mean")
    dual = [span(k) for k in ("clip/pos_dual", "clip/neg_dual")]
    lines: list[str] = []
    if pos is not None or neg is not None:
        lines += _ratio_lines(pos, neg, dual)
    return lines + _profile_lines(results, runs)


def _ratio_lines(pos, neg, dual) -> list[str]:
    text = ("Off-policy regime, over every step of every run: the mean IS ratio of the A > 0 tokens "
            f"(`ratio/pos_mean`) stayed within [{_fmt(pos[0]) if pos else 'n/a'}, {_fmt(pos[1]) if pos else 'n/a'}]"
            f", of the A < 0 tokens (`ratio/neg_mean`) within [{_fmt(neg[0]) if neg else 'n/a'}, "
            f"{_fmt(neg[1]) if neg else 'n/a'}]")
    if any(dual):
        text += ("; the largest share of dual-clipped tokens in a step was "
                 + ", ".join(f"{_fmt(d[1])} (`{k}`)" for d, k in zip(dual, ("clip/pos_dual", "clip/neg_dual")) if d))
    return [text + ".", ""]


def _profile_lines(results: Results, runs: list[Series]) -> list[str]:
    """The profile's measured properties (the protocol's targets), from the runs themselves."""
    study, lines = results.study, []
    first = {key: [float(m[key][1][0]) for m in runs if key in m and len(m[key][1])]
             for key in ("train/entropy", "response/length_mean")}
    if first["train/entropy"]:
        lines += [f"Profile properties measured in these runs: the first rollout batch's mean token entropy "
                  f"(`train/entropy`) {_mean_std(first['train/entropy'])} nats (target ≥ 0.5), its mean "
                  f"response length {_mean_std(first['response/length_mean'])} tokens (target 80–300) "
                  f"over {len(first['train/entropy'])} runs. The share of A > 0 tokens with r > 1 + ε "
                  "(`clip/pos_high`), maximum over the steps of a run (target ≥ 5 % at some step):", ""]
        lines += ["| loss | max `clip/pos_high` per seed | runs reaching 5 % |", "|---|---|---|"]
        for loss in study.losses:
            peaks = per_seed(results, loss, "clip/pos_high", "max")
            hit = sum(x >= 0.05 for x in peaks if math.isfinite(x))
            lines.append(f"| {label(loss)} | {' / '.join(_fmt(x) for x in peaks)} | "
                         f"{hit} of {sum(math.isfinite(x) for x in peaks)} |")
        lines.append("")
    return lines


def render_report(results: Results, figures: Mapping[str, Path]) -> str:
    """The Markdown report (figures given as paths; links are written relative to the report)."""
    study = results.study
    root = study.report.parent

    def rel(p: Path) -> str:
        return os.path.relpath(p, root)

    k = results.val_k
    cmd = f"python -m aspo_lit study --config {_show(study.path)}"
    lines = [
        f"# The CPU-scale study: {study.name}",
        "",
        f"_Generated by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M')}; do not edit by hand "
        f"(`--report-only` re-renders it from `{_show(study.out_dir)}`)._",
        "",
        "Does the mechanism of the paper (Sec. 4-7) show up on the CPU testbed? Every loss is trained "
        "with identical data, seeds and budget on the tiny arithmetic testbed model; nothing is tuned "
        "per loss. This page reports what was measured; a claim that does not reproduce at this "
        "scale is a finding about the testbed, not a statement about the paper's setting.",
        "",
    ]
    if study.description:
        lines += [str(study.description).strip(), ""]

    # ---- verdicts
    lines += ["## Verdicts per claim", "",
              "Decision rule: for every seed, the *final* value of the metric — the mean over the last "
              f"{study.tail_fraction:.0%} of the logged training steps for training metrics, the last "
              "held-out evaluation for accuracy, and the maximum over the run for the grad norm of "
              "claim 7 — then the difference of the two losses' means over seeds. **supported** when "
              "it is in the claimed direction and larger than 2 × the pooled standard error "
              "(pooled variance, SE = s_p·√(1/n₁ + 1/n₂)); **not supported** when it is in the opposite "
              "direction by that margin; **inconclusive** otherwise (and with fewer than 2 seeds). "
              "Each line also gives the two-sided p-value of Welch's t-test (unequal variances) of the "
              "same difference, as information: the 2·SE rule decides, and no correction for the "
              "number of claims is applied.", ""]
    judged = judge(results)
    counts = defaultdict(int)
    for _, v in judged:
        counts[v.verdict] += 1
    lines += ["Summary: " + ", ".join(f"{n} {w}" for w, n in sorted(counts.items(), key=lambda x: -x[1]))
              + f" (of {len(judged)} claim lines).", ""]
    for claim, v in judged:
        metric = f"val/avg@{k}" if claim.metric == ACCURACY else claim.metric
        stat = {"tail_mean": f"last-{study.tail_fraction:.0%} mean", "last_eval": "last evaluation",
                "max": "max over the run"}[claim.statistic]
        scale = 100.0 if claim.metric == ACCURACY else 1.0
        unit = " (%)" if scale != 1.0 else ""
        missing = [x for x in (claim.higher, claim.lower) if x not in study.losses]
        if missing:
            detail = f"not tested: {', '.join(label(x) for x in missing)} not in this study"
        elif v.verdict == "no data":
            detail = f"no finished run logged `{claim.metric}` for {label(claim.higher)} and/or {label(claim.lower)}"
        else:
            detail = (f"`{metric}`{unit} ({stat}) {label(claim.higher)} "
                      f"{_mean_std(per_seed(results, claim.higher, claim.metric, claim.statistic), scale)}"
                      f" vs {label(claim.lower)} "
                      f"{_mean_std(per_seed(results, claim.lower, claim.metric, claim.statistic), scale)}"
                      f" (n = {v.n_higher}/{v.n_lower}); difference {_fmt(v.diff * scale, scale != 1.0)}, "
                      f"2×SE = {_fmt(v.margin * scale, scale != 1.0)}, Welch p = {_fmt(v.p_value)}")
        values = [x for loss in (claim.higher, claim.lower)
                  for x in per_seed(results, loss, claim.metric, claim.statistic) if math.isfinite(x)]
        hi = per_seed(results, claim.higher, claim.metric, claim.statistic)
        lo = per_seed(results, claim.lower, claim.metric, claim.statistic)
        if len(values) > 1 and max(values) == min(values):
            detail += f" — no signal: the metric is {_fmt(values[0])} in every run"
        elif values and all(math.isfinite(a) and a == b for a, b in zip(hi, lo)):
            detail += f" — the two losses gave identical values for every seed"
        lines.append(f"* **({claim.id}) {claim.text}** ({claim.source}) — **{v.verdict}**: {detail}.")
    lines.append("")

    # ---- figures
    lines += ["## Training dynamics (Fig. 2 style)", ""]
    if "overlays" in figures:
        lines += [f"![Fig. 2-style overlays]({rel(figures['overlays'])})", "",
                  f"One line per loss: the mean over seeds {study.seeds}, the band ± 1 std over seeds. "
                  f"Training curves are smoothed per seed with an EMA of weight {study.smooth:g} for "
                  "display (the grad norm is raw; the verdicts use the raw values). Held-out accuracy starts at the untrained "
                  "model's accuracy (step 0, the `validate` run of the same seed). The grad-norm panel "
                  "is Fig. 8's quantity (ASPO with vs without dual clip).", ""]
    lines += ["Final values (mean ± std over seeds; first → last "
              f"{study.tail_fraction:.0%} of logged steps; grad norm: mean and max over the run):", ""]
    header = ["loss"] + [m for m in DYNAMICS] + ["train/grad_norm mean", "train/grad_norm max", "health"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for loss in study.losses:
        row = [label(loss)]
        for metric in DYNAMICS:
            first = per_seed(results, loss, metric, "tail_mean")
            start = [head_mean(results.metrics.get(f"{loss}_s{s}", {}).get(metric), study.tail_fraction)
                     for s in study.seeds]
            row.append(f"{_mean_std(start)} → {_mean_std(first)}")
        gmean = [float(np.mean(results.metrics[f"{loss}_s{s}"]["train/grad_norm"][1]))
                 for s in study.seeds if "train/grad_norm" in results.metrics.get(f"{loss}_s{s}", {})]
        row.append(_mean_std(gmean))
        row.append(_mean_std(per_seed(results, loss, "train/grad_norm", "max")))
        verdicts = [results.health.get(f"{loss}_s{s}", {}).get("verdict") for s in study.seeds]
        counts = defaultdict(int)
        for x in verdicts:
            counts[x or "n/a"] += 1
        row.append(", ".join(f"{n}× {w}" for w, n in sorted(counts.items())))
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("`health` is each run's `health.json` verdict (`HealthMonitor`, App. D: healthy / watch / "
                 "collapsed).")
    lines.append("")
    lines += _regime_lines(results)

    # ---- per-seed values
    columns = [("train/entropy", "tail_mean", 1.0), ("train/repetition_rate", "tail_mean", 1.0),
               ("clip/pos_high", "tail_mean", 1.0), ("train/kl", "tail_mean", 1.0),
               ("train/grad_norm", "max", 1.0), (ACCURACY, "last_eval", 100.0)]
    names = [f"{m if m != ACCURACY else results.accuracy_key} ({'max' if st == 'max' else 'final'})"
             for m, st, _ in columns]
    lines += [f"Per-seed values entering the verdicts (seeds {' / '.join(map(str, study.seeds))}; "
              "accuracy in %):", "",
              "| loss | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for loss in study.losses:
        cells = []
        for metric, statistic, scale in columns:
            vals = per_seed(results, loss, metric, statistic)
            cells.append(" / ".join(_fmt(x * scale, scale != 1.0) for x in vals))
        lines.append(f"| {label(loss)} | " + " | ".join(cells) + " |")
    lines.append("")

    # ---- Fig. 4
    lines += ["## Token-weight surfaces (Fig. 4)", ""]
    if figures.get("fig4_grpo") or figures.get("fig4_aspo"):
        lines.append(f"The last `token_weights_step*.png` of seed {study.seeds[0]}: the mean effective "
                     "token weight per (π_old, π) bin, A > 0 left, A < 0 right (the last window of steps only). "
                     "What the paper's Fig. 4 shows off the diagonal: GRPO's A > 0 weight grows toward "
                     "the top-left (π ≫ π_old), ASPO's flipped weight toward the bottom-right. How far "
                     "tokens get from the diagonal at all is the off-policy regime line above.")
        lines.append("")
        for loss in ("grpo", "aspo"):
            if figures.get(f"fig4_{loss}"):
                lines += [f"**{label(loss)}**", "", f"![Fig. 4 {label(loss)}]({rel(figures[f'fig4_{loss}'])})", ""]
    else:
        lines += ["No token-weight figure was found (grpo/aspo not in the study or not run).", ""]

    # ---- Table 4
    lines += [f"## Final held-out accuracy (Table 4 style)", "",
              f"Last evaluation of each run on the held-out arithmetic split, K = {k} samples per "
              "problem; mean ± std over seeds, in %. The paper's Table 4 (Qwen3-4B, average over six "
              "math benchmarks) is shown for the losses it has — a different model and task, for the "
              "direction only.", "",
              f"| model | avg@{k} | pass@{k} | seeds | paper Table 4 avg |", "|---|---|---|---|---|"]
    lines.append(f"| initial model (testbed, before RL) | "
                 f"{_mean_std(base_accuracy(results, results.accuracy_key), 100)} | "
                 f"{_mean_std(base_accuracy(results, results.pass_key), 100)} | "
                 f"{sum(math.isfinite(x) for x in base_accuracy(results, results.accuracy_key))} | |")
    for loss in study.losses:
        acc = per_seed(results, loss, results.accuracy_key, "last_eval")
        pk = per_seed(results, loss, results.pass_key, "last_eval")
        paper = PAPER_TABLE4_AVG.get(loss)
        lines.append(f"| {label(loss)} | {_mean_std(acc, 100)} | {_mean_std(pk, 100)} | "
                     f"{sum(math.isfinite(x) for x in acc)} | {paper if paper is not None else ''} |")
    lines.append("")

    # ---- budget
    lines += ["## Budget and wall time", ""] + _budget_lines(results) + [""]

    # ---- runs
    lines += ["## Runs", "",
              f"Runs, logs and markers under `{_show(study.out_dir)}` "
              "(`runs/<name>/version_*/metrics.csv`, `logs/<name>.log`).", ""]
    problems = [n for n, s in results.status.items() if s != "done"]
    if not problems:
        lines.append(f"All {len(results.status)} runs finished.")
    else:
        for name in problems:
            s = results.status[name]
            if s == "failed":
                f = results.failures.get(name, {})
                lines.append(f"* `{name}`: **failed** (exit {f.get('rc')}), log `{f.get('log')}`")
            else:
                lines.append(f"* `{name}`: {s} (not finished, left out of the figures and verdicts; "
                             "rerun the study to resume it)")
    lines.append("")
    return "\n".join(lines)


def write_report(study: Study, echo=print) -> Path:
    results = collect(study)
    figures: dict[str, Path] = {}
    study.figures_dir.mkdir(parents=True, exist_ok=True)
    if any(results.metrics.values()):
        figures["overlays"] = plot_overlays(results, study.figures_dir / "figure2_overlays.png")
    figures.update({f"fig4_{k}": v for k, v in copy_fig4(results, study.figures_dir).items()})
    text = render_report(results, figures)
    study.report.parent.mkdir(parents=True, exist_ok=True)
    study.report.write_text(text)
    echo(f"[study] report: {study.report}")
    for claim, v in judge(results):
        echo(f"[study]   ({claim.id}) {v.verdict:<13} {claim.text}")
    return study.report


# =========================================================================== the command

def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aspo_lit study", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="study YAML (conf/study/default.yaml, quick.yaml)")
    parser.add_argument("--jobs", type=int, default=None, help="runs in parallel (default: the YAML's jobs)")
    parser.add_argument("--report-only", action="store_true", help="only (re)write the report from the runs")
    parser.add_argument("--out-dir", default=None, help="override the YAML's out_dir")
    parser.add_argument("--report", default=None, help="override the YAML's report path (.md)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    try:
        study = load_study(args.config, jobs=args.jobs, out_dir=args.out_dir, report=args.report)
    except (OSError, ValueError) as err:
        print(f"aspo-lit study: {err}", file=sys.stderr)
        return 2
    runs = plan(study)
    if args.dry_run:
        for run in runs:
            print(f"# {run.name}: {state(run, study)}")
            print(" ".join(command(run, study, resume=state(run, study) == "resume")))
        return 0
    failed = []
    if not args.report_only:
        study.out_dir.mkdir(parents=True, exist_ok=True)
        todo = [r for r in runs if state(r, study) != "done"]
        print(f"[study] {study.name}: {len(runs)} runs ({len(runs) - len(todo)} done), {study.jobs} at a time, "
              f"{study.threads_per_job} thread(s) each; out_dir {study.out_dir}", flush=True)
        start, load = time.time(), os.getloadavg()[0]
        if not todo:
            args.report_only = True  # nothing to run: only the report
    if not args.report_only:
        if study.prebuild_testbed:
            if prebuild_testbed(study) != 0:
                print(f"[study] building the testbed failed; see {study.logs_dir / 'build_testbed.log'}",
                      file=sys.stderr)
                return 1
        executor = Executor(study, echo=lambda m: print(m, flush=True))
        outcome = executor.run_all(runs)
        wall = time.time() - start
        failed = [o for o in outcome if o["status"] == "failed"]
        ran = [o["name"] for o in outcome if o["status"] in ("done", "failed", "interrupted")]
        if ran:
            record = _read_json(study.out_dir / "study.json")
            record.setdefault("invocations", []).append({
                "model": study.model_path, "started": start, "wall_s": round(wall, 1), "jobs": study.jobs,
                "threads": study.threads_per_job, "load_start": load, "load_end": os.getloadavg()[0],
                "ran": ran, "failed": [o["name"] for o in failed],
                "interrupted": executor.stop.is_set()})
            _write_json(study.out_dir / "study.json", record)
        print(f"[study] ran {len(ran)} runs in {wall / 60:.1f} min", flush=True)
        if executor.stop.is_set():
            print("[study] interrupted; rerun the same command to resume", flush=True)
            return 130
    write_report(study, echo=lambda m: print(m, flush=True))
    for o in failed:
        print(f"[study] FAILED {o['name']}: {o.get('log')}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
