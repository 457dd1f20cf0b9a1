"""experiments.regime: the regime properties of a pilot, from its metrics.csv."""

from __future__ import annotations

import math

import pytest

from experiments import regime as G
from tests.helpers.tolerance import approx64  # float64 maths, O(1)-O(100) values: docs/design.md, "Tolerances in tests"
from tests.integration.test_study import write_metrics


def run(tmp_path, name, acc, entropy, pos, neg, *, start_length=160.0, split=None):
    """A run of len(entropy) rollout batches; one evaluation per entry of `acc` (fractions), spread
    evenly; optionally written as two version folders (a resume) split at batch `split`."""
    n = len(entropy)
    rows = []
    for step in range(n):
        rows.append({"step": step, "train/entropy": entropy[step], "ratio/pos_mean": pos[step],
                     "ratio/neg_mean": neg[step], "train/reward_mean": 0.3 + 0.01 * step,
                     "clip/pos_high": 0.001 * step, "train/kl": 0.002 * step,
                     "response/length_mean": start_length + step})
    every = n // len(acc)
    for i, a in enumerate(acc):
        rows.append({"step": (i + 1) * every - 1, "val/avg@4": a, "val/pass@4": min(1.0, a + 0.2)})
    rows.sort(key=lambda r: r["step"])
    folder = tmp_path / name
    if split is None:
        write_metrics(folder / "version_0" / "metrics.csv", rows)
    else:
        write_metrics(folder / "version_0" / "metrics.csv", [r for r in rows if r["step"] < split])
        write_metrics(folder / "version_1" / "metrics.csv", [r for r in rows if r["step"] >= split])
    return folder


def base(tmp_path, acc=0.316):
    folder = tmp_path / "base"
    write_metrics(folder / "version_0" / "metrics.csv", [{"step": 0, "val/avg@4": acc, "val/pass@4": 0.65}])
    return folder


LEARNS = dict(acc=[0.36, 0.40, 0.41, 0.405], entropy=[0.45 - 0.01 * i for i in range(10)],
              pos=[1.0004] * 10, neg=[1.0001] * 10)


def test_a_run_that_learns_and_plateaus_meets_every_property(tmp_path):
    r = G.measure(run(tmp_path, "learns", **LEARNS), acc0=31.6)
    assert r.batches == 10 and r.evals == 4
    assert r.acc_best == approx64(41.0) and r.acc_last == approx64(40.5)
    assert r.rise == approx64(9.4)
    # first 20 % (batches 0-1) minus last 20 % (batches 8-9) of the entropy
    assert r.entropy_decline == approx64(0.445 - 0.365)
    assert r.ratio_gap == approx64(3e-4)
    assert r.last_gain == approx64(-0.5) and r.plateau
    assert r.entropy_start == approx64(0.45) and r.length_start == approx64(160.0)
    assert r.clip_pos_high_max == approx64(0.009) and r.kl_last == approx64(0.018)
    assert r.checks() == {"rise": True, "entropy": True, "ratio": True, "plateau": True, "start": True}


def test_a_collapsing_run_fails_them(tmp_path):
    r = G.measure(run(tmp_path, "collapses", acc=[0.30, 0.12, 0.05, 0.04],
                      entropy=[0.45 + 0.02 * i for i in range(10)], pos=[0.99] * 10, neg=[1.01] * 10), acc0=31.6)
    assert r.rise == approx64(30.0 - 31.6)
    assert r.entropy_decline < 0 and r.ratio_gap == approx64(-0.02)
    assert r.checks() == {"rise": False, "entropy": False, "ratio": False, "plateau": True, "start": True}


def test_a_run_still_climbing_at_its_end_has_no_plateau(tmp_path):
    r = G.measure(run(tmp_path, "climbs", **{**LEARNS, "acc": [0.34, 0.37, 0.40, 0.43]}), acc0=31.6)
    assert r.last_gain == approx64(3.0)
    assert not r.plateau and r.checks()["rise"]


def test_the_starting_profile_is_checked(tmp_path):
    r = G.measure(run(tmp_path, "short_answers", **LEARNS, start_length=60.0), acc0=31.6)
    assert not r.checks()["start"]
    assert not G.measure(run(tmp_path, "learns", **LEARNS), acc0=75.0).checks()["start"]


def test_a_resumed_run_is_read_over_its_versions(tmp_path):
    whole = G.measure(run(tmp_path, "whole", **LEARNS), acc0=31.6)
    resumed = G.measure(run(tmp_path, "resumed", **LEARNS, split=5), acc0=31.6)
    assert resumed.batches == whole.batches == 10
    assert (resumed.acc_best, resumed.entropy_decline, resumed.ratio_gap) == \
        (whole.acc_best, whole.entropy_decline, whole.ratio_gap)


def test_no_evaluation_means_no_rise_and_no_plateau(tmp_path):
    folder = tmp_path / "noval"
    write_metrics(folder / "version_0" / "metrics.csv",
                  [{"step": s, "train/entropy": 0.4, "ratio/pos_mean": 1.0, "ratio/neg_mean": 1.0,
                    "train/reward_mean": 0.3} for s in range(5)])
    r = G.measure(folder, acc0=31.6)
    assert math.isnan(r.acc_best) and r.evals == 0
    assert not r.checks()["rise"] and not r.plateau


def test_cli_prints_a_markdown_row_per_run(tmp_path, capsys):
    assert G.main([str(run(tmp_path, "learns", **LEARNS)), "--base", str(base(tmp_path)), "--markdown"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == G.HEADER and out[1].count("---") == out[0].count(" | ") + 1
    assert out[2].startswith("| learns | 10 | 31.6 → 41.0 / 40.5 | +9.4 |")
    assert out[2].endswith("rise, entropy, ratio, plateau, start (5/5) |")


def test_cli_needs_a_base_with_an_accuracy(tmp_path):
    folder = tmp_path / "nobase"
    write_metrics(folder / "version_0" / "metrics.csv", [{"step": 0, "train/entropy": 0.4}])
    with pytest.raises(SystemExit):
        G.main([str(run(tmp_path, "learns", **LEARNS)), "--base", str(folder)])


def test_the_ratio_gap_pairs_steps_and_skips_a_step_missing_one_side(tmp_path):
    rows = [{"step": s, "train/entropy": 0.4, "ratio/pos_mean": 1.0 + 0.001 * s, "ratio/neg_mean": 1.0}
            for s in range(4)]
    rows[1]["ratio/neg_mean"] = None  # a step with no A < 0 token: no pair
    folder = tmp_path / "gaps"
    write_metrics(folder / "version_0" / "metrics.csv", rows)
    assert G.measure(folder, acc0=31.6).ratio_gap == approx64((0 + 0.002 + 0.003) / 3)
    write_metrics(tmp_path / "nogap" / "version_0" / "metrics.csv", [{"step": 0, "train/entropy": 0.4}])
    assert math.isnan(G.measure(tmp_path / "nogap", acc0=31.6).ratio_gap)
