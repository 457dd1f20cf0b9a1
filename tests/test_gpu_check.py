"""`make gpu-check` on CPU: the script a first GPU run uses (FSDP2 + bf16 compute, tiny Qwen2) passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_on_cpu():
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu_check.py"), "--device", "cpu"], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert '"weights_changed": "27/27"' in proc.stdout and "gpu-check: PASS" in proc.stdout
