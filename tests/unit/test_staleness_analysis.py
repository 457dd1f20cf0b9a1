"""experiments.staleness (docs/studies/staleness-protocol.md's rules) on synthetic runs with known outcomes."""

from __future__ import annotations

import csv
from pathlib import Path

from experiments.staleness import KS, LOSSES, SEEDS, collect, render, verdicts

KEYS = ("flip/abs_log_ratio_pos_p90", "flip/weight_change", "clip/pos_high", "train/kl", "train/grad_norm",
        "train/reward_mean", "train/entropy", "rollout/staleness", "val/avg@4")


def write_runs(root: Path, rise: dict[str, float], batches: int = 5, bad_schedule: tuple | None = None,
               accuracy=None) -> None:
    """Every arm's runs; quantity S/F/C of loss L at staleness k = base + rise[L] * k + a seed offset;
    the last ``val/avg@4`` is ``accuracy(k, loss, seed index)`` (0.6 without it)."""
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
                                         "rollout/staleness": stale if k else "",
                                         "val/avg@4": (accuracy(k, loss, i) if accuracy else 0.6) if b == batches - 1 else ""})


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


def test_the_report_prints_the_predicted_sizes_the_detectable_size_the_direction_and_the_deviations(tmp_path):
    """Added 2026-12-07: the report must say that the six tests are manipulation checks, give every
    predicted size beside the measured one (met or missed), what the ASPO − GRPO comparison could
    detect, the direction of its accuracy point estimates with k, and the protocol's deviations."""
    # S/F/C: GRPO 0.112 -> 0.312 at k = 4 (x2.79, C +20 points: met); ASPO 0.112 -> 0.032 (missed).
    # accuracy: ASPO − GRPO = (−k + 0.3·i) points per seed i: falls with k; mean −k + 0.3, CI ± 0.745: excludes 0 at k = 2, 4.
    write_runs(tmp_path / "runs", {"grpo": 0.05, "aspo": -0.02},
               accuracy=lambda k, loss, i: 0.6 - (0.01 * k - 0.003 * i if loss == "aspo" else 0.0))
    protocol = tmp_path / "protocol.md"
    protocol.write_text("# P\n\n## Budget\n\nx\n\n## Deviations\n\n1. Execution only: two at a time.\n"
                        "2. Editorial, after the runs.\n")
    page = render(collect(tmp_path / "runs"), tmp_path / "runs", protocol)
    assert "These six tests are manipulation checks" in page
    assert "## The predicted sizes (k = 4 against k = 0)" in page
    assert "| S: p90 of \\|log r\\| on A > 0 | GRPO | k = 4 ≥ 2 × k = 0 | 0.112 | 0.312 | 2.79 × k = 0 | met |" in page
    assert "| C: `clip/pos_high` | GRPO | a rise of ≥ 1 percentage point | 0.112 | 0.312 | +20 percentage points | met |" in page
    assert "| F: the flip's weight change | ASPO | k = 4 ≥ 2 × k = 0 | 0.112 | 0.032 | 0.286 × k = 0 | **missed** |" in page
    assert "3 of 5 predicted sizes met; missed: S under ASPO" in page
    assert "**What this comparison could detect.**" in page and "could not have been detected at any k" in page
    assert "the point estimates fall with k, opposite to the direction the protocol takes from the paper" in page
    assert "half-widths of 0.745, 0.745, 0.745, 0.745 points" in page
    assert "The 95 % CI excludes 0 at k = 2, 4;" in page
    assert page.index("## Deviations from the protocol") > page.index("## Secondary")
    assert page.endswith("1. Execution only: two at a time.\n2. Editorial, after the runs.\n")
    # the shipped protocol's deviations, deviation 1 included, by default
    assert "1. Execution only: the arms ran two at a time" in render(collect(tmp_path / "runs"), tmp_path / "runs")
