"""Response log-probs forward+backward: peak memory and time, HF logits path vs fused linear (CPU, fp32).

    python -m tools.perf.bench_fused_logprobs [--tokens 4096 8192 16384] [--hidden 64] [--chunk-size 1024]

A real Qwen2 architecture built from a config (2 layers, hidden 64, the real 151,936-token vocab,
random init, no network), batch 1, a 16-token prompt and T response tokens. "logits" is the old
path (`response_logprobs_unfused`: the model's `[1, T+1, V]` logits, then the chunked maths of
aspo_lit.maths.logprobs); "fused" is `response_logprobs` (hidden states x LM-head weight, a chunk of
tokens at a time, recomputed in the backward: verl's FusedLinearForPPO idea).

Each (T, path) runs in a fresh subprocess that builds the model and inputs, then reads the
resident set before (/proc/self/statm) and the peak resident set after (`ru_maxrss`) one
forward + backward of `sum(log-probs)`: the difference is the peak extra memory of the step (model
activations included, the same for both paths). A case whose estimated need (2.5 x T x V x 4 B + 1 GiB
for the logits path: the logits, their gradient and the gradient of the un-sliced logits are alive
together at times; 2.3 x was measured at T = 8k) exceeds 90 % of the machine's available memory is
skipped and reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from aspo_lit.training.forward import response_logprobs, response_logprobs_unfused

VOCAB = 151_936
PROMPT = 16


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux: KiB


def available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**10
    return float("inf")


def build_model(hidden: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32_768,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def run_case(path: str, tokens: int, hidden: int, chunk_size: int) -> dict:
    model = build_model(hidden)
    ids = torch.randint(0, VOCAB, (1, PROMPT + tokens), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    fn = response_logprobs if path == "fused" else response_logprobs_unfused
    before = rss_mib()
    start = time.perf_counter()
    logprobs, _ = fn(model, ids, mask, PROMPT, temperature=0.9, chunk_size=chunk_size)
    logprobs.sum().backward()
    seconds = time.perf_counter() - start
    grad_norm = float(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm())
    return {"path": path, "tokens": tokens, "seconds": seconds, "peak_mib": peak_rss_mib() - before,
            "logprob_sum": float(logprobs.detach().double().sum()), "grad_norm": grad_norm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--case", nargs=2, metavar=("PATH", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.hidden, args.chunk_size)))
        return

    print(f"Qwen2 2 layers, hidden {args.hidden}, vocab {VOCAB}, fp32, batch 1, prompt {PROMPT}, "
          f"chunk_size {args.chunk_size}, threads {torch.get_num_threads()}\n")
    print("| T | logits path peak MiB | fused peak MiB | fused / logits | T×V×4 B (MiB) | logits path s | fused s |")
    print("|---|---|---|---|---|---|---|")
    for tokens in args.tokens:
        row = {}
        for path in ("logits", "fused"):
            need = 2.5 * (tokens + 1) * VOCAB * 4 / 2**20 + 1024 if path == "logits" else 4096
            if need > 0.9 * available_mib():
                row[path] = None
                continue
            cmd = [sys.executable, "-m", "tools.perf.bench_fused_logprobs", "--case", path, str(tokens), "--hidden", str(args.hidden),
                   "--chunk-size", str(args.chunk_size)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            row[path] = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
            if proc.returncode != 0:
                print(f"<!-- {path} T={tokens} failed (rc {proc.returncode}): {proc.stderr[-300:]!r} -->")
        logits, fused = row["logits"], row["fused"]
        cell = lambda r, key, fmt: format(r[key], fmt) if r else "skipped (memory)"  # noqa: E731
        ratio = f"{fused['peak_mib'] / logits['peak_mib']:.3f}" if logits and fused else "–"
        print(f"| {tokens} | {cell(logits, 'peak_mib', '.0f')} | {cell(fused, 'peak_mib', '.0f')} | {ratio} | "
              f"{tokens * VOCAB * 4 / 2**20:.0f} | {cell(logits, 'seconds', '.1f')} | "
              f"{cell(fused, 'seconds', '.1f')} |", flush=True)
        if logits and fused:
            agree = abs(logits["logprob_sum"] - fused["logprob_sum"]) <= 1e-4 * abs(logits["logprob_sum"]) and \
                abs(logits["grad_norm"] - fused["grad_norm"]) <= 1e-3 * logits["grad_norm"]
            if not agree:
                print(f"<!-- T={tokens}: paths disagree: {logits} vs {fused} -->")


if __name__ == "__main__":
    main()
