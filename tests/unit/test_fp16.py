"""fp16 compute (docs/gpu.md, "fp16 compute"): every way to configure it without the grad scaler
is refused before any training, naming its key; with FSDP2's fp16 compute the module's sharded grad
scaler keeps an underflowing gradient, skips an overflowing step on every rank and lowers the scale,
and a resume restores the scale."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aspo_lit.__main__ import main
from tests.helpers.tolerance import unit_roundoff

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "conf/tiny/aspo.yaml")  # lr 2e-4: above the bf16-weights check's 1e-4, so that one stays quiet


def _no_model_loads(monkeypatch):
    """Make loading a model fail the test, so a refusal that comes late is caught."""
    import aspo_lit.training.models as models
    import aspo_lit.training.module as module

    for where in (models, module):
        monkeypatch.setattr(where, "resolve_model_path", lambda name: pytest.fail("a model was loaded"))


@pytest.mark.parametrize("override, key", [
    ("--model.torch_dtype=float16", "model.torch_dtype=float16"),
    ("--trainer.precision=16-true", "trainer.precision=16-true"),
    ("--trainer.precision=16-mixed", "trainer.precision=16-mixed"),
    ("--trainer.precision=16", "trainer.precision=16"),
    ("--trainer.precision=transformer-engine-float16", "trainer.precision=transformer-engine-float16"),
])
def test_fp16_without_the_scaler_is_refused_by_its_key(override, key, capsys, monkeypatch):
    _no_model_loads(monkeypatch)
    try:
        code = main(["fit", "--config", TINY, override])
    except SystemExit as exc:
        code = exc.code
    text = capsys.readouterr().err
    assert code == 2, text
    (line,) = [line for line in text.splitlines() if line.startswith("aspo-lit: config error:")]
    assert key in line and "FSDP2Strategy" in line and "param_dtype: float16" in line, line


def test_module_built_in_python_refuses_fp16_weights(monkeypatch):
    from aspo_lit.training.module import ASPOModule

    _no_model_loads(monkeypatch)
    with pytest.raises(ValueError, match="model.torch_dtype=float16 makes the master weights"):
        ASPOModule(model_name_or_path="testbed", torch_dtype="float16")


def test_auto_dtype_on_an_fp16_checkpoint_is_refused(tiny_model_dir, tmp_path):
    """``torch_dtype: auto`` loads a checkpoint in its stored dtype: stored in fp16, that is fp16
    master weights, refused when the model is built (before any step)."""
    from aspo_lit.training.models import load_policy, load_tokenizer
    from aspo_lit.training.module import ASPOModule

    fp16_dir = tmp_path / "fp16"
    load_policy(str(tiny_model_dir)).to(torch.float16).save_pretrained(fp16_dir)
    load_tokenizer(str(tiny_model_dir)).save_pretrained(fp16_dir)
    module = ASPOModule(model_name_or_path=str(fp16_dir), torch_dtype="auto", kl_coef=0.0)
    with pytest.raises(ValueError, match=r"model.torch_dtype=auto \(a checkpoint stored in fp16\)"):
        module.configure_model()


def test_trainer_built_in_python_with_fp16_precision_is_refused(tiny_model_dir):
    """``Trainer(precision="16-true")`` casts the module to fp16 after `configure_model`; the module
    refuses it there, before Lightning converts anything or a step runs."""
    from lightning.pytorch import Trainer

    from aspo_lit.training.module import ASPOModule
    from tools.fixed_rollouts import FixedRollouts

    module = ASPOModule(model_name_or_path=str(tiny_model_dir), kl_coef=0.0)
    trainer = Trainer(accelerator="cpu", devices=1, precision="16-true", max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="trainer.precision=16-true trains in fp16"):
        trainer.fit(module, datamodule=FixedRollouts(steps=1))


def test_fp16_on_the_gradient_path_needs_the_scaler():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from aspo_lit.maths.fp16 import fsdp_needs_grad_scaler

    fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32
    assert fsdp_needs_grad_scaler(MixedPrecisionPolicy(param_dtype=fp16, reduce_dtype=fp32))
    assert fsdp_needs_grad_scaler(MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp16))
    assert not fsdp_needs_grad_scaler(MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
    assert not fsdp_needs_grad_scaler(MixedPrecisionPolicy())
    assert not fsdp_needs_grad_scaler(None)


# --- fp16 with the grad scaler, on 2 CPU processes (tests/multiproc/fp16_fit.py) ---------------------------

#: the fits run as a module (`python -m tests.multiproc.fp16_fit`) in the test's folder, the repository on PYTHONPATH
SCRIPT = "tests.multiproc.fp16_fit"
#: ScaledASPO's factor for the underflow test. A per-logit gradient of this batch's token-mean loss
#: (fp32, cast to fp16 in the fused head's backward) is at most |A|·(1 - p)/(N/world) < 1.4e-2
#: (the first batch: |A| <= 1.5, N = 226 response tokens over 2 ranks); times 2^-20 that is
#: 1.3e-8, under half fp16's smallest subnormal (2^-25 = 3e-8), so an unscaled fp16 backward
#: flushes every one to zero and nothing flows further; the scale 2^16 lifts them back
UNDERFLOW = 2.0 ** -20


def _fits(model_dir, tmp_path, runs, name):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", SCRIPT, "--model", str(model_dir), "--runs", json.dumps(runs), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_gradient_that_underflows_in_fp16_survives_with_the_scaler(tiny_model_dir, tmp_path):
    """One optimizer step of a loss scaled by 2^-20: fp32 compute, fp16 compute with the module's grad
    scaler, and fp16 compute with the scaler disabled, each on 2 ranks."""
    fp32, scaled, unscaled = _fits(tiny_model_dir, tmp_path, [
        {"param_dtype": "float32", "loss_scale": UNDERFLOW},
        {"loss_scale": UNDERFLOW},
        {"loss_scale": UNDERFLOW, "grad_scaler": False},
    ], "underflow")
    for run in (fp32, scaled, unscaled):
        assert run[0] == run[1]  # the ranks agree (norms of the whole gradient, all-reduced state)
    (reference,), (with_scaler,), (without,) = fp32[0]["grad_norms"], scaled[0]["grad_norms"], unscaled[0]["grad_norms"]
    assert reference > 0 and with_scaler != reference  # fp16 compute rounds: the runs differ
    # No float64 fit exists: the fp16 norm measured 4.1e-5 relative off the fp32 one, bounded by one
    # fp16 rounding, u = 2^-11 = 4.9e-4 (12x margin); without the scaler it is off by 1 (below).
    assert with_scaler == pytest.approx(reference, rel=unit_roundoff(torch.float16), abs=0)
    assert without == 0.0  # exact: every fp16 gradient flushed to zero
    assert scaled[0]["grad_scale"] == [2.0 ** 16]  # logged: no overflow, not yet 400 clean steps


@pytest.fixture(scope="module")
def overflow_and_resume(tiny_model_dir, tmp_path_factory):
    """Rank 1's first update overflows (scaled); 2 optimizer steps then a checkpoint, and a resumed
    fit of one more step. ``max_nonfinite_steps: 1``: a skip counted as a non-finite step would raise."""
    tmp_path = tmp_path_factory.mktemp("fp16_overflow")
    ckpt = str(tmp_path / "ckpt")
    return _fits(tiny_model_dir, tmp_path, [
        {"overflow_rank": 1, "steps": 2, "save": ckpt, "max_nonfinite_steps": 1},
        {"steps": 3, "resume": ckpt},
    ], "overflow")


@pytest.mark.multiproc
@pytest.mark.slow
def test_an_overflow_skips_the_step_and_lowers_the_scale_on_both_ranks(overflow_and_resume):
    first, _ = overflow_and_resume
    for rank in first:
        # a skipped step is redone: 3 rollout batches for 2 optimizer steps
        assert rank["skipped"] == [1, 0, 0] and rank["global_step"] == 2
        assert math.isnan(rank["grad_norms"][0]) and all(math.isfinite(n) for n in rank["grad_norms"][1:])
        assert rank["grad_scale"] == [2.0 ** 15] * 3  # halved once, not grown back (400 clean steps)
    same = ("skipped", "grad_scale", "scaler_at_end", "global_step")
    assert {k: first[0][k] for k in same} == {k: first[1][k] for k in same}


@pytest.mark.multiproc
@pytest.mark.slow
def test_resume_restores_the_grad_scale(overflow_and_resume):
    first, resumed = overflow_and_resume
    for before, after in zip(first, resumed):
        # the halved scale and the count of clean steps since (2), not a fresh scaler's 2^16 and 0
        assert after["scaler_at_start"] == before["scaler_at_end"]
        assert after["scaler_at_start"]["scale"] == 2.0 ** 15 and after["scaler_at_start"]["_growth_tracker"] == 2
        assert after["grad_scale"] == [2.0 ** 15] and after["global_step"] == 3
