"""The study's runs as submitit jobs: processes on this machine, or a SLURM job array.

Each run is one ``python -m aspo_lit fit|validate`` subprocess started by the job function
:class:`RunJob`, which appends its output to the run's log and leaves a ``done`` or ``failed``
marker beside its metrics (the study skips a run whose ``done`` marker exists and resumes one that
has ``checkpoints/last.ckpt``). :func:`execute` submits the jobs, at most ``parallel`` at a time:
submitit's local executor has no array parallelism, so it keeps ``parallel`` jobs submitted and
submits the next one when one ends; on SLURM every job goes into one array with
``array_parallelism = parallel``.

Ctrl-C / SIGTERM (:class:`Stop`): the first stops every live run the way ``GracefulInterrupt``
expects (SIGTERM: finish the current rollout batch, save ``last.ckpt``, exit) and starts no new
one; a second one kills the runs. A local job is started with SIGINT ignored, since a terminal's
Ctrl-C reaches the whole process group and submitit's controller answers it by killing its job
within a second; the study forwards the stop itself (a Ctrl-C in the instant a job is being
submitted is therefore not seen: press it again). On SLURM the stop is ``scancel``, which sends
SIGTERM to every process of the job and SIGKILL after the cluster's KillWait.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

REPO = Path(__file__).resolve().parents[1]


def run_name(loss: str, seed: int) -> str:
    """A run's folder name: ``<loss>_s<seed>``, ``base_s<seed>`` for the untrained model."""
    return f"{loss}_s{seed}"


