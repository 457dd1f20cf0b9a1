"""experiments/bands.py, the demo reference's false-alarm rate and sensitivity (docs/compare.md): its
exact binomial interval against tables, a run cut to its first windows, and format 1's per-window rule
kept for the comparison (a departure in one window is seen, a run of the seeds' spread is not)."""

from __future__ import annotations

import pytest

from aspo_lit.compare.runlog import load_run
from experiments.bands import clopper_pearson, truncated, v1_departs
from tests.unit.test_compare import series, write_run


def test_clopper_pearson_against_tables():
    """0 of 40: [0, 0.0881]; 1 of 40: [0.0006, 0.1316]; 20 of 40: [0.3380, 0.6620] (exact, 95 %)."""
    assert clopper_pearson(0, 40) == (0.0, pytest.approx(0.0881, abs=1e-4))
    low, high = clopper_pearson(1, 40)
    assert low == pytest.approx(0.00063, abs=1e-5) and high == pytest.approx(0.1316, abs=1e-4)
    assert clopper_pearson(20, 40) == (pytest.approx(0.3380, abs=1e-4), pytest.approx(0.6620, abs=1e-4))
    assert clopper_pearson(40, 40)[1] == 1.0


def test_a_run_cut_to_its_first_windows(tmp_path):
    run = load_run(str(write_run(tmp_path, 1, steps=40)))
    cut = truncated(run, 2, 4)
    assert cut.last_step == 7 and max(float(s.max()) for s, _ in cut.series.values()) == 7
    assert len(cut.series["train/kl"][0]) == 8 and len(run.series["train/kl"][0]) == 40


def test_format_1_rule_sees_one_window_out_of_its_band(tmp_path):
    seeds = [load_run(str(write_run(tmp_path / "ref", s))) for s in range(8)]
    same = load_run(str(write_run(tmp_path / "same", 20)))
    assert v1_departs(same, seeds, 4, 0.05) == (False, None)
    values = series(21, 40)
    values["train/kl"][24:28] *= 30          # window 6 only
    far = load_run(str(write_run(tmp_path / "far", 21, values=values)))
    assert v1_departs(far, seeds, 4, 0.05) == (True, 6)
