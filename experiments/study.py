"""The CPU-scale study: do the paper's training dynamics show up on the testbed?

    python -m aspo_lit study --config conf/study/default.yaml [--jobs 2] [--report_only true]

Trains every ``(loss, seed)`` of a study YAML with identical data, seeds and budget (one
``python -m aspo_lit fit`` subprocess each, run as a submitit job: locally at most ``jobs`` at a
time with ``cores // jobs`` threads each, or as a SLURM job array), validates the untrained
testbed once per seed with the same held-out settings (the "initial model" row), then writes the
report of :mod:`experiments.report` (``docs/studies/study.md`` + PNG figures beside it; the protocol it
applies: docs/studies/study-protocol.md).

Study YAML keys (paths in ``base_config`` are relative to the study file, the others to the
working directory)::

    name: default                 # a label for the report
    description: "..."            # free text, copied into the report (budget rationale)
    base_config: ../tiny/aspo.yaml   # fit config (str or list, composed left to right)
    losses: [grpo, grpo_no_is, grpo_pos_mean, aspo, aspo_no_dual_clip]
    seeds: [0, 1, 2]
    max_steps: 256                # optimizer steps of every run
    overrides: ["--data.init_args.levels=[1,2,3]", ...]   # CLI overrides for every fit/validate
    out_dir: runs/study           # runs, logs, markers, submitit's job files
    jobs: 2                       # runs at a time (SLURM: the array's parallelism)
    threads: null                 # threads per run (default cpu_count // jobs; SLURM: cpus_per_task)
    report: docs/studies/study.md # figures go to <report without .md>/
    tail_fraction: 0.2            # "final" train metric = mean over the last 20% of logged steps
    smooth: 0.6                   # EMA weight of the plotted curves (display only)
    base_eval: true               # validate the untrained model once per seed
    model_path: null              # (set when the model is a shipped testbed) the folder every run gets
    executor: local               # local | slurm (submitit)
    slurm: {}                     # SLURM parameters, e.g. {partition: gpu, gpus_per_node: 1, cpus_per_task: 8}
    timeout_min: 1440             # time limit of one run (SLURM: its --time)

Resumable: a run whose ``done`` marker exists is skipped, a run with ``checkpoints/last.ckpt`` but
no marker continues with ``--ckpt_path last`` (the report merges its metrics over version
folders). A failing run is reported with its log path; the others go on. Ctrl-C stops the runs
cleanly (:mod:`experiments.runner`); rerunning the same command resumes them.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from experiments.report import write_report
from experiments.runner import REPO, Run, RunJob, execute, make_executor, read_json, run_name, write_json


@dataclass
class Study:
    """A study's settings, as `study` (the command) documents them; built by `load_study` or the
    command, never by hand."""

    path: Path | None          # the study YAML (paths in base_config are relative to it)
    name: str
    description: str
    base_config: list[Path]
    losses: list[str]
    seeds: list[int]
    max_steps: int
    overrides: list[str]
    out_dir: Path
    jobs: int
    threads: int | None
    report: Path
    tail_fraction: float
    smooth: float
    base_eval: bool
    executor: str
    slurm: dict[str, Any]
    timeout_min: int
    model_path: str | None = None   # set by pin_testbed: every run gets the shipped testbed's folder
    testbed: str | None = None      # set by pin_testbed: which testbed (and version) the runs train

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
        if self.threads:
            return int(self.threads)
        if self.executor == "slurm":
            return int(self.slurm.get("cpus_per_task", 1))
        return max(1, (os.cpu_count() or 1) // max(1, self.jobs))

    def run(self, kind: str, loss: str | None, seed: int) -> Run:
        name = run_name(loss or "base", seed)
        return Run(name, kind, loss, seed, self.runs_dir / name, self.logs_dir / f"{name}.log")

    def plan(self) -> list[Run]:
        """The grid: base evaluations first (short), then the fits seed-major (a partial study
        stays balanced)."""
        runs = [self.run("base", None, s) for s in self.seeds] if self.base_eval else []
        return runs + [self.run("fit", loss, s) for s in self.seeds for loss in self.losses]


def make_study(path: Path | None, values: dict[str, Any]) -> Study:
    """A checked `Study` from the command's values; `base_config` paths are relative to the study
    file `path` (to the working directory without one)."""
    root = path.parent if path is not None else Path.cwd()
    base = values["base_config"] or [str(REPO / "conf" / "tiny" / "aspo.yaml")]
    study = Study(path=path, **{**values, "base_config": [(root / b).resolve() for b in ([base] if isinstance(base, str) else base)],
                                "overrides": [str(x) for x in values["overrides"] or []], "slurm": dict(values["slurm"] or {}),
                                "out_dir": Path(values["out_dir"]).resolve(), "report": Path(values["report"]).resolve()})
    if study.report.suffix != ".md":
        raise ValueError(f"report must be a .md path, got {study.report}")
    if not study.losses or not study.seeds:
        raise ValueError("a study needs at least one loss and one seed")
    if study.max_steps < 1 or study.jobs < 1 or study.timeout_min < 1:
        raise ValueError("max_steps, jobs and timeout_min must be positive")
    if not 0 < float(study.tail_fraction) <= 1:
        raise ValueError("tail_fraction must be in (0, 1]")
    for b in study.base_config:
        if not b.is_file():
            raise ValueError(f"base_config {b} not found")
    return study


def load_study(path: str | os.PathLike, **overrides: Any) -> Study:
    """The study of a YAML file, read by the command's own parser; keyword values (not None)
    override the file's."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_function_arguments(study, as_group=False, skip=set(RUN_OPTIONS))
    try:
        cfg = parser.parse_args(["--config", str(path)])
    except Exception as err:  # jsonargparse's ArgumentError: an unknown key, a wrong type
        raise ValueError(f"{path}: {err}") from err
    values = {key: cfg[key] for key in SPEC_KEYS}
    values.update({key: value for key, value in overrides.items() if value is not None})
    return make_study(Path(path).resolve(), values)


