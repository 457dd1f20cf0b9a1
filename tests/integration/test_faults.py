"""The fault suite's fast cases (`make faults` runs them all, docs/running.md): a resume with another
loss and ``--ckpt_path last`` with nothing to resume, done to real CLI fits, each stopped in one
line with nothing written."""

from __future__ import annotations

import pytest

from tools.faults import main


@pytest.mark.e2e
def test_the_fast_faults_stop_in_one_line_and_lose_nothing(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--only", "resume_another_loss", "ckpt_last_nothing"]) == 0
    table = (tmp_path / "faults.md").read_text()
    assert "| resume_another_loss | exit 1: 'A resumed run continues the run it resumes" in table
    assert "| yes (last.ckpt untouched, step 4) |" in table
    assert "| ckpt_last_nothing | exit 2: 'aspo-lit: config error: --ckpt_path last: no last checkpoint" in table
    assert "reference" not in table      # neither needs the uninterrupted run
