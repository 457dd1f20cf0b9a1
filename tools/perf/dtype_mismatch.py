"""The sampler/trainer mismatch for each pair of engine dtype and trainer compute dtype, on the testbed.

    python -m tools.perf.dtype_mismatch [--model testbed] [--prompts 16 --n 8 --max-tokens 64] [--seed 0]

The engine is `HFEngine` on its own copy of the policy loaded in the engine dtype (its KV-cached
decode loop, as a rollout samples); the trainer is `aspo_lit.training.forward.response_logprobs` (the
update's full-sequence forward) on the fp32 policy cast to the compute dtype, which is what
`FSDP2Strategy(param_dtype=...)`'s mixed-precision policy computes in (fp32 master weights, each
layer's weights cast when gathered). Per pair, over the response tokens of one rollout batch:
``rollout/logprob_diff_mean`` and ``_max`` (`aspo_lit.maths.sampler_mismatch`), the IS ratio
π_trainer/π_sampler's standard deviation, and the share of tokens whose ratio sits outside the
clip range [0.8, 1.2] before any update (where the loss would clip or flip them for numerics
alone), and the flip's share: with the sampler's log-probs as π_old (``model.old_logprobs:
sampler``) and every token given A > 0, Σ|w_GRPO − w_ASPO| / Σ w_GRPO (`flip/weight_change`,
`aspo_lit.maths.counterfactual`), the part of a first update that ASPO's flip changes for numerics alone.
Prints a Markdown table (docs/gpu.md, "fp16 compute").
"""

from __future__ import annotations

import argparse
import time

DTYPES = ("float32", "bfloat16", "float16")


def main() -> None:
    import torch

    from aspo_lit.maths.counterfactual import flip_change_sums, share, shipped_losses, token_weights
    from aspo_lit.maths.sampler_mismatch import mismatch_stats
    from aspo_lit.prompts import encode_prompt
    from aspo_lit.rollout import SamplingConfig
    from aspo_lit.rollout.batch import pack_rollouts
    from aspo_lit.rollout.hf import HFEngine
    from aspo_lit.testbed.arithmetic import generate_problems
    from aspo_lit.training.forward import response_logprobs
    from aspo_lit.training.models import load_policy, load_tokenizer, resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="testbed")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)

    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    problems = generate_problems(args.prompts, seed=args.seed, split="heldout")
    prompts = [encode_prompt(row["problem"], tokenizer, "chat", enable_thinking=None) for row in problems]
    trainers = {dtype: load_policy(path, "float32").to(getattr(torch, dtype)).eval() for dtype in DTYPES}

    print(f"model {path}; {args.prompts} prompts x {args.n} samples, up to {args.max_tokens} tokens, T = 1.0\n")
    losses = {name: loss for name, loss in shipped_losses().items() if name in ("grpo", "aspo")}
    print("| engine | trainer compute | tokens | logprob_diff_mean | logprob_diff_max | IS ratio std "
          "| share outside [0.8, 1.2] | flip's share |")
    print("|---|---|---|---|---|---|---|---|")
    for engine_dtype in DTYPES:
        t0 = time.perf_counter()
        engine = HFEngine(dtype=engine_dtype, device="cpu")
        engine.attach(None, tokenizer, path)
        sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens, logprobs=True, seed=args.seed)
        packed = pack_rollouts(prompts, engine.generate(prompts, n=args.n, sampling=sampling), tokenizer.pad_token_id)
        sample_s = time.perf_counter() - t0
        mask = packed["response_mask"]
        sampler = packed["engine_logprobs"]
        for trainer_dtype, model in trainers.items():
            with torch.no_grad():
                trainer, _ = response_logprobs(model, packed["input_ids"], packed["attention_mask"],
                                               packed["prompt_length"], temperature=1.0, chunk_size=1024)
            stats = mismatch_stats(trainer, sampler, mask)
            on = mask.bool()
            ratio = (trainer.double() - sampler.double())[on].exp()
            outside = ((ratio < 0.8) | (ratio > 1.2)).double().mean().item()
            w = token_weights(losses, trainer.float(), sampler.float(), on.float(), on)
            sums = flip_change_sums(w["grpo"], w["aspo"], on, torch.zeros_like(on))
            flip = float(share(sums[0], sums[1]))
            print(f"| {engine_dtype} | {trainer_dtype} | {int(on.sum())} | "
                  f"{float(stats['rollout/logprob_diff_mean']):.2e} | {float(stats['rollout/logprob_diff_max']):.2e} | "
                  f"{ratio.std().item():.2e} | {outside:.2%} | {flip:.2e} |")
        print(f"<!-- sampling in {engine_dtype}: {sample_s:.1f} s -->")


if __name__ == "__main__":
    main()
