"""The CPU-scale study (issue 8): the verdict rule, metric merging, the run plan and resume states,
the report rendered from synthetic metrics CSVs, and (slow) the quick profile end to end."""

from __future__ import annotations

import csv
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

from experiments import study as S

REPO = Path(__file__).resolve().parents[1]
LOSSES = ["grpo", "grpo_no_is", "grpo_pos_mean", "aspo", "aspo_no_dual_clip"]


# --------------------------------------------------------------------------- the decision rule

def test_pooled_se_matches_formula():
    a, b = [1.0, 2.0, 3.0], [2.0, 4.0, 6.0, 8.0]
    sp2 = (np.var(a, ddof=1) * 2 + np.var(b, ddof=1) * 3) / 5
    assert S.pooled_se(a, b) == pytest.approx(math.sqrt(sp2 * (1 / 3 + 1 / 4)))
    # equal n: the pooled SE equals sqrt(s_a^2/n + s_b^2/n)
    a, b = [0.1, 0.3, 0.2], [0.5, 0.9, 0.7]
    assert S.pooled_se(a, b) == pytest.approx(math.sqrt(np.var(a, ddof=1) / 3 + np.var(b, ddof=1) / 3))
    assert math.isnan(S.pooled_se([1.0], [2.0]))


def test_verdict_supported_not_supported_inconclusive():
    v = S.verdict([0.50, 0.52, 0.51], [0.30, 0.31, 0.29])
    assert v.verdict == "supported" and v.diff == pytest.approx(0.21)
    assert v.margin == pytest.approx(2 * S.pooled_se([0.50, 0.52, 0.51], [0.30, 0.31, 0.29]))
    assert S.verdict([0.30, 0.31, 0.29], [0.50, 0.52, 0.51]).verdict == "not supported"
    # in the claimed direction but within 2 SE
    assert S.verdict([0.40, 0.60, 0.50], [0.45, 0.55, 0.40]).verdict == "inconclusive"
    # exactly at the margin is not enough
    a, b = [1.0, 3.0], [0.0, 0.0]
    margin = 2 * S.pooled_se(a, b)
    v = S.verdict([x - (2.0 - margin) for x in a], b)
    assert v.diff == pytest.approx(margin) and v.verdict in ("inconclusive", "supported")


def test_welch_p_value_matches_the_formula():
    a, b = [0.50, 0.52, 0.51, 0.55, 0.49], [0.30, 0.41, 0.29, 0.35]
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    t = (np.mean(a) - np.mean(b)) / math.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    from scipy.stats import t as student_t
    expected = 2 * student_t.sf(abs(t), dof)
    v = S.verdict(a, b)
    assert v.p_value == pytest.approx(expected, rel=1e-9) and 0 < v.p_value < 0.01
    assert S.verdict([0.4, 0.6, 0.5], [0.45, 0.55, 0.4]).p_value > 0.3
    assert math.isnan(S.verdict([0.9], [0.1]).p_value)          # one seed: no test
    assert math.isnan(S.verdict([0.0, 0.0], [0.0, 0.0]).p_value)  # no spread at all


def test_verdict_needs_two_seeds_and_drops_nan():
    assert S.verdict([0.9], [0.1]).verdict == "inconclusive"  # no spread, no test
    v = S.verdict([0.9, float("nan"), 0.91], [0.1, 0.12, None])
    assert (v.n_higher, v.n_lower) == (2, 2) and v.verdict == "supported"
    assert S.verdict([], [0.1, 0.2]).verdict == "no data"
    # zero spread: any difference in the claimed direction counts
    assert S.verdict([1.0, 1.0], [0.0, 0.0]).verdict == "supported"


def test_statistics():
    steps = np.arange(10, dtype=float)
    values = np.arange(10, dtype=float)
    assert S.tail_mean((steps, values), 0.2) == pytest.approx(8.5)
    assert S.head_mean((steps, values), 0.2) == pytest.approx(0.5)
    assert S.tail_mean((steps[:3], values[:3]), 0.2) == pytest.approx(2.0)  # at least one point
    assert S.last_value((steps, values)) == 9.0 and S.max_value((steps, values)) == 9.0
    assert math.isnan(S.tail_mean(None)) and math.isnan(S.last_value(None))


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


def test_load_run_metrics_merges_versions_by_step(tmp_path):
    run_dir = tmp_path / "r"
    write_metrics(run_dir / "version_0" / "metrics.csv",
                  [{"step": s, "train/entropy": 1.0} for s in range(5)])
    write_metrics(run_dir / "version_1" / "metrics.csv",
                  [{"step": s, "train/entropy": 2.0} for s in range(3, 8)])
    write_metrics(run_dir / "version_10" / "metrics.csv", [{"step": 7, "train/entropy": 3.0}])
    steps, values = S.load_run_metrics(run_dir)["train/entropy"]
    assert steps.tolist() == list(range(8))
    # later versions win (version_10 after version_1, numerically)
    assert values.tolist() == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0]


