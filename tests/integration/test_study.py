"""The CPU-scale study (docs/studies/study-protocol.md): the verdict rule, metric merging, the run grid and
resume states, the submitit executor (parallelism cap, failures, Ctrl-C), the report rendered from
synthetic metrics CSVs, and (slow) the quick profile end to end."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from aspo_lit.__main__ import main
from experiments import runner
from experiments import study as S
from experiments.claims import judge, pooled_se, verdict
from experiments.render import render_report
from experiments.report import write_report
from experiments.results import collect, head_mean, read_run, run_statistics, tail_mean, version_dirs
from tests.helpers.tolerance import approx64  # float64 maths, O(1)-O(100) values: docs/design.md, "Tolerances in tests"

REPO = Path(__file__).resolve().parents[2]
LOSSES = ["grpo", "grpo_no_is", "grpo_pos_mean", "aspo", "aspo_no_dual_clip"]


# --------------------------------------------------------------------------- the decision rule

def test_pooled_se_matches_formula():
    a, b = [1.0, 2.0, 3.0], [2.0, 4.0, 6.0, 8.0]
    sp2 = (np.var(a, ddof=1) * 2 + np.var(b, ddof=1) * 3) / 5
    assert pooled_se(a, b) == approx64(math.sqrt(sp2 * (1 / 3 + 1 / 4)))
    # equal n: the pooled SE equals sqrt(s_a^2/n + s_b^2/n)
    a, b = [0.1, 0.3, 0.2], [0.5, 0.9, 0.7]
    assert pooled_se(a, b) == approx64(math.sqrt(np.var(a, ddof=1) / 3 + np.var(b, ddof=1) / 3))
    assert math.isnan(pooled_se([1.0], [2.0]))


def test_verdict_supported_not_supported_inconclusive():
    v = verdict([0.50, 0.52, 0.51], [0.30, 0.31, 0.29])
    assert v.verdict == "supported" and v.diff == approx64(0.21)
    assert v.margin == approx64(2 * pooled_se([0.50, 0.52, 0.51], [0.30, 0.31, 0.29]))
    assert verdict([0.30, 0.31, 0.29], [0.50, 0.52, 0.51]).verdict == "not supported"
    # in the claimed direction but within 2 SE
    assert verdict([0.40, 0.60, 0.50], [0.45, 0.55, 0.40]).verdict == "inconclusive"
    # exactly at the margin is not enough
    a, b = [1.0, 3.0], [0.0, 0.0]
    margin = 2 * pooled_se(a, b)
    v = verdict([x - (2.0 - margin) for x in a], b)
    assert v.diff == approx64(margin) and v.verdict in ("inconclusive", "supported")


def welch_expected(a, b) -> float:
    """Welch's two-sided p-value from its formula (t statistic, Welch-Satterthwaite dof)."""
    from scipy.stats import t as student_t

    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    t = (np.mean(a) - np.mean(b)) / math.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return float(2 * student_t.sf(abs(t), dof))


def test_welch_p_value_matches_the_formula():
    a, b = [0.50, 0.52, 0.51, 0.55, 0.49], [0.30, 0.41, 0.29, 0.35]
    v = verdict(a, b)
    assert v.p_value == approx64(welch_expected(a, b)) and 0 < v.p_value < 0.01
    assert verdict([0.4, 0.6, 0.5], [0.45, 0.55, 0.4]).p_value > 0.3
    assert math.isnan(verdict([0.9], [0.1]).p_value)          # one seed: no test
    assert math.isnan(verdict([0.0, 0.0], [0.0, 0.0]).p_value)  # no spread at all


def test_verdict_needs_two_seeds_and_drops_nan():
    assert verdict([0.9], [0.1]).verdict == "inconclusive"  # no spread, no test
    v = verdict([0.9, float("nan"), 0.91], [0.1, 0.12, None])
    assert (v.n_higher, v.n_lower) == (2, 2) and v.verdict == "supported"
    assert verdict([], [0.1, 0.2]).verdict == "no data"
    # zero spread: any difference in the claimed direction counts
    assert verdict([1.0, 1.0], [0.0, 0.0]).verdict == "supported"


