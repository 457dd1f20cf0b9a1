"""The paper run's rollout path on CPU: one in-process vLLM engine per training rank
(`external_launcher`, as TRL's colocate mode and verl), weights pushed from memory before every
rollout, sleep mode's calls in order; resume pushes the restored weights; the engine leaves the
trainer's RNG streams and thread settings alone.

The 2-rank runs are `python -m aspo_lit fit` on the tiny config with FSDP2 over 2 CPU processes,
the vLLM engine as the paper configs build it, and `tools.rehearsal.probe.RehearsalProbe`, which
compares the engine's weight checksum with the trainer's at the start of every rollout batch (after
the push it was sampled with)."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from aspo_lit.rollout import SamplingConfig

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm package is not installed")]
PROBE = "tools.rehearsal.probe.RehearsalProbe"
FP32_GAP = 1e-4  # mean |vLLM log-prob - trainer log-prob| with fp32 on both sides (measured ~2e-6)


def _fit(testbed: str, out: Path, *extra: str, engine: dict | None = None, devices: int = 2, timeout: int = 900):
    engine = {"class_path": "aspo_lit.rollout.vllm.VLLMEngine",
              "init_args": {"enable_sleep_mode": True, "kv_cache_gb": 1, **(engine or {})}}
    args = [sys.executable, "-m", "aspo_lit", "fit", "--config", str(REPO / "conf/tiny/aspo.yaml"),
            f"--model.model_name_or_path={testbed}", f"--trainer.devices={devices}",
            f"--trainer.logger.init_args.save_dir={out}", "--trainer.logger.init_args.name=run",
            "--trainer.enable_progress_bar=false", "--data.init_args.num_val=0",
            "--data.init_args.batch_size=4", "--data.init_args.group_size=4", "--data.init_args.max_response_length=32",
            "--model.mini_batch_size=2", f"--data.init_args.engine={json.dumps(engine)}", *extra]
    if devices > 1:  # FSDP2 over the ranks, fp32 compute so the sampler/trainer gap is ~1e-6
        args += ["--trainer.strategy=aspo_lit.training.strategy.FSDP2Strategy", "--trainer.strategy.param_dtype=null",
                 "--model.share_prompt=false"]  # refused under FSDP2 (the testbed config has it on)
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(args, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _rows(run_dir: Path, key: str = "rollout/logprob_diff_mean") -> list[list[float]]:
    """Per version folder (a resumed run adds one), the logged values of `key` in order."""
    out = []
    for path in sorted(run_dir.glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        with path.open() as f:
            out.append([float(r[key]) for r in csv.DictReader(f) if r.get(key)])
    return out


def _check_colocated(out: Path, batches: int, tp: int) -> list[dict]:
    probes = [json.loads((out / "probe" / f"probe_rank{r}.json").read_text()) for r in range(2)]
    for probe in probes:
        engine = probe["engine"]
        assert engine["topology"] == "colocated" and engine["tensor_parallel_size"] == tp, engine
        assert engine["sync_path"] == "in_memory" and engine["load_call"] == "reload_weights(weights_iterator)"
        checks = probe["engine_checks"]
        assert len(checks) == batches and all(c["match"] for c in checks), checks
        calls = engine["calls"]  # wake weights -> push -> (reset) -> wake KV -> generate -> sleep
        i = calls.index("update_weights")
        assert calls[i - 1].startswith("sleep(2)") and calls[i + 1:i + 4] == ["wake", "generate", "sleep(2)"], calls
    gaps = _rows(out / "run")[0]
    assert len(gaps) == batches and max(gaps) < FP32_GAP, gaps
    return probes


def test_two_ranks_colocated_push_every_step(testbed, tmp_path):
    """2 ranks, one engine each (TP 1): after every push both engines hold the trainer's weights,
    and the samples are on-policy."""
    _fit(testbed, tmp_path, "--trainer.max_steps=6", f"--trainer.callbacks+={PROBE}",
         f"--trainer.callbacks.init_args.out_dir={tmp_path / 'probe'}", "--trainer.callbacks.init_args.save=false")
    _check_colocated(tmp_path, batches=3, tp=1)


@pytest.mark.slow
def test_two_ranks_one_tensor_parallel_group(testbed, tmp_path):
    """TP 2 over the 2 ranks: one engine sharded over both, prompts gathered, each rank keeps its
    share; the checksum adds the shards over the TP group."""
    _fit(testbed, tmp_path, "--trainer.max_steps=6", f"--trainer.callbacks+={PROBE}",
         f"--trainer.callbacks.init_args.out_dir={tmp_path / 'probe'}", "--trainer.callbacks.init_args.save=false",
         engine={"tensor_parallel_size": 2})
    probes = _check_colocated(tmp_path, batches=3, tp=2)
    assert probes[0]["engine_checks"] == probes[1]["engine_checks"]  # one engine: one checksum


@pytest.mark.slow
def test_tensor_parallel_group_samples_with_one_seed(tiny_model_dir):
    """The two ranks of a TP group ask for different seeds; the group samples with its leader's.
    With each rank's own seed the gap was 2.9-3.4 nats (two token streams into one sharded model).
    The engine's effective config has the all-reduce + RMSNorm fusion off (on GPUs: no FlashInfer
    workspace over the TP group)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "-m", "tests.multiproc.colocated_tp_seeds", str(tiny_model_dir)], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    gaps = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert len(gaps) == 2 and "topology colocated" in proc.stdout and max(gaps) < FP32_GAP, proc.stdout
    assert proc.stdout.count("fuse_allreduce_rms False") == 2, proc.stdout