@dataclass(frozen=True)
class Run:
    """One run of the grid and where its files are."""

    name: str
    kind: str               # "fit" | "base" (a `validate` of the untrained testbed)
    loss: str | None
    seed: int
    dir: Path               # the logger's experiment folder: version_*/, checkpoints/, markers
    log: Path               # the subprocess's output, appended by every attempt

    @property
    def done_marker(self) -> Path:
        return self.dir / "done"

    @property
    def failed_marker(self) -> Path:
        return self.dir / "failed"

    @property
    def checkpoint(self) -> Path:
        return self.dir / "checkpoints" / "last.ckpt"

    @property
    def attempts(self) -> Path:
        return self.dir / "attempts.jsonl"

    @property
    def state(self) -> str:
        """``done`` | ``resume`` (a checkpoint, no marker) | ``fresh``."""
        if self.done_marker.exists():
            return "done"
        if self.kind == "fit" and self.checkpoint.exists():
            return "resume"
        return "fresh"


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def run_env(threads: int, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with ``threads`` threads per BLAS/OpenMP pool, unbuffered output and the
    repository on the path."""
    env = dict(environ)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                "VECLIB_MAXIMUM_THREADS"):
        env[key] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


@dataclass
class RunJob:
    """The submitit job of one run: ``argv`` in its own session (only the signals this job passes
    on reach it), then the run's markers. A SIGTERM to the job is passed to the run once; a
    second one kills it."""

    run: Run
    argv: list[str]
    threads: int
    jobs: int                       # runs at a time (recorded with each attempt)
    resumed: bool
    max_steps: int | None
    fingerprint: str                # what the result depends on (study.fingerprint)
    environ: dict[str, str | None] = field(default_factory=dict)   # set (None: removed) for the run

    def __call__(self) -> dict[str, Any]:
        run, stops, child = self.run, [], []

        def stop(signum, frame) -> None:
            stops.append(signum)
            if child and child[0].poll() is None:
                child[0].send_signal(signal.SIGTERM if len(stops) == 1 else signal.SIGKILL)

        signal.signal(signal.SIGTERM, stop)
        env = run_env(self.threads, os.environ)
        for key, value in self.environ.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        run.log.parent.mkdir(parents=True, exist_ok=True)
        run.dir.mkdir(parents=True, exist_ok=True)
        run.failed_marker.unlink(missing_ok=True)
        start = time.time()
        with open(run.log, "a") as handle:
            handle.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.argv)}\n")
            handle.flush()
            child.append(subprocess.Popen(self.argv, cwd=str(REPO), env=env, stdout=handle,
                                          stderr=subprocess.STDOUT, start_new_session=True))
            if stops:  # a stop that came while the run started
                child[0].send_signal(signal.SIGTERM)
            try:
                rc = child[0].wait()
            finally:  # the job itself is ending (its time limit): stop the run as on SIGTERM
                if child[0].poll() is None:
                    child[0].terminate()
                    child[0].wait()
        wall = time.time() - start
        with open(run.attempts, "a") as f:
            f.write(json.dumps({"started": start, "wall_s": round(wall, 1), "rc": rc, "resumed": self.resumed,
                                "threads": self.threads, "jobs": self.jobs}) + "\n")
        outcome = {"name": run.name, "rc": rc, "wall_s": wall, "log": str(run.log)}
        if stops:
            return {**outcome, "status": "interrupted"}
        if rc != 0:
            write_json(run.failed_marker, {"rc": rc, "log": str(run.log), "wall_s": round(wall, 1)})
            return {**outcome, "status": "failed"}
        attempts = read_jsonl(run.attempts)
        write_json(run.done_marker, {
            "name": run.name, "loss": run.loss, "seed": run.seed, "kind": run.kind, "max_steps": self.max_steps,
            "wall_s": round(sum(a["wall_s"] for a in attempts), 1), "attempts": len(attempts),
            "fingerprint": self.fingerprint, "finished": time.time(), "log": str(run.log)})
        return {**outcome, "status": "done"}


def make_executor(folder: Path, cluster: str, parallel: int, timeout_min: int,
                  slurm: Mapping[str, Any]) -> submitit.AutoExecutor:
    """A submitit executor for ``cluster`` (``local`` | ``slurm``); ``slurm`` holds SlurmExecutor
    parameters (``partition``, ``gpus_per_node``, ``cpus_per_task``, ``mem_gb``, ...), checked by
    submitit on either cluster and applied on SLURM only."""
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    executor.update_parameters(timeout_min=int(timeout_min), slurm_array_parallelism=int(parallel),
                               **{f"slurm_{key}": value for key, value in slurm.items()})
    return executor


def stop_job(job: submitit.Job) -> None:
    """Stop a job gracefully: SIGTERM to a local job's controller, which passes it to the job
    (:class:`RunJob`); ``scancel`` on SLURM."""
    if isinstance(job, submitit.LocalJob):
        if not job.done():
            os.kill(int(job.job_id), signal.SIGTERM)
    else:
        job.cancel(check=False)


class Stop:
    """While runs go: the first SIGINT/SIGTERM stops the live jobs and no new one is submitted; a
    second one stops them again (:class:`RunJob` then kills its run)."""

    def __init__(self, live: Mapping[str, submitit.Job]) -> None:
        self.live = live
        self.count = 0
        self.previous: dict[int, Any] = {}

    def handle(self, signum, frame) -> None:
        self.count += 1
        for job in list(self.live.values()):
            stop_job(job)

    def __enter__(self) -> Stop:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """Processes started inside ignore SIGINT (the disposition survives ``exec``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def describe(outcome: Mapping[str, Any]) -> str:
    name, status, rc = outcome["name"], outcome["status"], outcome.get("rc")
    if status == "done":
        return f"[study] done  {name} in {outcome['wall_s'] / 60:.1f} min"
    if status == "failed":
        return f"[study] FAILED {name} (exit {rc}); see {outcome.get('log')}"
    return f"[study] stopped {name} (rc {rc}); rerun the study to resume it"


def job_outcome(fn: RunJob, job: submitit.Job, stopped: bool) -> dict[str, Any]:
    """The job's outcome; a job that died before returning one is a failure (or an interruption),
    its submitit log names the cause."""
    try:
        return job.result()
    except Exception:  # noqa: BLE001 - whatever ended the job, the run did not finish
        outcome = {"name": fn.run.name, "rc": None, "wall_s": 0.0, "log": str(job.paths.stderr)}
        if stopped:
            return {**outcome, "status": "interrupted"}
        write_json(fn.run.failed_marker, {"rc": None, "log": outcome["log"], "wall_s": 0.0})
        return {**outcome, "status": "failed"}


def execute(executor: submitit.Executor, jobs: Sequence[RunJob], parallel: int,
            echo: Callable[[str], None] = print, poll_s: float = 0.5) -> tuple[list[dict[str, Any]], bool]:
    """Run ``jobs``, at most ``parallel`` at a time; their outcomes in order (``done`` | ``failed``
    | ``interrupted`` | ``not started``), and whether a signal stopped them."""
    cluster = getattr(executor, "cluster", executor.name())
    cap = len(jobs) if cluster == "slurm" else parallel   # SLURM: one array, `array_parallelism` at a time
    todo, live, fns, outcomes = list(jobs), {}, {}, {}
    with Stop(live) as stop:
        while live or (todo and not stop.count):
            if todo and len(live) < cap and not stop.count:
                wave, todo = todo[:cap - len(live)], todo[cap - len(live):]
                with sigint_ignored(), executor.batch():
                    submitted = [executor.submit(fn) for fn in wave]
                for fn, job in zip(wave, submitted):
                    live[fn.run.name], fns[fn.run.name] = job, fn
                    echo(f"[study] start {fn.run.name}{' (resume)' if fn.resumed else ''}  log: {fn.run.log}")
                    if stop.count:  # a SIGTERM while submitting
                        stop_job(job)
            for name, job in list(live.items()):
                if job.done():
                    outcomes[name] = job_outcome(fns[name], job, bool(stop.count))
                    del live[name]
                    echo(describe(outcomes[name]))
            if live:
                time.sleep(poll_s)
    for fn in todo:
        outcomes[fn.run.name] = {"name": fn.run.name, "status": "not started", "rc": None}
    return [outcomes[fn.run.name] for fn in jobs], bool(stop.count)
