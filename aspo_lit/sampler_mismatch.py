"""The sampler/trainer mismatch: how far the rollout engine's log-probs are from the trainer's.

The paper's ratios (eq. 1) compare the current policy with π_old, the trainer's own log-probs of
the sampled tokens. The tokens were sampled by the rollout engine, whose numerics (bf16 kernels,
vLLM's sampler) make π_sampler ≠ π_old: a silent source of off-policyness (verl logs
`training/rollout_probs_diff_*`; TRL corrects it with `vllm_importance_sampling_correction`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def mismatch_stats(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """`rollout/logprob_diff_{mean,max}` (|π_sampler − π_old| in log space) and
    `rollout/is_ratio_{mean,max}` (exp(old − sampler)) over response tokens; this rank's sums too
    (`rollout/num_tokens`), so ranks can be combined."""
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        return {}
    diff = (old_logprobs.float() - rollout_logprobs.float())[m]
    ratio = diff.clamp(max=80.0).exp()
    return {"rollout/logprob_diff_mean": float(diff.abs().mean()), "rollout/logprob_diff_max": float(diff.abs().max()),
            "rollout/is_ratio_mean": float(ratio.mean()), "rollout/is_ratio_max": float(ratio.max()),
            "rollout/num_tokens": float(n)}


def truncated_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> Tensor:
    """Per-token truncated importance weights `min(π_old / π_sampler, cap)` (no gradient), fp32.

    Multiplying a token's advantage by its weight scales that token's policy-gradient term by it
    for every registered loss (each is linear in the advantage per token, with the clip regions
    chosen by its sign, which a positive weight keeps).
    """
    if not cap > 0:
        raise ValueError(f"model.rollout_is_cap must be > 0, got {cap!r}")
    return (old_logprobs.detach().float() - rollout_logprobs.float()).clamp(max=80.0).exp().clamp(max=cap)
