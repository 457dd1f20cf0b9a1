"""Counterfactual token weights: every shipped loss's effective weight on the same tokens, and the
statistics that say what ASPO's flip changes (docs/metrics.md, "What the flip changes").

Prop. 4.1: each loss's gradient is ``Σ_t w_t·A_t·∇log π_θ(y_t)`` with a detached token weight ``w``
(:func:`aspo_lit.maths.losses.effective_token_weight`). Given one rollout batch's tokens -- ``log π_old``,
``log π_θ`` at the token's last update, π_old's entropy, the group advantage of eq. 1 -- every loss's
``w`` follows without a model forward, so the losses can be compared on the *same* tokens: GRPO's
``m·r`` against ASPO's flipped ``1/r`` (Sec. 6, eq. 3) above all.

Every statistic is float64. Two kinds, by how they combine over ranks:

* sums that add up exactly (:func:`flip_change_sums`, :func:`entropy_split_sums`,
  :func:`covariance_sums`, :func:`state_centred_sums`), and what they give once added
  (:func:`share`, :func:`entropy_change`, :func:`state_centred_entropy_change`);
* statistics of the whole batch's token population that no sum gives -- population deciles, rank
  correlation, quantiles (:func:`decile_means`, :func:`spearman`, :func:`quantiles`): computed on
  every rank's tokens gathered.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from aspo_lit.maths.losses import POLICY_LOSSES, PolicyLoss, effective_token_weight, get_policy_loss

__all__ = ["SHIPPED_LOSSES", "FORCED_ENTROPY", "shipped_losses", "token_weights", "flip_change_sums",
           "entropy_split_sums", "covariance_sums", "share", "entropy_change", "state_centred_sums",
           "state_centred_entropy_change", "first_order_entropy_change", "decile_means",
           "average_ranks", "spearman", "quantiles"]

#: The losses aspo_lit ships (registered in `aspo_lit.maths.losses`), in registration order.
SHIPPED_LOSSES: tuple[str, ...] = tuple(name for name, cls in POLICY_LOSSES.items()
                                        if cls.__module__ == PolicyLoss.__module__)

#: log(1 + ε_high) at the paper's ε_high = 0.2 (nats): a token whose π_old entropy is below it is
#: "forced" (why: `aspo_lit.callbacks.counterfactual_weights`).
FORCED_ENTROPY = math.log(1.2)


def shipped_losses(hparams: Mapping[str, Any] | None = None) -> dict[str, PolicyLoss]:
    """``{name: loss}`` for every shipped loss, all built with the same ``hparams`` (the
    `PolicyLoss` arguments: ε, c, the ratio clamp, the entropy-dependent ε option)."""
    return {name: get_policy_loss(name, **dict(hparams or {})) for name in SHIPPED_LOSSES}


def token_weights(losses: Mapping[str, PolicyLoss], logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                  mask: Tensor, entropy: Tensor | None = None) -> dict[str, Tensor]:
    """``{name: w [N, T]}``: each loss's effective token weight (Prop. 4.1) on the same tokens, by
    autograd on its ``token_loss`` (no model forward); 0 on padding and where A = 0. ``entropy``
    (π_old's, ``[N, T]``) is read only by a loss with the entropy-dependent ε option."""
    return {name: effective_token_weight(loss, logprobs, old_logprobs, advantages, mask, entropy=entropy)
            for name, loss in losses.items()}


def _masked_sum(x: Tensor, where: Tensor) -> Tensor:
    return torch.where(where, x.double(), 0.0).sum()


def flip_change_sums(w_grpo: Tensor, w_aspo: Tensor, positive: Tensor, forced: Tensor) -> Tensor:
    """``[Σ|w_GRPO − w_ASPO|, Σ w_GRPO]`` over the ``positive`` tokens (response tokens with A > 0),
    then over those of them that are ``forced``, then over the free ones: 6 float64 sums."""
    change = (w_grpo.double() - w_aspo.double()).abs()
    parts = (positive, positive & forced, positive & ~forced)
    return torch.stack([total for part in parts for total in (_masked_sum(change, part), _masked_sum(w_grpo, part))])


def entropy_split_sums(entropy: Tensor, mask: Tensor, forced: Tensor) -> Tensor:
    """``[N, N_forced, Σ_forced H, Σ_free H]`` over the response tokens (``mask``), float64."""
    mask = mask.bool()
    forced = mask & forced
    return torch.stack([mask.sum().double(), forced.sum().double(),
                        _masked_sum(entropy, forced), _masked_sum(entropy, mask & ~forced)])


def covariance_sums(x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
    """``[n, Σx, Σy, Σx·y]`` over the tokens of ``mask`` (float64): what a covariance needs, summable
    over ranks."""
    keep = mask.bool()
    x, y = torch.where(keep, x.double(), 0.0), torch.where(keep, y.double(), 0.0)
    return torch.stack([keep.sum().double(), x.sum(), y.sum(), (x * y).sum()])


def share(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator``; NaN where the denominator is 0 (a share of nothing)."""
    return torch.where(denominator != 0, numerator / torch.where(denominator != 0, denominator, 1.0), torch.nan)


def entropy_change(sums: Tensor) -> Tensor:
    """``−Cov(x, y) = −(Σxy/n − (Σx/n)(Σy/n))`` from :func:`covariance_sums` (added over ranks);
    NaN when n = 0. With ``x = log π_old`` and ``y = w·A`` it is the first-order entropy change of
    Cui et al. 2025 (arXiv 2505.22617, Sec. 3) with the loss's weight inside the logit change
    (``η·w·A`` instead of ``η·A``), in units of the step size η."""
    n, sx, sy, sxy = sums.double().unbind()
    cov = share(sxy, n) - share(sx, n) * share(sy, n)
    return -cov


def state_centred_sums(logprobs: Tensor, entropy: Tensor, y: Tensor, mask: Tensor,
                       importance: Tensor | None = None) -> Tensor:
    """``[n, Σ ρ·(log π + H)·y]`` over the tokens of ``mask`` (float64, summable over ranks): the
    state-centred covariance's sums. ``logprobs`` is ``log π(y_t | s_t)`` of the sampled token,
    ``entropy`` π's entropy at that state, ``y`` the logit change's coefficient (``w·A``) and
    ``importance`` ρ = π/π_sampler (1 when π is the policy that sampled, i.e. π_old).

    Each token is one state ``s_t`` and one action drawn there. Since ``E_{a∼π}[log π(a|s) + H(s)] = 0``,
    ``ρ·(log π(y|s) + H(s))·y(s, y)`` is an unbiased estimate of ``Cov_{a∼π(·|s)}(log π(a|s), y(s, a))``,
    the covariance over the actions *at that state* (Cui et al. 2025, arXiv 2505.22617, Sec. 3):
    centred at the state's own mean log-prob ``−H(s)``, not at the batch's (:func:`covariance_sums`)."""
    keep = mask.bool()
    term = (logprobs.double() + entropy.double()) * y.double()
    if importance is not None:
        term = term * importance.double()
    return torch.stack([keep.sum().double(), _masked_sum(term, keep)])


def state_centred_entropy_change(sums: Tensor) -> Tensor:
    """``−(1/n)·Σ_t Ĉov_t`` from :func:`state_centred_sums` (added over ranks); NaN when n = 0.

    The first-order change of the mean entropy over the batch's states when the logit of every
    action ``a`` at every state moves by ``η·y(s, a)`` (Cui et al.'s softmax lemma,
    ``ΔH(s) ≈ −η·Cov_{a∼π(·|s)}(log π(a|s), y(s, a))``; with ``y = w·A`` their natural-policy-gradient
    step with the loss's weight), in units of η. Unlike :func:`entropy_change` (the batch-pooled
    covariance) it has no between-state term: pooling adds
    ``Cov_s(E[log π | s], E[y | s]) = −Cov_s(H(s), E[y | s])``, which is set by which states the
    weight falls on (low-entropy "forced" states near log π ≈ 0, free ones far below), not by how
    the weight moves the distribution at any state."""
    n, total = sums.double().unbind()
    return -share(total, n)


def first_order_entropy_change(logits: Tensor, logit_step: Tensor) -> Tensor:
    """``−Σ_s Cov_{a∼softmax(z_s)}(log π(a|s), Δz(s, a))`` for full logits ``z`` ``[..., V]`` and a
    logit change ``Δz`` of the same shape: the exact first-order change of ``Σ_s H(softmax(z_s))``
    (the softmax identity ``dH = −Cov_π(log π, dz)``), float64. What the estimators above estimate,
    where every action's logit is known (a tabular policy)."""
    logp = torch.log_softmax(logits.double(), -1)
    p, step = logp.exp(), logit_step.double()
    cov = (p * logp * step).sum(-1) - (p * logp).sum(-1) * (p * step).sum(-1)
    return -cov.sum()


def decile_means(key: Tensor, values: Tensor, deciles: int = 10) -> tuple[Tensor, Tensor]:
    """Means per population decile of ``key`` ``[n]``: the tokens sorted by ``key`` (stable) and cut
    into ``deciles`` groups of equal count (sizes differ by at most 1; equal keys may straddle a
    cut), the i-th sorted token in group ``⌊i·deciles/n⌋``.

    Returns ``(mean key [deciles], mean of each column of values [deciles, k])``, float64, lowest
    key first; NaN for an empty group (fewer than ``deciles`` tokens)."""
    if key.dim() != 1 or values.dim() != 2 or values.shape[0] != key.shape[0]:
        raise ValueError(f"decile_means takes key [n] and values [n, k], got {tuple(key.shape)} and {tuple(values.shape)}")
    n = key.shape[0]
    order = torch.argsort(key, stable=True)
    group = torch.div(torch.arange(n, device=key.device) * deciles, n, rounding_mode="floor")
    count = torch.zeros(deciles, dtype=torch.float64, device=key.device).index_add_(
        0, group, torch.ones(n, dtype=torch.float64, device=key.device))
    key_sum = torch.zeros(deciles, dtype=torch.float64, device=key.device).index_add_(0, group, key[order].double())
    value_sum = torch.zeros(deciles, values.shape[1], dtype=torch.float64, device=key.device).index_add_(
        0, group, values[order].double())
    return share(key_sum, count), share(value_sum, count[:, None])


def average_ranks(x: Tensor) -> Tensor:
    """1-based ranks of ``x`` ``[n]`` (float64); tied values share the mean of their ranks."""
    order = torch.argsort(x, stable=True)
    _, group, counts = torch.unique_consecutive(x[order], return_inverse=True, return_counts=True)
    last = counts.cumsum(0).double()               # the highest rank in each group of ties
    mean_rank = last - (counts.double() - 1) / 2
    ranks = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    ranks[order] = mean_rank[group]
    return ranks


def spearman(x: Tensor, y: Tensor) -> Tensor:
    """Spearman's rank correlation of ``x`` and ``y`` ``[n]``: Pearson's correlation of their
    average ranks (so ties are handled as scipy's ``spearmanr`` does). NaN when n < 2 or either is
    constant."""
    if x.shape != y.shape or x.dim() != 1:
        raise ValueError(f"spearman takes two [n] tensors, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[0] < 2:
        return torch.tensor(torch.nan, dtype=torch.float64, device=x.device)
    rx, ry = average_ranks(x), average_ranks(y)
    dx, dy = rx - rx.mean(), ry - ry.mean()
    return share((dx * dy).sum(), torch.sqrt((dx * dx).sum() * (dy * dy).sum()))


def quantiles(x: Tensor, qs: Sequence[float]) -> Tensor:
    """Quantiles of ``x`` ``[n]`` at ``qs`` (float64), interpolated linearly between order
    statistics as numpy's default does; by a sort, since ``torch.quantile`` refuses more than 16M
    elements. NaN when ``x`` is empty."""
    q = torch.as_tensor(qs, dtype=torch.float64, device=x.device)
    if ((q < 0) | (q > 1)).any():
        raise ValueError(f"quantiles must be in [0, 1], got {list(qs)}")
    if x.numel() == 0:
        return torch.full_like(q, torch.nan)
    ordered = torch.sort(x.double().reshape(-1)).values
    position = q * (ordered.shape[0] - 1)
    low = position.floor().long()
    high = position.ceil().long()
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
