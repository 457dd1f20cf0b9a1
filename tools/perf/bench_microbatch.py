"""Fixed-size vs token-budget micro-batches: padding fraction and update time (CPU, fp32).

    python -m tools.perf.bench_microbatch [--rows 64] [--cap 2048] [--prompt 128] [--sigma 1.0] [--seed 0] [--repeats 2]

One rollout batch laid out as training sees it: ``rows`` rows of ``[left-padded prompt | right-
padded response]``, prompt width ``prompt`` (real prompt lengths uniform in [prompt/2, prompt]),
response lengths lognormal with median cap/8 and log-std ``sigma``, clipped to [1, cap].

Each strategy runs forward + backward of ``sum(response log-probs × response mask)`` through a tiny
HF llama (2 layers, hidden 64, 64-token vocab) over its micro-batches, all rows once:

* ``fixed 4 (today)``: rows 0-3, 4-7, ... each computed at the batch's full width ``P + T`` (the
  training step slices rows out of the batch and keeps every column);
* ``fixed 4, trimmed``: the same rows, each micro-batch cut to its own longest response;
* ``budget k×(P+cap)``: ``token_budget_micro_batches`` (sorted by response length, greedy, at most
  ``k × (P + cap)`` padded tokens per micro-batch; ``k = 4`` costs no more memory per micro-batch
  than today's 4 rows at the cap), each cut with ``trim_to_micro_batch``.

Padding fraction = padded / computed tokens (prompt columns count as needed). The log-probs of
every strategy are checked against one full-width pass (max abs difference printed). Times are the
best of ``repeats`` runs (the machine may be shared).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from aspo_lit.maths.microbatch import padding_fraction, token_budget_micro_batches, trim_to_micro_batch
from aspo_lit.training.forward import response_logprobs

VOCAB = 64


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
                         pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def build_batch(rows: int, cap: int, prompt: int, sigma: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(math.log(cap / 8) + sigma * torch.randn(rows, generator=g)).round().clamp(1, cap).long()
    prompt_lengths = torch.randint(prompt // 2, prompt + 1, (rows,), generator=g)
    width = prompt + int(lengths.max())
    cols = torch.arange(width)
    mask = ((cols >= prompt - prompt_lengths[:, None]) & (cols < prompt + lengths[:, None])).long()
    input_ids = torch.randint(1, VOCAB, (rows, width), generator=g) * mask
    response_mask = mask[:, prompt:].float()
    return input_ids, mask, response_mask, lengths


def run(model, input_ids, mask, response_mask, prompt, micro_batches, trim, lengths):
    """Forward+backward over the micro-batches; returns (seconds, [N, T] log-probs)."""
    model.zero_grad(set_to_none=True)
    out = torch.zeros_like(response_mask)
    start = time.perf_counter()
    for rows in micro_batches:
        if trim:
            ids, m = trim_to_micro_batch(input_ids, mask, prompt, lengths, rows)
        else:
            ids, m = input_ids[rows], mask[rows]
        lp, _ = response_logprobs(model, ids, m, prompt)
        w = lp.shape[1]
        (lp * response_mask[rows, :w]).sum().backward()
        out[rows, :w] = lp.detach()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cap", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budgets", type=float, nargs="+", default=[4, 2, 1], help="in units of prompt + cap")
    args = parser.parse_args()
    P = args.prompt
    input_ids, mask, response_mask, lengths = build_batch(args.rows, args.cap, P, args.sigma, args.seed)
    model = build_model()
    with torch.no_grad():
        reference, _ = response_logprobs(model, input_ids, mask, P)
    run(model, input_ids, mask, response_mask, P, [torch.arange(2)], True, lengths)  # warm-up
    fixed = list(torch.arange(args.rows).split(4))
    strategies = [("fixed 4 (today)", fixed, False), ("fixed 4, trimmed", fixed, True)]
    for k in args.budgets:
        budget = int(k * (P + args.cap))
        strategies.append((f"budget {k:g}×(P+cap) = {budget}",
                           token_budget_micro_batches(lengths, budget, fixed_width=P), True))

    print(f"rows {args.rows}, prompt width {P}, response lengths lognormal median {args.cap // 8} "
          f"sigma {args.sigma} clipped to [1, {args.cap}] (median {int(lengths.median())}, max {int(lengths.max())}, "
          f"mean {lengths.float().mean():.0f}), tiny llama fp32, threads {torch.get_num_threads()}\n")
    print("| strategy | micro-batches | computed tokens | padded / computed | fwd+bwd s | max |Δ log-prob| |")
    print("|---|---|---|---|---|---|")
    for name, micro, trim in strategies:
        # untrimmed micro-batches compute the batch's full width: as one micro-batch of all rows
        groups = micro if trim else [torch.arange(args.rows)]
        frac = padding_fraction(lengths, groups, fixed_width=P)
        computed = sum(rows.numel() * (P + int(lengths[rows].max())) for rows in groups)
        seconds, logprobs = min((run(model, input_ids, mask, response_mask, P, micro, trim, lengths)
                                for _ in range(args.repeats)), key=lambda result: result[0])
        diff = float(((logprobs - reference).abs() * response_mask).max())
        print(f"| {name} | {len(micro)} | {computed} | {frac:.3f} | {seconds:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
