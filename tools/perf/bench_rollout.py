"""Rollout-engine throughput and weight-sync time on a tiny model.

    python -m tools.perf.bench_rollout [--model DIR] [--engines hf,vllm] [--prompts 8 --n 8
        --max-tokens 64] [--repeats 3] [--syncs 5] [--in-process] [--torch-threads N]
        [--out results.json]

Model: ``--model``, else the testbed policy when it is already built (aspo_lit.testbed), else a
random-init llama of the testbed's shape (hidden 128, 4 layers, 4 heads, fp32) with the
char-level test tokenizer. Per engine it reports start-up time, decode throughput (generated
tokens / wall time of ``generate(prompts, n)``, after one warm-up call) and the time of
``update_weights`` (the policy perturbed before each push). vLLM runs in fp32 like the policy.
On CPU vLLM spawns its engine process: this script keeps the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _random_testbed_shaped_model(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tools.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def resolve_model(arg: str | None, tmp: Path) -> tuple[Path, str]:
    if arg:
        return Path(arg), "given"
    try:
        from aspo_lit.testbed.shipped import shipped_dir

        return shipped_dir("testbed"), "testbed"
    except Exception:  # noqa: BLE001 - testbed module optional here
        pass
    return _random_testbed_shaped_model(tmp / "tiny"), "random tiny llama (testbed shape)"


def perturb(model, scale=1e-3):
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def bench_engine(name, engine, policy, tok, model_dir, args) -> dict:
    from aspo_lit.rollout import SamplingConfig

    t0 = time.perf_counter()
    engine.attach(policy, tok, str(model_dir))
    startup = time.perf_counter() - t0
    prompts = [tok(f"question {i}: what is {i} plus {2 * i + 7}? answer:")["input_ids"] for i in range(args.prompts)]
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens, logprobs=not args.no_logprobs)
    engine.generate(prompts, n=args.n, sampling=sampling)  # warm-up
    times, tokens = [], []
    for r in range(args.repeats):
        t = time.perf_counter()
        out = engine.generate(prompts, n=args.n, sampling=SamplingConfig(**{**sampling.__dict__, "seed": r}))
        times.append(time.perf_counter() - t)
        tokens.append(sum(len(c.token_ids) for g in out for c in g))
    syncs = []
    for _ in range(args.syncs):
        perturb(policy)
        engine.update_weights(policy.named_parameters())
        syncs.append(engine.last_sync_s)
    res = {
        "engine": name,
        "startup_s": round(startup, 3),
        "rollout_s_median": round(statistics.median(times), 4),
        "tokens_per_rollout": int(statistics.median(tokens)),
        "tokens_per_s": round(sum(tokens) / sum(times), 1),
        "weight_sync_s_median": round(statistics.median(syncs), 4),
        "weight_sync_s_all": [round(s, 4) for s in syncs],
    }
    info = getattr(engine, "last_sync_info", None)
    if info:
        res["last_sync_breakdown"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in info.items()}
        res["sync_path"] = getattr(engine, "sync_path", None)
    engine.close()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--engines", default="hf,hf_copy,vllm")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--in-process", action="store_true", help="vLLM engine core in this process")
    p.add_argument("--no-logprobs", action="store_true")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch.set_num_threads for this process (the HF engines); on a loaded "
                        "2-core box 1 thread is ~30x faster than 2 (OpenMP oversubscription)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aspo_lit.rollout import HFEngine, vllm_available

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, source = resolve_model(args.model, Path(tmp))
        print(f"model: {model_dir} ({source}); {args.prompts} prompts x {args.n} samples x "
              f"{args.max_tokens} tokens; torch threads {torch.get_num_threads()}", flush=True)
        for name in [e.strip() for e in args.engines.split(",") if e.strip()]:
            policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(model_dir)
            if name == "hf":
                engine = HFEngine(max_batch_size=args.prompts * args.n)
            elif name == "hf_copy":
                engine = HFEngine(max_batch_size=args.prompts * args.n, copy=True)
            elif name == "vllm":
                if not vllm_available():
                    print("vllm: skipped (import vllm fails)", flush=True)
                    continue
                from aspo_lit.rollout.vllm import VLLMEngine

                engine = VLLMEngine(kv_cache_gb=1, in_process=args.in_process)  # "auto": fp32 checkpoint
                name = "vllm (in-process)" if args.in_process else "vllm"
            else:
                raise SystemExit(f"unknown engine {name}")
            res = bench_engine(name, engine, policy, tok, model_dir, args)
            res["model"] = source
            res["torch_threads"] = torch.get_num_threads()
            results.append(res)
            print(json.dumps(res), flush=True)
    print("\n| engine | start-up s | rollout s | tokens | tokens/s | weight sync s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['engine']} | {r['startup_s']:.2f} | {r['rollout_s_median']:.3f} | {r['tokens_per_rollout']} "
              f"| {r['tokens_per_s']:.0f} | {r['weight_sync_s_median']:.4f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