def test_statistics():
    values = np.arange(10, dtype=float)
    assert tail_mean(values, 0.2) == approx64(8.5)
    assert head_mean(values, 0.2) == approx64(0.5)
    assert tail_mean(values[:3], 0.2) == approx64(2.0)  # at least one point
    assert math.isnan(tail_mean([])) and math.isnan(head_mean([]))
    metrics = pd.DataFrame({"run": "r", "metric": "m", "step": values, "value": values[::-1]})
    stats = run_statistics(metrics, 0.2).loc[("r", "m")]
    assert (stats["head_mean"], stats["tail_mean"]) == (approx64(8.5), approx64(0.5))
    assert (stats["last_eval"], stats["max"], stats["first"], stats["mean"]) == (0.0, 9.0, 9.0, 4.5)


# --------------------------------------------------------------------------- synthetic runs

def write_metrics(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = ["epoch", "step"] + sorted({k for r in rows for k in r} - {"epoch", "step"})
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for r in rows:
            writer.writerow({"epoch": 0, **{k: ("" if v is None else v) for k, v in r.items()}})


#: per loss: final entropy, repetition, clip ratio, accuracy, grad-norm spike (paper's direction)
PROFILE = {
    "grpo":              dict(entropy=0.10, rep=0.30, clip=0.050, acc=0.50, spike=1.0),
    "grpo_no_is":        dict(entropy=0.30, rep=0.10, clip=0.010, acc=0.60, spike=1.0),
    "grpo_pos_mean":     dict(entropy=0.25, rep=0.12, clip=0.020, acc=0.62, spike=1.0),
    "aspo":              dict(entropy=0.40, rep=0.05, clip=0.005, acc=0.70, spike=1.0),
    "aspo_no_dual_clip": dict(entropy=0.40, rep=0.05, clip=0.005, acc=0.70, spike=9.0),
}


def synthetic_run(run_dir: Path, loss: str, seed: int, steps: int = 40, split_at: int | None = None) -> None:
    """Train metrics every step, val every 10 steps; optionally split into two versions (a resume)."""
    p = PROFILE[loss]
    rng = np.random.default_rng(seed * 100 + LOSSES.index(loss))
    rows = []
    for step in range(steps):
        frac = step / (steps - 1)
        rows.append({"step": step,
                     "train/entropy": 0.6 + (p["entropy"] - 0.6) * frac + rng.normal(0, 0.005),
                     "train/repetition_rate": p["rep"] * frac + rng.normal(0, 0.002),
                     "clip/pos_high": p["clip"] * frac + abs(rng.normal(0, 1e-4)),
                     "train/kl": 0.01 * frac,
                     "train/grad_norm": (p["spike"] if step == steps // 2 else 0.5) + rng.normal(0, 0.01),
                     "train/reward_mean": 0.4 + 0.3 * frac,
                     "response/length_mean": 150.0 - 50 * frac,
                     "timing/step_s": 2.0})
        if (step + 1) % 10 == 0:
            acc = 0.4 + (p["acc"] - 0.4) * (step + 1) / steps + rng.normal(0, 0.005)
            rows.append({"step": step, "val/avg@4": acc, "val/pass@4": min(1.0, acc + 0.2)})
    if split_at is None:
        write_metrics(run_dir / "version_0" / "metrics.csv", rows)
    else:
        write_metrics(run_dir / "version_0" / "metrics.csv", [r for r in rows if r["step"] < split_at + 3])
        write_metrics(run_dir / "version_1" / "metrics.csv", [r for r in rows if r["step"] >= split_at])
    (run_dir / "version_0" / "health.json").write_text(json.dumps({"verdict": "healthy"}))


def write_study_yaml(tmp_path: Path, losses=LOSSES, seeds=(0, 1, 2), **extra) -> Path:
    import yaml

    cfg = {"name": "synthetic", "base_config": str(REPO / "conf" / "tiny" / "aspo.yaml"),
           "losses": list(losses), "seeds": list(seeds), "max_steps": 40,
           "out_dir": str(tmp_path / "out"), "report": str(tmp_path / "docs" / "study.md"), "jobs": 2,
           "overrides": ["--data.init_args.num_val=16"], **extra}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def fake_study(tmp_path: Path, seeds=(0, 1, 2)) -> S.Study:
    study = S.load_study(write_study_yaml(tmp_path, seeds=seeds))
    for seed in seeds:
        for loss in LOSSES:
            run_dir = study.runs_dir / f"{loss}_s{seed}"
            synthetic_run(run_dir, loss, seed, split_at=17 if (loss == "aspo" and seed == 1) else None)
            (run_dir / "done").write_text(json.dumps({"kind": "fit", "wall_s": 120.0 + seed}))
            fig = run_dir / "version_0" / "figures"
            fig.mkdir(parents=True, exist_ok=True)
            for step in (20, 100, 40):
                _png(fig / f"token_weights_step{step}.png", step)
        base = study.runs_dir / f"base_s{seed}"
        write_metrics(base / "version_0" / "metrics.csv", [{"step": 0, "val/avg@4": 0.40, "val/pass@4": 0.6}])
        (base / "done").write_text("{}")
    return study


def _png(path: Path, step: int) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1, 1))
    fig.text(0.5, 0.5, str(step))
    fig.savefig(path)