def command(run: Run, study: Study, resume: bool = False) -> list[str]:
    """The subprocess command line of a run (identical data and budget for every loss)."""
    argv = [sys.executable, "-m", "aspo_lit", "fit" if run.kind == "fit" else "validate"]
    for config in study.base_config:
        argv += ["--config", str(config)]
    argv += list(study.overrides)
    if study.model_path:
        argv += [f"--model.model_name_or_path={study.model_path}"]
    argv += [f"--seed_everything={run.seed}",  # seeds the data and the module too (aspo_lit/maths/seeding.py)
             f"--trainer.logger.init_args.save_dir={study.runs_dir}",
             f"--trainer.logger.init_args.name={run.name}",
             "--trainer.enable_progress_bar=false"]
    if run.kind == "fit":
        argv += [f"--model.loss={run.loss}", f"--trainer.max_steps={study.max_steps}"]
        if resume:
            argv += ["--ckpt_path=last"]
    return argv


def fingerprint(study: Study, run: Run) -> str:
    """What a run's result depends on (paths excluded): recorded in its ``done`` marker."""
    argv = [a for a in command(run, study) if "save_dir=" not in a]
    text = json.dumps([argv[3:], [Path(c).read_text() for c in study.base_config]])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def job(run: Run, study: Study) -> RunJob:
    """The submitit job of a run. Locally the run keeps the study's ``CUDA_VISIBLE_DEVICES``
    (submitit's local controller sets its own)."""
    resume = run.state == "resume"
    environ = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")} if study.executor == "local" else {}
    return RunJob(run, command(run, study, resume=resume), study.threads_per_job, study.jobs, resume,
                  study.max_steps if run.kind == "fit" else None, fingerprint(study, run), environ)


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


def pin_testbed(study: Study, echo=print) -> None:
    """Pin the shipped testbed the base configs name (``study.model_path``) and record which one and
    its version (``study.testbed``, written into ``study.json``): a report names the weights it ran on."""
    from aspo_lit.testbed.shipped import NAMES, describe, identity, shipped_dir

    name = model_name(study)
    if name in NAMES:
        study.model_path = str(shipped_dir(name))
        study.testbed = describe(identity(study.model_path))
        echo(f"[study] testbed: {study.testbed} ({study.model_path})")


def run_all(study: Study, runs: Sequence[Run], echo=print) -> tuple[list[dict], bool]:
    """Run ``runs`` with submitit; append the invocation (wall time, load, what ran) to
    ``<out_dir>/study.json`` for the report's budget section."""
    start, load = time.time(), os.getloadavg()[0]
    executor = make_executor(study.out_dir / "submitit", study.executor, study.jobs, study.timeout_min, study.slurm)
    outcome, interrupted = execute(executor, [job(run, study) for run in runs], study.jobs, echo=echo)
    wall = time.time() - start
    ran = [o["name"] for o in outcome if o["status"] in ("done", "failed", "interrupted")]
    if ran:
        record = read_json(study.out_dir / "study.json")
        record.setdefault("invocations", []).append({
            "model": study.model_path, "testbed": study.testbed, "started": start, "wall_s": round(wall, 1), "jobs": study.jobs,
            "threads": study.threads_per_job, "load_start": load, "load_end": os.getloadavg()[0],
            "executor": study.executor, "ran": ran,
            "failed": [o["name"] for o in outcome if o["status"] == "failed"], "interrupted": interrupted})
        write_json(study.out_dir / "study.json", record)
    echo(f"[study] ran {len(ran)} runs in {wall / 60:.1f} min")
    return outcome, interrupted