def test_plan_states_and_commands(tmp_path):
    study = S.load_study(write_study_yaml(tmp_path, losses=["grpo", "aspo"], seeds=[0, 1]))
    runs = S.plan(study)
    assert [r.name for r in runs] == ["base_s0", "base_s1", "grpo_s0", "aspo_s0", "grpo_s1", "aspo_s1"]
    fit = runs[3]
    argv = S.command(fit, study)
    assert argv[1:4] == ["-m", "aspo_lit", "fit"]
    for expected in ("--model.loss=aspo", "--seed_everything=0", "--data.init_args.seed=0", "--model.seed=0",
                     "--trainer.max_steps=40", "--trainer.logger.init_args.name=aspo_s0",
                     f"--trainer.logger.init_args.save_dir={study.runs_dir}", "--data.init_args.num_val=16"):
        assert expected in argv
    # the per-run keys come after the study's overrides (they win)
    assert argv.index("--data.init_args.num_val=16") < argv.index("--model.loss=aspo")
    assert "--ckpt_path=last" not in argv and "--ckpt_path=last" in S.command(fit, study, resume=True)
    base = S.command(runs[0], study)
    assert base[3] == "validate" and not any(a.startswith("--model.loss") for a in base)
    assert S.state(fit, study) == "fresh"
    fit.checkpoint(study).parent.mkdir(parents=True)
    fit.checkpoint(study).write_bytes(b"")
    assert S.state(fit, study) == "resume"
    fit.done_marker(study).write_text("{}")
    assert S.state(fit, study) == "done"


