"""Rehearse every shipped paper config on CPU (2 processes over gloo, sizes and hardware changed
only): config diff, identical ranks, moving weights, warm-up in rollout batches, 1-process replay,
SIGTERM + resume. See tests/rehearsal/run.py; `make rehearse` runs the same."""

from __future__ import annotations

import json

import pytest

from tests.rehearsal.run import CONFIGS, REPO, rehearse, write_data

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(CONFIGS))
def test_shipped_config_rehearses(name):
    out = REPO / "runs" / "rehearsal"
    write_data(out)
    verdict = rehearse(name, out)
    failed = {k: {x: y for x, y in c.items() if x != "diff"} for k, c in verdict["checks"].items() if not c.get("ok")}
    assert verdict["ok"], json.dumps(failed, indent=1, default=str)
