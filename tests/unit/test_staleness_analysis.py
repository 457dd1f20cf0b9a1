"""experiments.staleness (docs/studies/staleness-protocol.md's rules) on synthetic runs with known outcomes."""

from __future__ import annotations

import csv
from pathlib import Path

from experiments.staleness import KS, LOSSES, SEEDS, collect, render, verdicts

KEYS = ("flip/abs_log_ratio_pos_p90", "flip/weight_change", "clip/pos_high", "train/kl", "train/grad_norm",
        "train/reward_mean", "train/entropy", "rollout/staleness", "val/avg@4")


def write_runs(root: Path, rise: dict[str, float], batches: int = 5, bad_schedule: tuple | None = None) -> None:
    """Every arm's runs; quantity S/F/C of loss L at staleness k = base + rise[L] * k + a seed offset."""
    for k in KS:
        for loss in LOSSES:
            for i, seed in enumerate(SEEDS):
                run = root / f"k{k}" / "runs" / f"{loss}_s{seed}" / "version_0"
                run.mkdir(parents=True)
                with (run / "metrics.csv").open("w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=["step", *KEYS])
                    writer.writeheader()
                    for b in range(batches):
                        level = 0.1 + rise[loss] * k + 0.01 * i + 0.001 * b
                        stale = min(k, b) + (1 if bad_schedule == (k, loss, seed) and b == 2 else 0)
                        writer.writerow({"step": b, "flip/abs_log_ratio_pos_p90": level, "flip/weight_change": level,
                                         "clip/pos_high": level, "train/kl": 0.01, "train/grad_norm": 0.1 * (1 + k),
                                         "train/reward_mean": 0.5, "train/entropy": 0.4,
                                         "rollout/staleness": stale if k else "", "val/avg@4": 0.6 if b == batches - 1 else ""})


def test_a_rise_with_k_is_confirmed_a_fall_refuted(tmp_path):
    write_runs(tmp_path, {"grpo": 0.05, "aspo": -0.02})
    values = collect(tmp_path)
    assert len(values) == 24 and all(v["schedule_ok"] for v in values.values())
    tests = {(t["loss"], t["q"]): t for t in verdicts(values)}
    assert {t["verdict"] for (loss, _), t in tests.items() if loss == "grpo"} == {"confirmed"}
    assert {t["verdict"] for (loss, _), t in tests.items() if loss == "aspo"} == {"refuted"}
    assert tests[("grpo", "S")]["rho"] > 0.9
    page = render(values, tmp_path)
    assert "**confirmed**" in page and "in all 24 runs" in page


def test_no_rise_is_inconclusive_and_a_broken_schedule_is_named(tmp_path):
    write_runs(tmp_path, {"grpo": 0.0, "aspo": 0.0}, bad_schedule=(2, "aspo", 7))
    values = collect(tmp_path)
    assert {t["verdict"] for t in verdicts(values)} == {"inconclusive"}
    assert not values[(2, "aspo", 7)]["schedule_ok"]
    assert "(2, 'aspo', 7)" in render(values, tmp_path)
    assert "Not every run has finished" in render({}, tmp_path)
