"""experiments.posthoc: the post-hoc statistics of a study's claims, on hand-computable inputs and
on the committed study v2 page (its verdict lines must survive the section's rewrite)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import t

from experiments.posthoc import HEADING, compare, holm, rank_tests, read_page, tost_bound, write_section

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "studies" / "study-v2.md"


def test_holm_adjusts_step_down_and_keeps_the_input_order():
    adjusted, thresholds = holm([0.01, 0.04, 0.03])
    # sorted: 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1 = 0.04, but never below the previous: 0.06)
    assert adjusted == pytest.approx([0.03, 0.06, 0.06])
    assert thresholds == pytest.approx([0.05 / 3, 0.05, 0.05 / 2])


def test_tost_bound_is_where_both_one_sided_tests_just_reject():
    diff, se, df = 0.3, 0.2, 7.0
    delta = tost_bound(diff, se, df)
    # at +delta the upper one-sided test's p is exactly alpha; the lower one's is smaller
    assert t.cdf((diff - delta) / se, df) == pytest.approx(0.05, rel=1e-9)
    assert t.sf((diff + delta) / se, df) < 0.05


def test_compare_pairs_by_seed():
    b = [1.0, 3.0, 2.0, 5.0, 4.0]
    a = [x + 0.5 + 0.01 * i for i, x in enumerate(b)]  # a shifted copy: the pairs remove the spread
    c = compare(a, b)
    assert c.diff == pytest.approx(0.52) and c.paired_diff == pytest.approx(0.52)
    d = np.array(a) - np.array(b)
    se = np.std(d, ddof=1) / math.sqrt(5)
    assert c.paired_ci95[1] - c.paired_diff == pytest.approx(t.ppf(0.975, 4) * se)
    assert c.paired_p < 1e-4                             # the paired test sees the shift ...
    assert c.ci95[0] < 0 < c.ci95[1]                     # ... the unpaired interval does not
    with pytest.raises(ValueError, match="seed pairs"):
        compare([1.0], [2.0])


def test_rank_tests_give_the_exact_extremes():
    a, b = [10.0, 20.0, 30.0, 40.0, 50.0], [1.0, 2.0, 3.0, 4.0, 5.0]
    u, w = rank_tests(a, b)
    assert u == pytest.approx(1 / math.comb(10, 5)) and w == pytest.approx(1 / 32)


@pytest.mark.skipif(not PAGE.is_file(), reason="the study v2 page is not in this checkout")
def test_the_study_v2_page_is_read_and_its_verdicts_survive(tmp_path):
    values, decline = read_page(PAGE.read_text())
    assert values[("grpo", "train/entropy (final)")] == [0.413, 0.472, 0.433, 0.447, 0.447]
    assert values[("aspo_no_dual_clip", "train/grad_norm (max)")][1] == 1.66e3
    assert decline["grpo"] == [0.0393, -0.0206, 0.0188, 0.0106, 0.0091]
    page = tmp_path / "study-v2.md"
    shutil.copy(PAGE, page)
    head = PAGE.read_text().split("\n" + HEADING, 1)[0]
    write_section(page)
    once = page.read_text()
    write_section(page)
    assert page.read_text() == once          # replaced, not appended
    assert once.startswith(head)             # the generated page above it, verdict lines included, unchanged
    assert once.count(HEADING) == 1 and "| (7) |" in once
