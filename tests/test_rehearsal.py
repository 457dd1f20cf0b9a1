"""Rehearse every shipped paper config on CPU (2 processes over gloo, sizes and hardware changed
only): config diff, identical ranks, moving weights, warm-up in rollout batches, 1-process replay,
SIGTERM + resume. See tests/rehearsal/run.py; `make rehearse` runs the same."""

from __future__ import annotations

import json

import pytest

from tests.rehearsal.run import CONFIGS, REPO, rehearse, write_data


def test_every_shipped_fit_config_is_rehearsed():
    """Each shipped fit config (the files under conf/, conf/ablations/ and conf/code/; the table
    configs are not fits) is named by a rehearsal."""
    shipped = {str(p.relative_to(REPO)) for d in ("conf", "conf/ablations", "conf/code") for p in (REPO / d).glob("*.yaml")}
    shipped -= {"conf/table1.yaml", "conf/table2.yaml", "conf/table3.yaml"}
    rehearsed = {c for configs in CONFIGS.values() for c in configs}
    assert shipped <= rehearsed, f"add {sorted(shipped - rehearsed)} to tests/rehearsal/run.py's CONFIGS"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_shipped_config_rehearses(name):
    out = REPO / "runs" / "rehearsal"
    write_data(out)
    verdict = rehearse(name, out)
    failed = {k: {x: y for x, y in c.items() if x != "diff"} for k, c in verdict["checks"].items() if not c.get("ok")}
    assert verdict["ok"], json.dumps(failed, indent=1, default=str)