@pytest.mark.slow
def test_engine_starts_with_random_weights_until_the_first_push(tiny_model_dir):
    """A colocated engine does not read the checkpoint on every rank (a level-2 sleep would discard
    it at once): it starts with random weights (`load_format="dummy"`, as verl), refuses to
    generate, and after the first push holds the checkpoint's weights and samples on-policy.
    (~40 s: one rank under torch.distributed.run.)"""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                           "-m", "tests.multiproc.colocated_first_push", str(tiny_model_dir)], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("SEEN "))[5:])
    assert seen["topology"] == "colocated" and seen["needs_push_at_start"], seen
    (matched_before, diff_before), (matched_after, _) = seen["before"], seen["after"]
    assert not matched_before, diff_before  # the checkpoint's weights were not read
    assert "update_weights() before generate()" in seen["generate_before_push"], seen
    assert matched_after and seen["gap_after"] < FP32_GAP, seen


def test_resume_pushes_the_restored_weights(testbed, tmp_path):
    """`--ckpt_path last` restores the trained policy; the engine starts from the base checkpoint.
    The first resumed rollout must be sampled from the restored weights: its sampler/trainer gap
    stays at the uninterrupted level (fp32: ~1e-6; a stale engine: ~3e-2)."""
    one = {"devices": 1, "engine": {"in_process": True, "enable_sleep_mode": False}}  # no sleep: only the resume push
    _fit(testbed, tmp_path, "--trainer.max_steps=4", **one)
    _fit(testbed, tmp_path, "--trainer.max_steps=8", "--ckpt_path=last", **one)
    before, resumed = _rows(tmp_path / "run")
    assert len(before) == 2 and len(resumed) == 2, (before, resumed)
    assert max(before) < FP32_GAP and resumed[0] < FP32_GAP, (before, resumed)


# -- an in-process engine and the trainer's process-wide state ------------------------------------------
@pytest.fixture(scope="module")
def engine(testbed):
    from transformers import AutoTokenizer

    from aspo_lit.rollout.vllm import VLLMEngine

    eng = VLLMEngine(kv_cache_gb=1, in_process=True, enable_sleep_mode=True)
    with torch.inference_mode():   # as a validation loop under inference mode would attach it first
        eng.attach(None, AutoTokenizer.from_pretrained(testbed), testbed)
    yield eng
    eng.close()


def _draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def _sample(engine, seed: int | None) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    if engine.needs_weight_push:  # sleep level 2 dropped them
        engine.update_weights(AutoModelForCausalLM.from_pretrained(engine.model_path).state_dict())
    out = engine.generate(["1+2=", "3*4="], n=2, sampling=SamplingConfig(max_tokens=8, seed=seed))
    engine.sleep()
    return [c.token_ids for group in out for c in group]


def test_generate_leaves_the_trainer_rng_alone(engine):
    """The trainer's Python/NumPy/torch streams are the same with and without engine calls in
    between (vLLM reseeds the globals; the engine keeps its own state instead), and so are its
    thread count, `torch.set_num_threads` and the float32 matmul precision."""
    def stream(with_engine: bool) -> list[float]:
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
        head = _draws()
        if with_engine:
            _sample(engine, seed=123)
            _sample(engine, seed=None)
        return head + _draws()

    threads, setter, precision = torch.get_num_threads(), torch.set_num_threads, torch.get_float32_matmul_precision()
    assert stream(with_engine=True) == stream(with_engine=False)
    assert (torch.get_num_threads(), torch.set_num_threads, torch.get_float32_matmul_precision()) == (threads, setter, precision)


def test_engine_keeps_its_own_stream(engine):
    """A seed reproduces a call; without one, successive calls draw on (the engine's stream is
    saved between calls, not reset to the trainer's)."""
    assert _sample(engine, seed=5) == _sample(engine, seed=5)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    first = _sample(engine, seed=None)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    assert _sample(engine, seed=None) != first


def test_an_engine_attached_under_inference_mode_takes_the_next_push(engine):
    """Attached inside `torch.inference_mode()` (the fixture: as Lightning's validation loop runs under
    it for FSDP2 on NCCL), the engine still holds normal tensors, so the next push outside it copies
    into them in place. Before, the push raised 'Inplace update to inference tensor outside
    InferenceMode'."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(engine.model_path)
    engine.update_weights(policy.state_dict())
    with torch.inference_mode():   # a push inside a validation loop too
        engine.update_weights(policy.state_dict())
    assert engine.generate(["1+1="], n=1, sampling=SamplingConfig(max_tokens=4, seed=0))[0][0].token_ids


def test_level_two_sleep_demands_a_push(engine):
    """After a level-2 sleep the weights are gone (on GPU): generate refuses until a push."""
    _sample(engine, seed=1)
    assert engine.needs_weight_push
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(["1+1="], n=1, sampling=SamplingConfig(max_tokens=4))
