"""Policy-loss cost: ms per call (forward + backward) at B=256, T=4096 on CPU, for every loss.

    python -m tools.perf.bench_losses [--batch 256] [--length 4096] [--repeats 7]

Prints one line per loss and the aspo/grpo ratio (target: within 1.3x). The losses are timed
round-robin and each reports its fastest call, so load from other processes on a shared machine
skews them all alike rather than whichever ran during a spike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from aspo_lit.maths.losses import POLICY_LOSSES, get_policy_loss

BUILTIN = ["grpo", "grpo_no_is", "grpo_pos_mean", "aspo", "aspo_no_dual_clip", "cispo", "gspo"]


def make_batch(batch: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(batch, length, generator=g) * 0.5 - 1.0
    logprobs = old + torch.randn(batch, length, generator=g) * 0.3
    advantages = torch.randn(batch, generator=g)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=g)
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).float()
    return logprobs, old, advantages, mask


def time_call(loss_fn, batch) -> float:
    logprobs, old, advantages, mask = batch
    leaf = logprobs.detach().clone().requires_grad_(True)
    start = time.perf_counter()
    loss, _ = loss_fn(leaf, old, advantages, mask)
    loss.backward()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batch = make_batch(args.batch, args.length)
    names = BUILTIN + sorted(set(POLICY_LOSSES) - set(BUILTIN))
    loss_fns = {name: get_policy_loss(name) for name in names}
    print(f"B={args.batch} T={args.length} CPU threads={torch.get_num_threads()} torch {torch.__version__}")
    times = {name: [] for name in names}
    for i in range(args.repeats + 1):
        for name in names:
            elapsed = time_call(loss_fns[name], batch)
            if i > 0:  # the first round warms up
                times[name].append(elapsed)
    for name in names:
        print(f"{name:>18s}: {min(times[name]):8.1f} ms / call (fwd+bwd; min of {args.repeats}, "
              f"median {statistics.median(times[name]):.1f})")
    print(f"aspo / grpo = {min(times['aspo']) / min(times['grpo']):.2f}x (min), "
          f"{statistics.median(times['aspo']) / statistics.median(times['grpo']):.2f}x (median)")


if __name__ == "__main__":
    main()
