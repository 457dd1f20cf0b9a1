"""experiments/seeds.py: one config over seeds, and the table of what each run ended with."""

from __future__ import annotations

import csv
import json
import re
import sys

from experiments import seeds as S


def write_run(folder, reward, val, verdict="healthy"):
    """A CSVLogger-layout log folder: per-batch rewards, held-out evaluations at given steps."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"step": i, "train/reward_mean": r} for i, r in enumerate(reward)]
    rows += [{"step": step, "val/avg@4": v} for step, v in val]
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "train/reward_mean", "val/avg@4"])
        writer.writeheader()
        writer.writerows(rows)
    (folder / "health.json").write_text(json.dumps({"verdict": verdict, "reason": "why"}))
    return folder


def test_outcome_and_table(tmp_path):
    # 40 batches: the ends are the means of the first and last 10 (end_window)
    reward = [0.0, 0.5] * 5 + [0.875] * 20 + [0.5, 0.75] * 5  # dyadic: the window means are exact
    a = S.seed_outcome(write_run(tmp_path / "a", reward, [(0, 0.30), (19, 0.5), (39, 0.45)]), 0)
    assert (a.val_start, a.val_end, a.reward_start, a.reward_end, a.batches) == (0.30, 0.45, 0.25, 0.625, 40)
    b = S.seed_outcome(write_run(tmp_path / "b", [0.5] * 40, [(0, 0.5), (39, 0.4)], "watch"), 1)
    assert b.val_rise < 0 and b.reward_rise == 0 and b.health == "watch"
    table = S.outcomes_table([a, b])
    assert "| 0 | 0.300 → 0.450 (+15.0 pts) | 0.250 → 0.625 (+0.375) | healthy |" in table
    assert "first → last 10 batches" in table
    # the spread row: mean and SD (ddof 1) of the rises, and the count that rose
    rises = re.search(r"\| over 2 seeds \| \+0\.025 \(SD 0\.177\), 1/2 up \| \+0\.188 \(SD 0\.265\), 1/2 up \| "
                      r"1/2 healthy \|", table)
    assert rises, table


def test_runs_each_seed_once_with_the_one_seed_key(tmp_path, monkeypatch):
    calls = []

    def fake_call(argv, stdout, stderr, env):
        calls.append(argv)
        seed = int(next(a for a in argv if a.startswith("--seed_everything=")).split("=")[1])
        write_run(tmp_path / "out" / f"s{seed}" / "version_0", [0.5] * 8, [(0, 0.5), (7, 0.6)])
        return 0 if seed != 2 else 3

    monkeypatch.setattr(S.subprocess, "call", fake_call)
    code = S.main(["--config", "conf/tiny/aspo.yaml", "--seeds", "0", "1", "2", "--out", str(tmp_path / "out"),
                   "--jobs", "1", "--", "--model.lr=3e-4"])
    assert code == 1  # seed 2 failed
    assert [a[:4] for a in calls] == [[sys.executable, "-m", "aspo_lit", "fit"]] * 3
    first = calls[0]
    assert "--seed_everything=0" in first and first[-1] == "--model.lr=3e-4"
    assert not any(a.startswith(("--data.init_args.seed", "--model.seed")) for a in first)
    # finished seeds are not run again; the failed one is
    calls.clear()
    S.main(["--config", "conf/tiny/aspo.yaml", "--seeds", "0", "1", "2", "--out", str(tmp_path / "out"), "--jobs", "1"])
    assert [next(a for a in c if a.startswith("--seed_everything=")) for c in calls] == ["--seed_everything=2"]
