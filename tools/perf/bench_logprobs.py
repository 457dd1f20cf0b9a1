"""Log-prob + entropy from logits: peak extra memory and time, chunked vs naive (CPU, fp32).

    python -m tools.perf.bench_logprobs [--tokens 8192] [--vocab 151936] [--chunk-size 1024]

Each variant runs in a fresh subprocess that first allocates the ``[1, tokens, vocab]`` fp32
logits (8192 × 151,936 × 4 B ≈ 4.98 GB), then reads the peak resident set (``ru_maxrss``) before
and after the computation: the difference is the variant's peak extra memory (tracemalloc cannot
see torch's allocations). "naive" is the usual full-tensor code (verl's ``entropy_from_logits``
plus ``log_softmax`` → ``gather``) with each intermediate freed as early as it can be -- two
``[tokens × vocab]`` fp32 temporaries at its peak. Issue 3 asks chunked ≤ 1/8 of naive.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from aspo_lit.maths.logprobs import logprobs_and_entropy


def naive_logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor):
    logp = torch.log_softmax(logits.float(), dim=-1)
    logprobs = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    del logp
    probs = torch.softmax(logits.float(), dim=-1)
    entropy = torch.logsumexp(logits.float(), dim=-1) - (probs * logits.float()).sum(-1)
    return logprobs, entropy


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def run_variant(variant: str, tokens: int, vocab: int, chunk_size: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, tokens, vocab, generator=generator)
    labels = torch.randint(0, vocab, (1, tokens), generator=generator)
    before = peak_rss_gib()
    start = time.perf_counter()
    with torch.no_grad():
        if variant == "naive":
            logprobs, entropy = naive_logprobs_and_entropy(logits, labels)
        else:
            logprobs, entropy = logprobs_and_entropy(logits, labels, chunk_size=chunk_size)
    seconds = time.perf_counter() - start
    checksum = [float(logprobs.double().sum()), float(entropy.double().sum())]
    return {"variant": variant, "seconds": seconds, "extra_gib": peak_rss_gib() - before,
            "logits_gib": logits.numel() * 4 / 2**30, "checksum": checksum}


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--variant", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.tokens, args.vocab, args.chunk_size)))
        return

    logits_gib = args.tokens * args.vocab * 4 / 2**30
    needed = logits_gib * 3 + 1  # naive: logits + two full temporaries
    if available_gib() < needed:
        sys.exit(f"needs ~{needed:.1f} GiB free, {available_gib():.1f} GiB available; lower --tokens")
    print(f"tokens={args.tokens} vocab={args.vocab} fp32 logits={logits_gib:.2f} GiB "
          f"chunk_size={args.chunk_size} threads={torch.get_num_threads()}")
    results = {}
    for variant in ("chunked", "naive"):
        cmd = [sys.executable, "-m", "tools.perf.bench_logprobs", "--variant", variant, "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--chunk-size", str(args.chunk_size)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
        r = results[variant]
        print(f"{variant:>8s}: {r['seconds']:7.2f} s   peak extra memory {r['extra_gib']:6.2f} GiB")
    chunked, naive = results["chunked"], results["naive"]
    agree = all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(chunked["checksum"], naive["checksum"]))
    print(f"chunked / naive peak extra memory = {chunked['extra_gib'] / naive['extra_gib']:.3f} "
          f"(target <= 0.125); time ratio = {chunked['seconds'] / naive['seconds']:.2f}; "
          f"results agree: {agree}")


if __name__ == "__main__":
    main()
