"""The sampler/trainer mismatch: how far the rollout engine's log-probs are from the trainer's.

The paper's ratios (eq. 1) compare the current policy with π_old, the trainer's own log-probs of
the sampled tokens. The tokens were sampled by the rollout engine, whose numerics (bf16 kernels,
vLLM's sampler) make π_sampler ≠ π_old: a silent source of off-policyness (verl logs
`training/rollout_probs_diff_*`; TRL corrects it with `vllm_importance_sampling_correction`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from aspo_lit.maths.stats import Stat

MISMATCH_KEYS = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/is_ratio_mean",
                 "rollout/is_ratio_max")
KEPT_MASS = "rollout/kept_mass"


def check_truncated_support(top_p: float, old_logprobs: str, rollout_is_cap: float | None) -> None:
    """Refuse a nucleus cut (``top_p < 1``) where the sampler's log-probs reach the loss.

    With ``top_p < 1`` the sampler's log-probs are over the kept tokens, renormalised; the trainer's
    are over the whole vocabulary, so ``π_trainer / π_sampler`` carries the kept mass (0.99 on the
    testbed at top_p 0.8; 0.90 measured by others on a 1.5B model at 0.8). When that ratio is the
    loss's (``old_logprobs: sampler``: the ratio and ASPO's flip act on π/π_sampler) or weighs the
    advantages (``rollout_is_cap``), every token's weight is biased by 1/(kept mass). The trainer's
    own π_old (``recompute``) is over the same support as π, and trains unbiased under any top_p."""
    if top_p >= 1.0:
        return
    if old_logprobs == "sampler":
        raise ValueError(
            f"data.top_p={top_p} with model.old_logprobs=sampler: the sampler's log-probs are renormalised over "
            "the nucleus, the trainer's over the whole vocabulary, so the ratio the loss clips (and ASPO flips) "
            "carries the kept mass. Set model.old_logprobs: recompute, or data.top_p: 1.0")
    if rollout_is_cap is not None:
        raise ValueError(
            f"data.top_p={top_p} with model.rollout_is_cap={rollout_is_cap}: the truncated IS weight "
            "min(π_old / π_sampler, cap) then carries the nucleus's kept mass, not the sampler/trainer gap. "
            "Set model.rollout_is_cap: null, or data.top_p: 1.0")


def mismatch_stats(old_logprobs: Tensor, rollout_logprobs: Tensor | None, mask: Tensor,
                   top_p: float = 1.0) -> dict[str, Stat]:
    """`rollout/logprob_diff_{mean,max}` (|log π_sampler − log π_old|) and `rollout/is_ratio_{mean,max}`
    (exp(old − sampler)) over response tokens, as `Stat` values: the means weighed by this rank's
    response tokens, the maxima as maxima. A batch sampled with ``top_p < 1`` adds
    `rollout/kept_mass`: the nucleus's probability mass at each sampled position, π_old(o_t) /
    π_sampler(o_t) with π_old over the whole vocabulary and π_sampler renormalised over the kept
    tokens (exact where the engine's distribution is the trainer's; ``old_logprobs: recompute``,
    the only mode `check_truncated_support` lets sample with a nucleus).

    The same names for every batch of a run (top_p is the run's), so that every rank reduces the same
    statistics: a rank with no response tokens, or a batch without the engine's log-probs
    (``rollout_logprobs=None``), gives empty statistics (weight 0, max −inf), which the reductions leave out.
    """
    m = mask.bool()
    if rollout_logprobs is None:
        m = torch.zeros_like(m)
        rollout_logprobs = old_logprobs
    diff = torch.where(m, old_logprobs.float() - rollout_logprobs.float(), 0.0)
    ratio = diff.clamp(max=80.0).exp()
    nothing = torch.tensor(float("-inf"), device=diff.device)
    stats = {
        "rollout/logprob_diff_mean": Stat.mean_over(diff.abs(), where=m),
        "rollout/logprob_diff_max": Stat.max(torch.where(m, diff.abs(), nothing).max() if m.numel() else nothing),
        "rollout/is_ratio_mean": Stat.mean_over(ratio, where=m),
        "rollout/is_ratio_max": Stat.max(torch.where(m, ratio, nothing).max() if m.numel() else nothing),
    }
    if top_p < 1.0:
        stats[KEPT_MASS] = Stat.mean_over(ratio, where=m)
    return stats


def truncated_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> Tensor:
    """Per-token truncated importance weights `min(π_old / π_sampler, cap)` (no gradient), fp32.

    Multiplying a token's advantage by its weight scales that token's policy-gradient term by it
    for every registered loss (each is linear in the advantage per token, with the clip regions
    chosen by its sign, which a positive weight keeps).
    """
    if not cap > 0:
        raise ValueError(f"model.rollout_is_cap must be > 0, got {cap!r}")
    return (old_logprobs.detach().float() - rollout_logprobs.float()).clamp(max=80.0).exp().clamp(max=cap)
