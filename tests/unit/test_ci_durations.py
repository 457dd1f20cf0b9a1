"""tools/ci_durations.py turns a CI log into docs/ci.md's tables: per-file sums of the listed phases,
the slowest phases, the numerics reruns, and a clear error on a log that is not one."""

from __future__ import annotations

import pytest

from tools import ci_durations

LOG = """\
.venv/bin/python -m pytest -q --durations=0 --durations-min=1
..........                                                               [100%]
============================= slowest durations ==============================
279.42s call     tests/integration/test_study.py::test_quick_profile_end_to_end
60.23s setup    tests/integration/test_colocate.py::test_two_ranks_colocated_push_every_step
36.15s call     tests/integration/test_colocate.py::test_two_ranks_colocated_push_every_step
1.50s teardown tests/integration/test_colocate.py::test_resume_pushes_the_restored_weights
10 passed, 1 skipped, 3 warnings in 400.00s (0:06:40)
.venv/bin/python -m pytest -q --durations=0 --durations-min=1 -m "(hostile or sandbox)"
4 passed in 50.00s
== numerics tests under ATEN_CPU_CAPABILITY=default
7 passed in 20.00s
== ATEN_CPU_CAPABILITY=default: passed in 25 s
ci: setup done in 40 s
ci: lint and testbeds done at 52 s
ci: done in 600 s
== ATEN_CPU_CAPABILITY=avx2: not rerun, this CPU's own (AVX2, no AVX-512): the suite above ran under it
== MKL_ENABLE_INSTRUCTIONS=AVX2: passed in 24 s
"""


def test_tables_sum_each_file_and_list_the_slowest():
    log = ci_durations.parse(LOG)
    # make test's two pytest phases, not the numerics reruns' summaries
    assert log["phases"] == [("10 passed, 1 skipped, 3 warnings", 400.0), ("4 passed", 50.0)]
    assert log["summary"] == ("10 passed, 1 skipped, 3 warnings + 4 passed", 450.0)
    assert log["numerics"] == [("ATEN_CPU_CAPABILITY=default", 25), ("ATEN_CPU_CAPABILITY=avx2", "not rerun (the CPU's own)"),
                               ("MKL_ENABLE_INSTRUCTIONS=AVX2", 24)]
    assert log["stamps"] == [("setup done", 40), ("lint and testbeds done", 52), ("done", 600)]
    text = ci_durations.render(log, top=2)
    # colocate: 60.23 + 36.15 + 1.50 = 97.88 -> 98 s, 26 % of the 377.3 listed test-seconds
    assert "| `tests/integration/test_colocate.py` | 98 | 26% |" in text
    assert "| `tests/integration/test_study.py` | 279 | 74% |" in text
    assert "in 450 s of wall clock" in text and "account for 377 test-seconds" in text  # 279.42 + 97.88
    assert "| done | 600 |" in text and "| 4 passed | 50 |" in text
    slowest = text.split("slowest phases:")[1]
    assert "test_quick_profile_end_to_end" in slowest and "| 60.2 | setup |" in slowest
    assert "| 36.1 |" not in slowest  # top=2


def test_a_log_without_a_summary_is_refused():
    with pytest.raises(SystemExit, match="no pytest summary line"):
        ci_durations.parse("setup: done\n279.42s call     tests/integration/test_study.py::test_x\n")