def test_read_run_merges_versions_by_step(tmp_path):
    run_dir = tmp_path / "r"
    write_metrics(run_dir / "version_0" / "metrics.csv",
                  [{"step": s, "train/entropy": 1.0} for s in range(5)])
    write_metrics(run_dir / "version_1" / "metrics.csv",
                  [{"step": s, "train/entropy": 2.0} for s in range(3, 8)])
    write_metrics(run_dir / "version_10" / "metrics.csv", [{"step": 7, "train/entropy": 3.0}])
    rows = read_run(run_dir)
    assert rows["step"].tolist() == list(range(8))
    # later versions win (version_10 after version_1, numerically)
    assert rows["value"].tolist() == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0]
    assert read_run(tmp_path / "absent").empty


def test_plan_states_and_commands(tmp_path):
    study = S.load_study(write_study_yaml(tmp_path, losses=["grpo", "aspo"], seeds=[0, 1]))
    runs = study.plan()
    assert [r.name for r in runs] == ["base_s0", "base_s1", "grpo_s0", "aspo_s0", "grpo_s1", "aspo_s1"]
    fit = runs[3]
    argv = S.command(fit, study)
    assert argv[1:4] == ["-m", "aspo_lit", "fit"]
    # one key seeds a run: the data's and the module's seeds derive from seed_everything
    assert not any(a.startswith(("--data.init_args.seed", "--model.seed")) for a in argv)
    for expected in ("--model.loss=aspo", "--seed_everything=0",
                     "--trainer.max_steps=40", "--trainer.logger.init_args.name=aspo_s0",
                     f"--trainer.logger.init_args.save_dir={study.runs_dir}", "--data.init_args.num_val=16"):
        assert expected in argv
    # the per-run keys come after the study's overrides (they win)
    assert argv.index("--data.init_args.num_val=16") < argv.index("--model.loss=aspo")
    assert "--ckpt_path=last" not in argv and "--ckpt_path=last" in S.command(fit, study, resume=True)
    base = S.command(runs[0], study)
    assert base[3] == "validate" and not any(a.startswith("--model.loss") for a in base)
    assert fit.state == "fresh" and not S.job(fit, study).resumed
    fit.checkpoint.parent.mkdir(parents=True)
    fit.checkpoint.write_bytes(b"")
    assert fit.state == "resume"
    job = S.job(fit, study)
    assert job.resumed and job.argv[-1] == "--ckpt_path=last" and job.fingerprint == S.fingerprint(study, fit)
    fit.done_marker.write_text("{}")
    assert fit.state == "done"