def test_threads_per_job_and_env(tmp_path):
    study = S.load_study(write_study_yaml(tmp_path), jobs=2)
    assert study.threads_per_job == max(1, (os.cpu_count() or 1) // 2)
    env = S._env(3)
    assert env["OMP_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "3"


def test_unknown_key_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="unknown study key"):
        S.load_study(write_study_yaml(tmp_path, lossses=["grpo"]))


def test_executor_runs_skips_and_reports_failures(tmp_path, monkeypatch):
    """Two fake runs (one fails, one succeeds), one skipped by its marker; no real training."""
    study = S.load_study(write_study_yaml(tmp_path, losses=["grpo", "aspo", "cispo"], seeds=[0], base_eval=False))
    runs = S.plan(study)
    runs[2].dir(study).mkdir(parents=True)
    runs[2].done_marker(study).write_text("{}")
    import sys

    def fake_command(run, study, resume=False):
        code = "import sys; print('training', sys.argv[1]); sys.exit(3 if sys.argv[1] == 'grpo' else 0)"
        return [sys.executable, "-c", code, run.loss]

    monkeypatch.setattr(S, "command", fake_command)
    messages = []
    outcome = S.Executor(study, echo=messages.append).run_all(runs)
    status = {o["name"]: o["status"] for o in outcome}
    assert status == {"grpo_s0": "failed", "aspo_s0": "done", "cispo_s0": "skipped (done)"}
    assert runs[0].failed_marker(study).exists() and not runs[0].done_marker(study).exists()
    assert json.loads(runs[1].done_marker(study).read_text())["attempts"] == 1
    assert "training grpo" in runs[0].log(study).read_text()
    assert any("FAILED grpo_s0" in m and str(runs[0].log(study)) in m for m in messages)


def test_report_from_synthetic_runs(tmp_path):
    study = fake_study(tmp_path)
    results = S.collect(study)
    assert results.accuracy_key == "val/avg@4" and results.pass_key == "val/pass@4"
    assert set(results.status.values()) == {"done"}
    # the resumed run (two versions) is merged whole
    assert len(results.metrics["aspo_s1"]["train/entropy"][0]) == 40
    verdicts = {c.id: v.verdict for c, v in S.judge(results)}
    assert verdicts == {k: "supported" for k in ("1", "2", "3", "4", "5a", "5b", "6a", "6b", "7")}

    path = S.write_report(study, echo=lambda m: None)
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
    assert re.search(r"\| GRPO \| 0\.05\d* / 0\.05\d* / 0\.05\d* \| 3 of 3 \|", text)
    assert re.search(r"\| ASPO \| 0\.005\d* / 0\.005\d* / 0\.005\d* \| 0 of 3 \|", text)
    assert "| initial model (testbed, before RL) | 40.0 ± 0.0 | 60.0 ± 0.0 | 3 |" in text
    assert "Decision rule" in text and "2 × the pooled standard error" in text
    assert "All 18 runs finished." in text
    assert "| GRPO w/o IS |" in text and "63.5" in text   # the paper's Table 4 column


def test_report_with_opposite_and_missing_runs(tmp_path):
    study = fake_study(tmp_path)
    # make GRPO's entropy end *higher* than ASPO's for every seed: claim 1 not supported
    for seed in study.seeds:
        for version in S.version_dirs(study.runs_dir / f"grpo_s{seed}"):
            path = version / "metrics.csv"
            rows = list(csv.DictReader(path.open()))
            for r in rows:
                if r.get("train/entropy"):
                    r["train/entropy"] = str(float(r["train/entropy"]) + 1.0)
            write_metrics(path, rows)
    # a failed run and a missing one
    (study.runs_dir / "aspo_no_dual_clip_s2" / "done").unlink()
    (study.runs_dir / "aspo_no_dual_clip_s2" / "failed").write_text(json.dumps({"rc": 1, "log": "L.log"}))
    import shutil

    shutil.rmtree(study.runs_dir / "grpo_pos_mean_s2")
    results = S.collect(study)
    verdicts = {c.id: v for c, v in S.judge(results)}
    assert verdicts["1"].verdict == "not supported"
    assert verdicts["6a"].n_higher == 2
    text = S.render_report(results, {})
    assert "**failed** (exit 1), log `L.log`" in text
    assert "`grpo_pos_mean_s2`: missing" in text


def test_single_seed_is_inconclusive(tmp_path):
    study = fake_study(tmp_path, seeds=(0,))
    verdicts = {c.id: v.verdict for c, v in S.judge(S.collect(study))}
    assert set(verdicts.values()) == {"inconclusive"}


def test_study_configs_parse():
    for name in ("default", "quick"):
        study = S.load_study(REPO / "conf" / "study" / f"{name}.yaml")
        assert study.max_steps > 0 and study.base_config[0].is_file()
    default = S.load_study(REPO / "conf" / "study" / "default.yaml")
    assert set(default.losses) == set(LOSSES) and len(default.seeds) >= 3


def test_prebuild_builds_the_profile_the_base_configs_name(tmp_path, monkeypatch):
    """The study builds (and pins) the testbed its fit configs train, read through `config:` bases."""
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
    calls = []
    monkeypatch.setattr(S.subprocess, "run", lambda argv, **kw: calls.append(argv))
    assert S.prebuild_testbed(study, echo=lambda m: None) == 0 and calls == []   # not a testbed
    study.overrides = []
    out = tmp_path / "built"
    (out).mkdir()
    (out / "testbed.json").write_text("{}")

    class Done:
        returncode, stdout = 0, f"{out}\n"
    monkeypatch.setattr(S.subprocess, "run", lambda argv, **kw: calls.append(argv) or Done())
    assert S.prebuild_testbed(study, echo=lambda m: None) == 0
    assert calls[-1][-2:] == ["--profile", "testbed-long"] and study.model_path == str(out)


def test_dry_run_prints_commands(tmp_path, capsys):
    assert S.main(["--config", str(write_study_yaml(tmp_path, losses=["aspo"], seeds=[0])), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# aspo_s0: fresh" in out and "--model.loss=aspo" in out


# --------------------------------------------------------------------------- end to end (slow)

@pytest.mark.slow
def test_quick_profile_end_to_end(tmp_path):
    """The quick profile: real training runs, then the docs-like report (into tmp_path)."""
    out, report = tmp_path / "runs", tmp_path / "docs" / "study.md"
    args = ["--config", str(REPO / "conf" / "study" / "quick.yaml"), "--out-dir", str(out), "--report", str(report)]
    assert S.main(args) == 0
    text = report.read_text()
    assert "## Verdicts per claim" in text and "(1) GRPO's entropy" in text
    assert (tmp_path / "docs" / "study" / "figure2_overlays.png").exists()
    assert (tmp_path / "docs" / "study" / "fig4_aspo.png").exists()
    study = S.load_study(REPO / "conf" / "study" / "quick.yaml", out_dir=str(out), report=str(report))
    results = S.collect(study)
    assert set(results.status.values()) == {"done"}
    for loss in study.losses:
        series = results.metrics[f"{loss}_s{study.seeds[0]}"]
        assert results.accuracy_key in series and "train/entropy" in series
    assert "initial model (testbed, before RL) | n/a" not in text
    # a second invocation skips every run (done markers) and only re-renders the report
    assert S.main(args) == 0
    assert len(json.loads((out / "study.json").read_text())["invocations"]) == 1
