"""What ASPO's flip changes, measured on every rollout batch's own tokens: every shipped loss's
effective token weight (Prop. 4.1) on the same tokens, from the step's `StepOutput` (``log π_old``,
``log π_θ`` at the token's last update, π_old's entropy, the advantage), with no forward pass
(docs/metrics.md, "What the flip changes"). The maths: `aspo_lit.maths.counterfactual`.

Logged per rollout batch, under ``flip/`` (``w_L``: loss L's weight, ``A > 0 tokens``: response
tokens of responses with a positive group advantage; ASPO's flip acts on these only, eq. 3):

* how much the flip changes the update: ``flip/weight_change`` = Σ|w_grpo − w_aspo| / Σ w_grpo over
  the A > 0 tokens; ``flip/weight_change_forced`` and ``flip/weight_change_free``, the same over the
  forced and the free ones; ``flip/forced_weight_share`` = the forced tokens' part of Σ w_grpo (so
  weight_change = share·forced + (1 − share)·free);
* where the weight goes: ``flip/pi_old_decile01..10`` (mean π_old), ``flip/w_grpo_decile01..10``,
  ``flip/w_aspo_decile01..10`` (mean weight) over the population deciles of π_old among the A > 0
  tokens (decile01 the least likely); ``flip/spearman_pi_old_ratio``: Spearman's correlation of
  π_old and r over the *active* A > 0 tokens (not clipped by GRPO, r ≤ 1 + ε_high): positive when
  the ratio, hence GRPO's weight, rises on the already-likely tokens of the batch;
* the first-order entropy change with each loss's weights (Cui et al. 2025, arXiv 2505.22617,
  Sec. 3, with the loss's weight inside the logit change, ``y = w·A``; units of the step size), by
  two estimators (`aspo_lit.maths.counterfactual`; docs/metrics.md, "Two first-order estimators"):

  - ``flip/entropy_change_state/<loss>``: the state-centred one, −(1/n)·Σ_t r_t·(log π_θ(y_t) +
    H_θ(s_t))·y_t, the covariance of log π and y over the actions *at each state* under π_θ (at the
    token's last update; r = π_θ/π_old reweighs the tokens π_old sampled), summed over the batch's
    states; ``flip/entropy_change_state_old/<loss>`` the same under π_old (r ≡ 1, π_old's entropy);
  - ``flip/entropy_change_pooled/<loss>``: −Cov(log π_old, y) pooled over all response tokens of
    the batch (``grpo_no_is`` at r ≡ 1 is ``entropy/predicted_change``). Pooling adds a between-state
    term, −Cov_s(H(s), E[y | s]): where the weight falls (free tokens sit far below log π = 0,
    forced ones near it) sets its sign, whatever the weight does at any one state;

  and each one's gap, grpo's − aspo's: ``flip/entropy_change_{state,state_old,pooled}_gap``;
* the ratio's spread: ``flip/abs_log_ratio_{pos,neg}_{p50,p90,p99,max}``, quantiles of |log r| over
  the A > 0 / A < 0 tokens (r the token ratio, clamped as the losses clamp it); and the entropy split:
  ``flip/forced_token_share`` (share of response tokens that are forced), ``flip/entropy_forced`` and
  ``flip/entropy_free`` (Σ H over the forced / free tokens, / all response tokens: the two parts of
  ``train/entropy``).

Forced and free tokens: a token is *forced* when π_old's entropy there is below ``forced_entropy``,
log(1 + ε_high) = log 1.2 ≈ 0.182 nats by default (ε_high = 0.2, the paper's). Why there: the
Shannon entropy bounds the min-entropy, ``H ≥ −log max_y π_old(y)``, so below it the most likely
token holds π_old > 1/1.2 ≈ 0.83 of the mass, and when it is the one sampled (5 times in 6 or more)
its ratio r = π_θ/π_old < 1/π_old < 1 + ε_high: no update can lift it to GRPO's clip, and its
weight r (GRPO) and 1/r (ASPO) both stay within [1/1.2, 1.2] unless π_θ falls. The ratio, and with
it the flip, can move far only on the free tokens.

Across ranks: the sums (weight changes, covariances, entropy parts) add up exactly over ranks
(`global_sum`). The deciles, the rank correlation and the quantiles are statistics of the whole
batch's token population that no sum gives: every rank's A ≠ 0 tokens are gathered (`global_cat`:
5 fp32 numbers a token, one gather) and each rank computes them on all of them, so every logged
value is the one a single process would log on the same batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from aspo_lit.callbacks.base import Diagnostic, global_cat, global_sum
from aspo_lit.maths.counterfactual import (
    FORCED_ENTROPY,
    covariance_sums,
    decile_means,
    entropy_change,
    entropy_split_sums,
    flip_change_sums,
    quantiles,
    share,
    shipped_losses,
    spearman,
    state_centred_entropy_change,
    state_centred_sums,
    token_weights,
)
from aspo_lit.maths.losses import PolicyLoss

DECILES = 10
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "max": 1.0}


class CounterfactualWeights(Diagnostic):
    """Every shipped loss's token weight on the step's tokens, and what ASPO's flip changes
    (module docstring). The losses are built with the run's loss arguments (ε, c, the ratio clamp).

    Args:
        forced_entropy: π_old entropy (nats) below which a token counts as forced.
        split_first_minibatch: also log every ``flip/<name>`` over the responses of the rollout
            batch's first optimizer step alone, as ``flip/first_minibatch/<name>``, and over the
            others, as ``flip/later_minibatches/<name>`` (`StepOutput.first_minibatch`). With one
            PPO epoch the first mini-batch's forward runs before any step, so only numerics move
            its r: the floor the later mini-batches' values are read against.
    """

    def __init__(self, forced_entropy: float = FORCED_ENTROPY, split_first_minibatch: bool = False,
                 prog_bar: tuple[str, ...] = ()) -> None:
        super().__init__(prog_bar)
        if not forced_entropy > 0:
            raise ValueError(f"forced_entropy must be > 0 nats, got {forced_entropy}")
        self.forced_entropy = float(forced_entropy)
        self.split_first_minibatch = bool(split_first_minibatch)

    def compute(self, trainer, pl_module, step) -> dict[str, Any]:
        out = self.flip_metrics(trainer, pl_module, step)
        if self.split_first_minibatch:
            if step.first_minibatch is None:
                raise ValueError("CounterfactualWeights(split_first_minibatch=True) needs StepOutput.first_minibatch, "
                                 "which this step does not carry")
            first = step.first_minibatch.to(step.response_mask.device)[:, None]
            for name, rows in (("first_minibatch", first), ("later_minibatches", ~first)):
                part = dataclasses.replace(step, response_mask=step.response_mask * rows, stats={})
                out.update({key.replace("flip/", f"flip/{name}/", 1): value
                            for key, value in self.flip_metrics(trainer, pl_module, part).items()})
        return out

    def flip_metrics(self, trainer, pl_module, step) -> dict[str, Any]:
        """Every ``flip/*`` value over the response tokens of ``step.response_mask``."""
        run_loss = getattr(pl_module, "loss_fn", None)
        losses = shipped_losses(run_loss.hparams() if isinstance(run_loss, PolicyLoss) else None)
        mask = step.response_mask > 0
        advantages = step.advantages.float().reshape(-1, 1).expand_as(mask)
        weights = token_weights(losses, step.logprobs, step.old_logprobs, step.advantages, step.response_mask,
                                step.entropy)
        forced = mask & (step.entropy < self.forced_entropy)
        log_ratio = losses["grpo"].log_ratio(step.logprobs.float(), step.old_logprobs.float())
        importance = log_ratio.double().exp()
        change_sums = [torch.cat([covariance_sums(step.old_logprobs, w * advantages, mask),
                                  state_centred_sums(step.logprobs, step.updated_entropy, w * advantages, mask, importance),
                                  state_centred_sums(step.old_logprobs, step.entropy, w * advantages, mask)])
                       for w in weights.values()]
        local = torch.cat([flip_change_sums(weights["grpo"], weights["aspo"], mask & (advantages > 0), forced),
                           entropy_split_sums(step.entropy, mask, forced), *change_sums])
        total = global_sum(local, trainer=trainer)
        columns = torch.stack([step.old_logprobs, log_ratio, weights["grpo"], weights["aspo"], advantages.sign()], -1)
        tokens = global_cat(columns[mask & (advantages != 0)], trainer=trainer).double()
        return {**weight_change_metrics(total[:6]), **entropy_split_metrics(total[6:10]),
                **entropy_change_metrics(total[10:].reshape(-1, 8), list(weights)), **token_metrics(tokens)}


def weight_change_metrics(sums) -> dict[str, Any]:
    change, grpo, change_forced, grpo_forced, change_free, grpo_free = sums.unbind()
    return {"flip/weight_change": share(change, grpo), "flip/weight_change_forced": share(change_forced, grpo_forced),
            "flip/weight_change_free": share(change_free, grpo_free), "flip/forced_weight_share": share(grpo_forced, grpo)}


def entropy_split_metrics(sums) -> dict[str, Any]:
    n, n_forced, entropy_forced, entropy_free = sums.unbind()
    return {"flip/forced_token_share": share(n_forced, n), "flip/entropy_forced": share(entropy_forced, n),
            "flip/entropy_free": share(entropy_free, n)}


def entropy_change_metrics(sums, names: list[str]) -> dict[str, Any]:
    """Per loss, rows of ``[pooled covariance sums (4), state-centred sums under π_θ (2), under π_old (2)]``."""
    estimates = {"pooled": [entropy_change(part[:4]) for part in sums],
                 "state": [state_centred_entropy_change(part[4:6]) for part in sums],
                 "state_old": [state_centred_entropy_change(part[6:8]) for part in sums]}
    out = {}
    for estimator, values in estimates.items():
        change = dict(zip(names, values))
        out.update({f"flip/entropy_change_{estimator}/{name}": value for name, value in change.items()})
        out[f"flip/entropy_change_{estimator}_gap"] = change["grpo"] - change["aspo"]
    return out


def token_metrics(tokens) -> dict[str, Any]:
    """The statistics of the gathered A ≠ 0 tokens: rows ``(log π_old, log r, w_grpo, w_aspo, sign A)``."""
    old_logprobs, log_ratio, w_grpo, w_aspo, sign = tokens.unbind(-1)
    positive = sign > 0
    pi_old, weights = decile_means(old_logprobs[positive].exp(), torch.stack([w_grpo, w_aspo], -1)[positive], DECILES)
    out = {}
    for k in range(DECILES):
        out[f"flip/pi_old_decile{k + 1:02d}"] = pi_old[k]
        out[f"flip/w_grpo_decile{k + 1:02d}"] = weights[k, 0]
        out[f"flip/w_aspo_decile{k + 1:02d}"] = weights[k, 1]
    active = positive & (w_grpo > 0)
    out["flip/spearman_pi_old_ratio"] = spearman(old_logprobs[active], log_ratio[active])
    for name, part in (("pos", positive), ("neg", sign < 0)):
        values = quantiles(log_ratio[part].abs(), list(QUANTILES.values()))
        out.update({f"flip/abs_log_ratio_{name}_{q}": v for q, v in zip(QUANTILES, values)})
    return out