def test_threads_per_job_and_env(tmp_path):
    study = S.load_study(write_study_yaml(tmp_path), jobs=2)
    assert study.threads_per_job == max(1, (os.cpu_count() or 1) // 2)
    env = runner.run_env(3, {"PYTHONPATH": "/elsewhere"})
    assert env["OMP_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "3"
    assert env["PYTHONPATH"] == os.pathsep.join([str(REPO), "/elsewhere"])
    slurm = S.load_study(write_study_yaml(tmp_path, executor="slurm", slurm={"cpus_per_task": 6}))
    assert slurm.threads_per_job == 6


def test_unknown_key_or_executor_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="lossses"):
        S.load_study(write_study_yaml(tmp_path, lossses=["grpo"]))
    with pytest.raises(ValueError, match="executor"):
        S.load_study(write_study_yaml(tmp_path, executor="pbs"))


# --------------------------------------------------------------------------- the executor

#: A fake run: records its start and end times, exits with argv[2].
FAKE_RUN = ("import pathlib, sys, time; d = pathlib.Path(sys.argv[1]); (d / 'start').write_text(repr(time.time()));"
            " time.sleep(1.5); (d / 'end').write_text(repr(time.time())); print('training', d.name);"
            " sys.exit(int(sys.argv[2]))")


def fake_jobs(tmp_path: Path, codes: list[int], program: str = FAKE_RUN) -> list[runner.RunJob]:
    jobs = []
    for i, code in enumerate(codes):
        run = runner.Run(f"r{i}", "fit", "grpo", i, tmp_path / "runs" / f"r{i}", tmp_path / "logs" / f"r{i}.log")
        run.dir.mkdir(parents=True, exist_ok=True)
        jobs.append(runner.RunJob(run, [sys.executable, "-c", program, str(run.dir), str(code)], threads=1, jobs=2,
                                  resumed=False, max_steps=10, fingerprint="f"))
    return jobs


def test_executor_runs_at_most_parallel_at_once_and_reports_a_failure(tmp_path):
    jobs = fake_jobs(tmp_path, [0, 0, 3, 0, 0])
    executor = runner.make_executor(tmp_path / "submitit", "local", parallel=2, timeout_min=10, slurm={})
    messages = []
    outcome, interrupted = runner.execute(executor, jobs, parallel=2, echo=messages.append, poll_s=0.1)
    assert not interrupted
    assert [o["status"] for o in outcome] == ["done", "done", "failed", "done", "done"]
    spans = [(float((j.run.dir / "start").read_text()), float((j.run.dir / "end").read_text())) for j in jobs]
    running = [sum(s <= t < e for s, e in spans) for t, _ in spans]   # runs alive when each one started
    assert max(running) == 2, running
    failed = jobs[2].run
    assert failed.failed_marker.exists() and not failed.done_marker.exists()
    assert json.loads(failed.failed_marker.read_text())["rc"] == 3
    assert any("FAILED r2" in m and str(failed.log) in m for m in messages)
    assert "training r2" in failed.log.read_text()
    marker = json.loads(jobs[0].run.done_marker.read_text())
    assert marker["attempts"] == 1 and marker["fingerprint"] == "f" and marker["kind"] == "fit"


def test_slurm_executor_gets_the_study_parameters(tmp_path, monkeypatch):
    """On SLURM every run goes into one job array, `jobs` tasks at a time (submitit needs `srun`
    on the path to build a SLURM executor: a stub stands in for it)."""
    stub = tmp_path / "bin" / "srun"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stub.parent}{os.pathsep}{os.environ['PATH']}")
    study = S.load_study(write_study_yaml(tmp_path, executor="slurm", jobs=3, timeout_min=90,
                                          slurm={"partition": "gpu", "gpus_per_node": 1}))
    executor = runner.make_executor(tmp_path / "submitit", study.executor, study.jobs, study.timeout_min, study.slurm)
    assert executor.cluster == "slurm"
    assert {k: executor.parameters[k] for k in ("partition", "gpus_per_node", "array_parallelism", "time")} == {
        "partition": "gpu", "gpus_per_node": 1, "array_parallelism": 3, "time": 90}
    with pytest.raises(NameError, match="partitionn"):
        runner.make_executor(tmp_path / "submitit", "local", 2, 10, {"partitionn": "gpu"})


#: A fake run that stops like GracefulInterrupt: it logs every signal, exits 1 s after the first
#: one -- unless argv[2] is "stubborn", then it never exits by itself.
STOPPABLE_RUN = """
import pathlib, signal, sys, time
d, got = pathlib.Path(sys.argv[1]), []
def on(signum, frame):
    got.append(signum)
    with open(d / "signals", "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
signal.signal(signal.SIGTERM, on)
signal.signal(signal.SIGINT, on)
(d / "start").write_text("1")
start = time.time()
while (not got or sys.argv[2] == "stubborn") and time.time() - start < 60:
    time.sleep(0.05)
time.sleep(1.0)
(d / "saved").write_text("1")
"""

