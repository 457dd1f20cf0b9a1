"""`make gpu-check` on CPU: the script a first GPU run uses (FSDP2 + bf16 compute, tiny Qwen2; the
transformers engine, then vLLM colocated with sleep mode) passes, and fails when the weight push is
skipped: the sampler/trainer gap is asserted, not just printed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm package is not installed")


def _gpu_check(*args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu_check.py"), "--device", "cpu", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout
    start = out.rindex("\n[\n")
    return proc, json.loads(out[start + 1:out.index("\n]\n", start) + 2])


@pytest.mark.slow
def test_gpu_check_runs_on_cpu():
    proc, results = _gpu_check()
    assert proc.returncode == 0 and "gpu-check: PASS" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_engine = {r["engine"]: r for r in results}
    assert all(r["weights_changed"] == "27/27" for r in results)
    if importlib.util.find_spec("vllm") is not None:
        vllm = by_engine["vllm"]
        assert vllm["topology"] == "colocated" and vllm["sleep_sequence_ok"] and vllm["gap_ok"], vllm


@pytest.mark.slow
@VLLM
def test_gpu_check_fails_when_the_push_is_skipped():
    proc, results = _gpu_check("--engines", "vllm", "--skip_push")
    assert proc.returncode == 1 and "gpu-check: FAIL" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    (vllm,) = results
    assert vllm["sleep_sequence_ok"] and not vllm["gap_ok"], vllm  # it fails on the gap, nothing else
    assert min(vllm["logprob_diff_mean_per_batch"][1:]) > vllm["gap_bound"]
