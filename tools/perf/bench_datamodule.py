"""Rollout overhead of the DataModule over the raw engine, on the testbed model.

    python -m tools.perf.bench_datamodule [--engine hf|vllm] [--batches 5]

Times `engine.generate` alone and `RolloutController.rollout` (generate + grading + advantages +
packing) on the same prompts and seeds, and reports the overhead, tokens/s and weight-sync time.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args()

    import torch

    from aspo_lit.rollout import SamplingConfig
    from aspo_lit.training.models import load_policy, load_tokenizer, named_full_tensors, resolve_model_path
    from aspo_lit.training.module import PolicyHandle
    from data_modules.testbed import ArithmeticRLDataModule

    path = resolve_model_path("testbed")
    policy, tokenizer = load_policy(path), load_tokenizer(path)
    data = ArithmeticRLDataModule(num_train=args.prompts * args.batches, num_val=0, batch_size=args.prompts,
                                  group_size=args.group_size, max_response_length=64, engine=args.engine)
    data.attach_policy(PolicyHandle(tokenizer=tokenizer, policy=policy, model_path=path, device=torch.device("cpu")))
    batches = list(data.train_dataloader())
    engine = data.controller.ensure_engine()

    raw, full, tokens = [], [], []
    for i, records in enumerate(batches):
        sampling = SamplingConfig(temperature=1.0, max_tokens=64, seed=i)
        start = time.perf_counter()
        completions = engine.generate([r["prompt_ids"] for r in records], n=args.group_size, sampling=sampling)
        raw.append(time.perf_counter() - start)
        tokens.append(sum(len(c.token_ids) for group in completions for c in group))
        start = time.perf_counter()
        data.controller.rollout(records, seed=i)
        full.append(time.perf_counter() - start)

    sync = []
    for _ in range(3):
        start = time.perf_counter()
        engine.update_weights(named_full_tensors(policy))
        sync.append(time.perf_counter() - start)

    skip = 1 if len(raw) > 1 else 0  # first call warms up (reward worker pool, vLLM graphs)
    raw_s, full_s = statistics.median(raw[skip:]), statistics.median(full[skip:])
    print(f"engine={args.engine}  prompts={args.prompts} x G={args.group_size}  batches={len(raw)}")
    print(f"raw engine.generate      median {raw_s:.3f} s  ({statistics.median(tokens) / raw_s:.0f} tokens/s)")
    print(f"DataModule.rollout       median {full_s:.3f} s")
    print(f"overhead                 {100 * (full_s - raw_s) / raw_s:+.1f} %")
    print(f"weight sync              median {statistics.median(sync) * 1000:.1f} ms")
    data.teardown("fit")


if __name__ == "__main__":
    main()