RUN_OPTIONS = ("report_only", "dry_run", "config_files")


def study(name: str = "study", description: str = "", base_config: str | list[str] | None = None,
          losses: list[str] = ["grpo", "grpo_no_is", "grpo_pos_mean", "aspo", "aspo_no_dual_clip"],  # noqa: B006
          seeds: list[int] = [0, 1, 2], max_steps: int = 80, overrides: list[str] | None = None,  # noqa: B006
          out_dir: str = "runs/study", jobs: int = 2, threads: int | None = None, report: str = "docs/studies/study.md",
          tail_fraction: float = 0.2, smooth: float = 0.6, base_eval: bool = True,
          executor: Literal["local", "slurm"] = "local", slurm: dict[str, Any] | None = None,
          timeout_min: int = 1440, report_only: bool = False, dry_run: bool = False,
          config_files: list[str] | None = None) -> int:
    """The pre-registered CPU-scale study of the paper's training dynamics (docs/studies/study-protocol.md).

    Args:
        name: a label for the report.
        description: free text, copied into the report (the budget's rationale).
        base_config: the fit config(s), composed left to right; relative to the study file.
        losses: the runs' model.loss values.
        seeds: one run per loss and seed.
        max_steps: optimizer steps of every run.
        overrides: CLI overrides for every fit / validate, e.g. ["--data.init_args.num_val=32"].
        out_dir: runs, logs, markers, submitit's job files.
        jobs: runs at a time (SLURM: the job array's parallelism).
        threads: threads per run (default: cpu_count // jobs; SLURM: cpus_per_task).
        report: the Markdown report; its figures go to <report without .md>/.
        tail_fraction: a "final" train metric is the mean over the last fraction of logged steps.
        smooth: EMA weight of the plotted curves (display only).
        base_eval: validate the untrained model once per seed (the "initial model" row).
        executor: submitit's local processes or a SLURM job array.
        slurm: SLURM parameters, e.g. {partition: gpu, gpus_per_node: 1, cpus_per_task: 8}.
        timeout_min: time limit of one run (SLURM: its --time).
        report_only: only (re)write the report from the runs.
        dry_run: print the commands, run nothing.
    """
    values = {key: value for key, value in locals().items() if key in SPEC_KEYS}
    try:
        spec = make_study(Path(config_files[-1]) if config_files else None, values)
    except (OSError, ValueError) as err:
        print(f"aspo-lit study: {err}", file=sys.stderr)
        return 2
    return run_study(spec, report_only=report_only, dry_run=dry_run)


SPEC_KEYS = tuple(key for key in inspect.signature(study).parameters if key not in RUN_OPTIONS)


def run_study(study: Study, report_only: bool = False, dry_run: bool = False) -> int:
    """Run what is not done yet, then write the report; 1 when a run failed, 130 when interrupted."""
    echo = lambda message: print(message, flush=True)  # noqa: E731
    runs = study.plan()
    if dry_run:
        for run in runs:
            print(f"# {run.name}: {run.state}")
            print(" ".join(command(run, study, resume=run.state == "resume")))
        return 0
    todo = [] if report_only else [r for r in runs if r.state != "done"]
    failed = []
    if not report_only:
        for run in runs:
            recorded = read_json(run.done_marker).get("fingerprint") if run.state == "done" else None
            if recorded not in (None, fingerprint(study, run)):
                echo(f"[study] {run.name}: done under a different config (delete {run.dir} to rerun)")
        echo(f"[study] {study.name}: {len(runs)} runs ({len(runs) - len(todo)} done), {study.jobs} at a time, "
             f"{study.threads_per_job} thread(s) each, executor {study.executor}; out_dir {study.out_dir}")
    if todo:
        study.out_dir.mkdir(parents=True, exist_ok=True)
        pin_testbed(study, echo=echo)
        outcome, interrupted = run_all(study, todo, echo=echo)
        if interrupted:
            echo("[study] interrupted; rerun the same command to resume")
            return 130
        failed = [o for o in outcome if o["status"] == "failed"]
    write_report(study, echo=echo)
    for o in failed:
        print(f"[study] FAILED {o['name']}: {o.get('log')}", file=sys.stderr)
    return 1 if failed else 0