STUDY_DRIVER = """
import json, sys
from pathlib import Path
from experiments import runner
from tests.integration.test_study import STOPPABLE_RUN, fake_jobs
jobs = fake_jobs(Path({tmp!r}), [{mode!r}] * 3, STOPPABLE_RUN)
executor = runner.make_executor(Path({tmp!r}) / "submitit", "local", 2, 10, {{}})
outcome, interrupted = runner.execute(executor, jobs, 2, poll_s=0.1)
print(json.dumps({{"interrupted": interrupted, "status": [o["status"] for o in outcome]}}))
"""


@pytest.mark.parametrize("mode", ["graceful", "stubborn"])
def test_ctrl_c_stops_the_runs_cleanly(tmp_path, mode):
    """A terminal's Ctrl-C (SIGINT to the whole process group): every live run gets exactly one
    SIGTERM and may finish its step, no new run starts; a second Ctrl-C kills the runs."""
    driver = subprocess.Popen([sys.executable, "-c", STUDY_DRIVER.format(tmp=str(tmp_path), mode=mode)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
    runs = [tmp_path / "runs" / f"r{i}" for i in range(3)]
    deadline = time.time() + 120
    while not all((d / "start").exists() for d in runs[:2]) and time.time() < deadline:
        time.sleep(0.1)
    os.killpg(driver.pid, signal.SIGINT)
    if mode == "stubborn":
        time.sleep(2.0)
        os.killpg(driver.pid, signal.SIGINT)
    out, _ = driver.communicate(timeout=120)
    assert json.loads(out.strip().splitlines()[-1]) == {
        "interrupted": True, "status": ["interrupted", "interrupted", "not started"]}
    for d in runs[:2]:
        assert (d / "signals").read_text() == "SIGTERM\n"     # one signal, never the terminal's SIGINT
        assert (d / "saved").exists() == (mode == "graceful")   # stubborn: killed by the second Ctrl-C
        assert not (d / "done").exists() and not (d / "failed").exists()
    assert not (runs[2] / "start").exists()


def test_study_skips_done_runs_and_reports_a_failure(tmp_path, monkeypatch):
    """`main` through submitit with fake runs: a done run is skipped, a failing one is reported
    (exit status 1) and the others' markers are written; the report is rendered."""
    study = S.load_study(write_study_yaml(tmp_path, losses=["grpo", "aspo", "cispo"], seeds=[0], base_eval=False))
    skipped = study.plan()[2]
    skipped.dir.mkdir(parents=True)
    skipped.done_marker.write_text("{}")

    def fake_command(run, study, resume=False):
        return [sys.executable, "-c", FAKE_RUN, str(run.dir), "3" if run.loss == "grpo" else "0"]

    monkeypatch.setattr(S, "command", fake_command)
    assert main(["study", "--config", str(study.path)]) == 1
    grpo, aspo, cispo = study.plan()
    assert grpo.failed_marker.exists() and not grpo.done_marker.exists()
    assert aspo.done_marker.exists() and not (cispo.dir / "start").exists()
    invocation = json.loads((study.out_dir / "study.json").read_text())["invocations"][-1]
    assert invocation["ran"] == ["grpo_s0", "aspo_s0"] and invocation["failed"] == ["grpo_s0"]
    text = study.report.read_text()
    assert f"`grpo_s0`: **failed** (exit 3), log `{grpo.log}`" in text


# --------------------------------------------------------------------------- the report

def claim_runs(study: S.Study, values: dict[str, dict[str, list[float]]], steps: int = 10) -> None:
    """Finished runs whose metric is the same at every step: `values[loss][metric]` per seed."""
    for loss, metrics in values.items():
        for i, seed in enumerate(study.seeds):
            rows = [{"step": s, **{m: v[i] for m, v in metrics.items()}} for s in range(steps)]
            run = study.plan()[study.losses.index(loss) + len(study.losses) * i]
            write_metrics(run.dir / "version_0" / "metrics.csv", rows)
            run.done_marker.write_text(json.dumps({"kind": "fit", "wall_s": 60.0}))


def test_report_verdicts_and_welch_p_from_synthetic_metrics(tmp_path):
    """Per-seed final values chosen by hand: the verdict, difference, 2·SE and Welch p in the page
    are the ones computed here from their definitions."""
    study = S.load_study(write_study_yaml(tmp_path, losses=["grpo", "aspo"], base_eval=False))
    aspo_entropy, grpo_entropy = [0.50, 0.55, 0.47], [0.30, 0.36, 0.31]      # claim 1: supported
    grpo_rep, aspo_rep = [0.10, 0.12, 0.08], [0.20, 0.25, 0.22]              # claim 2: not supported
    grpo_clip, aspo_clip = [0.05, 0.01, 0.03], [0.02, 0.05, 0.01]            # claim 3: inconclusive
    claim_runs(study, {"grpo": {"train/entropy": grpo_entropy, "train/repetition_rate": grpo_rep,
                                "clip/pos_high": grpo_clip},
                       "aspo": {"train/entropy": aspo_entropy, "train/repetition_rate": aspo_rep,
                                "clip/pos_high": aspo_clip}})
    text = write_report(study, echo=lambda m: None).read_text()
    verdicts = {c.id: v for c, v in judge(collect(study))}
    for claim, word, (hi, lo) in (("1", "supported", (aspo_entropy, grpo_entropy)),
                                  ("2", "not supported", (grpo_rep, aspo_rep)),
                                  ("3", "inconclusive", (grpo_clip, aspo_clip))):
        diff = np.mean(hi) - np.mean(lo)
        pooled = ((len(hi) - 1) * np.var(hi, ddof=1) + (len(lo) - 1) * np.var(lo, ddof=1)) / (len(hi) + len(lo) - 2)
        margin = 2 * math.sqrt(pooled * (1 / len(hi) + 1 / len(lo)))
        p = welch_expected(hi, lo)
        v = verdicts[claim]
        assert v.verdict == word
        assert (v.diff, v.margin, v.p_value) == (approx64(diff), approx64(margin), approx64(p))
        line = next(x for x in text.splitlines() if x.startswith(f"* **({claim})"))
        assert f"— **{word}**:" in line and "(n = 3/3)" in line
        assert f"difference {diff:.3g}, 2×SE = {margin:.3g}, Welch p = {p:.3g}." in line
    assert "Summary: 6 no data, 1 supported, 1 not supported, 1 inconclusive (of 9 claim lines)." in text
    assert "not tested: GRPO w/o IS not in this study" in text


def test_report_from_synthetic_runs(tmp_path):
    study = fake_study(tmp_path)
    results = collect(study)
    assert results.accuracy_key == "val/avg@4" and results.pass_key == "val/pass@4"
    assert set(results.runs["status"]) == {"done"}
    # the resumed run (two versions) is merged whole
    assert len(results.series("aspo_s1", "train/entropy")[0]) == 40
    verdicts = {c.id: v.verdict for c, v in judge(results)}
    assert verdicts == {k: "supported" for k in ("1", "2", "3", "4", "5a", "5b", "6a", "6b", "7")}

    path = write_report(study, echo=lambda m: None)
    text = path.read_text()
    assert path == tmp_path / "docs" / "study.md"
    figures = tmp_path / "docs" / "study"
    assert (figures / "figure2_overlays.png").stat().st_size > 10_000
    # Fig. 4: the *last* step's surface of seed 0 (step 100, not the newest file or step 40)
    assert (figures / "fig4_grpo.png").read_bytes() == (
        study.runs_dir / "grpo_s0" / "version_0" / "figures" / "token_weights_step100.png").read_bytes()
    assert (figures / "fig4_aspo.png").exists()
    assert "](study/figure2_overlays.png)" in text and "](study/fig4_aspo.png)" in text
    assert text.count("— **supported**") == 9
    assert text.count("Welch p = ") == 9 and "Welch's t-test" in text
    # the profile's properties, measured from the runs: first-batch entropy and length, and the
    # runs whose clip/pos_high reached the 5 % target (GRPO's peaks at 0.05 + noise; ASPO's at 0.005)
    assert re.search(r"\(`train/entropy`\) 0\.60\d* ± 0\.00\d+ nats", text)
    assert "response length 150 ± 0 tokens" in text and "over 15 runs" in text
    assert re.search(r"\| GRPO +\| 0\.05\d* / 0\.05\d* / 0\.05\d* +\| 3 of 3 +\|", text)
    assert re.search(r"\| ASPO +\| 0\.005\d* / 0\.005\d* / 0\.005\d* +\| 0 of 3 +\|", text)
    assert re.search(r"\| initial model \(testbed, before RL\) \| 40\.0 ± 0\.0 +\| 60\.0 ± 0\.0 +\| 3 +\|", text)
    # entropy, first → last 20 % of the steps, and the health verdicts
    assert re.search(r"\| GRPO +\| 0\.55\d* ± [\d.e-]+ → 0\.14\d* ± [\d.e-]+ +\|.*\| 3× healthy \|", text)
    assert "Decision rule" in text and "2 × the pooled standard error" in text
    assert "All 18 runs finished." in text
    assert re.search(r"\| GRPO w/o IS +\|.*\| 63\.5 +\|", text)   # the paper's Table 4 column
    assert "* Measured wall time per `fit` run: mean 2.0 min (min 2.0, max 2.0)" in text


def test_report_with_opposite_and_missing_runs(tmp_path):
    study = fake_study(tmp_path)
    # make GRPO's entropy end *higher* than ASPO's for every seed: claim 1 not supported
    for seed in study.seeds:
        for version in version_dirs(study.runs_dir / f"grpo_s{seed}"):
            path = version / "metrics.csv"
            rows = list(csv.DictReader(path.open()))
            for r in rows:
                if r.get("train/entropy"):
                    r["train/entropy"] = str(float(r["train/entropy"]) + 1.0)
            write_metrics(path, rows)
    # a failed run, a missing one and a partial one
    (study.runs_dir / "aspo_no_dual_clip_s2" / "done").unlink()
    (study.runs_dir / "aspo_no_dual_clip_s2" / "failed").write_text(json.dumps({"rc": 1, "log": "L.log"}))
    import shutil

    shutil.rmtree(study.runs_dir / "grpo_pos_mean_s2")
    (study.runs_dir / "aspo_s2" / "done").unlink()
    results = collect(study)
    verdicts = {c.id: v for c, v in judge(results)}
    assert verdicts["1"].verdict == "not supported"
    assert verdicts["6a"].n_higher == 2 and verdicts["1"].n_higher == 2
    text = render_report(results, {})
    assert "**failed** (exit 1), log `L.log`" in text
    assert "`grpo_pos_mean_s2`: missing" in text and "`aspo_s2`: partial" in text


def test_single_seed_is_inconclusive(tmp_path):
    study = fake_study(tmp_path, seeds=(0,))
    verdicts = {c.id: v.verdict for c, v in judge(collect(study))}
    assert set(verdicts.values()) == {"inconclusive"}


def test_study_configs_parse():
    for name in ("default", "quick", "short"):
        study = S.load_study(REPO / "conf" / "study" / f"{name}.yaml")
        assert study.max_steps > 0 and study.base_config[0].is_file() and study.executor == "local"
    default = S.load_study(REPO / "conf" / "study" / "default.yaml")
    assert set(default.losses) == set(LOSSES) and len(default.seeds) >= 3


def test_the_shipped_testbed_the_base_configs_name_is_pinned(tmp_path):
    from aspo_lit.testbed.shipped import shipped_dir

    base = tmp_path / "base.yaml"
    base.write_text("model:\n  model_name_or_path: testbed\n")
    derived = tmp_path / "derived.yaml"
    derived.write_text("config: base.yaml\nmodel:\n  model_name_or_path: testbed-long\n")
    path = write_study_yaml(tmp_path, losses=["aspo"], seeds=[0])
    study = S.load_study(path)
    study.base_config = [derived]
    assert S.model_name(study) == "testbed-long"
    study.overrides = ["--model.model_name_or_path=/some/folder"]
    assert S.model_name(study) == "/some/folder"
    S.pin_testbed(study, echo=lambda m: None)
    assert study.model_path is None and study.testbed is None   # not a testbed
    study.overrides = []
    S.pin_testbed(study, echo=lambda m: None)
    assert study.model_path == str(shipped_dir("testbed-long")) and study.testbed == "testbed-long v1"
    assert f"--model.model_name_or_path={study.model_path}" in S.command(study.plan()[0], study)


def test_dry_run_prints_commands(tmp_path, capsys):
    assert main(["study", "--config", str(write_study_yaml(tmp_path, losses=["aspo"], seeds=[0])), "--dry_run", "true"]) == 0
    out = capsys.readouterr().out
    assert "# aspo_s0: fresh" in out and "--model.loss=aspo" in out


# --------------------------------------------------------------------------- end to end (slow)

@pytest.mark.slow
def test_quick_profile_end_to_end(tmp_path):
    """The quick profile: real training runs, then the docs-like report (into tmp_path). Its runs are
    shortened to 1 rollout batch (16 optimizer steps, held-out evaluation before it and after it): no
    assert depends on the runs' length, only on the machinery."""
    out, report = tmp_path / "runs", tmp_path / "docs" / "study.md"
    args = ["study", "--config", str(REPO / "conf" / "study" / "quick.yaml"), "--out_dir", str(out), "--report", str(report),
            "--max_steps", "16", "--overrides", "[--trainer.val_check_interval=1, --data.init_args.num_val=32]"]
    assert main(args) == 0
    text = report.read_text()
    assert "## Verdicts per claim" in text and "(1) GRPO's entropy" in text
    assert (tmp_path / "docs" / "study" / "figure2_overlays.png").exists()
    assert (tmp_path / "docs" / "study" / "fig4_aspo.png").exists()
    study = S.load_study(REPO / "conf" / "study" / "quick.yaml", out_dir=str(out), report=str(report), max_steps=16,
                         overrides=["--trainer.val_check_interval=1", "--data.init_args.num_val=32"])
    results = collect(study)
    assert set(results.runs["status"]) == {"done"}
    for loss in study.losses:
        run = runner.run_name(loss, study.seeds[0])
        assert results.series(run, results.accuracy_key) is not None
        assert results.series(run, "train/entropy") is not None
    assert not re.search(r"initial model \(testbed, before RL\) \| n/a", text)
    # a second invocation skips every run (done markers) and only re-renders the report
    assert main(args) == 0
    assert len(json.loads((out / "study.json").read_text())["invocations"]) == 1


def test_report_regime_and_entropy_mechanism_sections(tmp_path):
    """The regime properties of every run (over seeds per loss) and, when the runs logged it, the
    entropy-mechanism figure; neither section without its data."""
    study = fake_study(tmp_path)
    bare = render_report(collect(study), {})
    assert "## Entropy mechanism" not in bare
    for seed in study.seeds:
        for i, loss in enumerate(LOSSES):
            # a later version folder adds the diagnostic's and the ratios' series (read_run merges by step)
            write_metrics(study.runs_dir / f"{loss}_s{seed}" / "version_7" / "metrics.csv",
                          [{"step": s, "entropy/cov": 0.01 * (i + 1) - 0.0002 * s, "entropy/cov_pos": 0.01,
                            "entropy/cov_neg": -0.01, "entropy/measured_change": -0.001,
                            "ratio/pos_mean": 1.0004, "ratio/neg_mean": 1.0001} for s in range(40)])
    path = write_report(study, echo=lambda m: None)
    text = path.read_text()
    assert (tmp_path / "docs" / "study" / "entropy_mechanism.png").stat().st_size > 10_000
    assert "## Entropy mechanism" in text and "](study/entropy_mechanism.png)" in text
    # GRPO (i = 0): entropy/cov first 20 % (steps 0-7) mean 0.0093, last 20 % (32-39) 0.0029
    assert re.search(r"\| GRPO +\| 0\.0093 → 0\.0029 +\|", text)
    # the regime: accuracy 40 % → ~50 % at the last of four evaluations, still rising (no plateau);
    # entropy 0.6 → 0.1 (a decline far beyond 2 SE); ratio gap 3e-4 in every run
    assert re.search(r"\| GRPO +\| 3 +\| 3/3 +\| 9\.37 ± 0\.512 +\| 0\.411 \(2 SE 0\.00425\) +\| yes +\| 0\.0003 +\| 0/3 +\|",
                     text)
    assert re.search(r"\| grpo_s0 +\| 40\.0 → 49\.9 / 49\.9 +\| \+9\.9 +\| \+0\.4086 +\| \+3\.00e-04 +\| no +\|", text)
    assert text.index("## The regime, per run") < text.index("## Training dynamics")
