"""The sampler/trainer mismatch: how far the rollout engine's log-probs are from the trainer's.

The paper's ratios (eq. 1) compare the current policy with π_old, the trainer's own log-probs of
the sampled tokens. The tokens were sampled by the rollout engine, whose numerics (bf16 kernels,
vLLM's sampler) make π_sampler ≠ π_old: a silent source of off-policyness (verl logs
`training/rollout_probs_diff_*`; TRL corrects it with `vllm_importance_sampling_correction`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from aspo_lit.stats import Stat

MISMATCH_KEYS = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/is_ratio_mean",
                 "rollout/is_ratio_max")


def mismatch_stats(old_logprobs: Tensor, rollout_logprobs: Tensor | None, mask: Tensor) -> dict[str, Stat]:
    """`rollout/logprob_diff_{mean,max}` (|log π_sampler − log π_old|) and `rollout/is_ratio_{mean,max}`
    (exp(old − sampler)) over response tokens, as `Stat` values: the means weighed by this rank's
    response tokens, the maxima as maxima.

    The same four names always, so that every rank reduces the same statistics: a rank with no
    response tokens, or a batch without the engine's log-probs (``rollout_logprobs=None``), gives
    empty statistics (weight 0, max −inf), which the reductions leave out.
    """
    m = mask.bool()
    if rollout_logprobs is None:
        m = torch.zeros_like(m)
        rollout_logprobs = old_logprobs
    diff = torch.where(m, old_logprobs.float() - rollout_logprobs.float(), 0.0)
    ratio = diff.clamp(max=80.0).exp()
    nothing = torch.tensor(float("-inf"), device=diff.device)
    return {
        "rollout/logprob_diff_mean": Stat.mean_over(diff.abs(), where=m),
        "rollout/logprob_diff_max": Stat.max(torch.where(m, diff.abs(), nothing).max() if m.numel() else nothing),
        "rollout/is_ratio_mean": Stat.mean_over(ratio, where=m),
        "rollout/is_ratio_max": Stat.max(torch.where(m, ratio, nothing).max() if m.numel() else nothing),
    }


def truncated_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> Tensor:
    """Per-token truncated importance weights `min(π_old / π_sampler, cap)` (no gradient), fp32.

    Multiplying a token's advantage by its weight scales that token's policy-gradient term by it
    for every registered loss (each is linear in the advantage per token, with the clip regions
    chosen by its sign, which a positive weight keeps).
    """
    if not cap > 0:
        raise ValueError(f"model.rollout_is_cap must be > 0, got {cap!r}")
    return (old_logprobs.detach().float() - rollout_logprobs.float()).clamp(max=80.0).exp().clamp(max=cap)
