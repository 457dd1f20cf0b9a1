"""The entropy mechanism of Cui et al. 2025 ("The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", arXiv 2505.22617), measured on every step (docs/metrics.md).

Their result (Sec. 3): for a softmax policy, a step changes the entropy at a state to first order
by minus the covariance, under the policy, between an action's log-probability and its logit
change; under natural policy gradient the logit change is ``η·A``, so

    H(π_{k+1}) − H(π_k) ≈ −η · Cov_{y∼π_k}(log π_k(y), A(y)):

confident tokens (high log π) with positive advantage, and rare tokens with negative advantage,
lower the entropy; the reverse raises it. Their Clip-Cov/KL-Cov code estimates the covariance over
a batch's response tokens as the mean of the centred products ``(A_t − Ā)(log π_t − mean log π)``;
this diagnostic does the same for the whole rollout batch, over all ranks, with π_k = π_old (the
policy that sampled the batch) and the group advantages of eq. 1. Logged per step:

* ``entropy/cov`` — ``(1/N) Σ_t (log π_old(y_t) − m)(A_t − Ā)`` over the N response tokens of the
  rollout batch (m, Ā: their token means);
* ``entropy/cov_pos``, ``entropy/cov_neg`` — the same sum over the tokens with A > 0 and A < 0 only
  (still divided by N and centred on the whole batch's means: the two parts of ``entropy/cov``;
  tokens with A = 0 make up the rest);
* ``entropy/predicted_change`` — ``−entropy/cov``: the entropy change the relation predicts, in units
  of the step size η (the relation fixes its sign and relative size; an Adam step's η is unknown);
* ``entropy/measured_change`` — the change the step's updates made, on the same tokens, without a
  forward pass of its own: the mean over response tokens of (entropy at the token's last update −
  entropy under π_old), both from the module's passes (`StepOutput.updated_entropy`,
  `StepOutput.entropy`). A token's last update is the forward of the last mini-batch that held it,
  before that mini-batch's optimizer step, so it measures the steps taken before it (0 for the
  first mini-batch of the first epoch, and everywhere when every update is on-policy).

All sums are reduced over ranks before dividing (one collective).
"""

from __future__ import annotations

from typing import Any

import torch

from aspo_lit.callbacks.base import Diagnostic, global_sum
from aspo_lit.maths.counterfactual import covariance_sums


class EntropyMechanism(Diagnostic):
    """Cov(log π_old, A) over the step's response tokens, split by advantage sign, the entropy
    change it predicts and the one measured on the same tokens (module docstring)."""

    def compute(self, trainer, pl_module, step) -> dict[str, Any]:
        mask = step.response_mask
        on = mask > 0
        advantages = step.advantages.reshape(-1, 1).expand_as(mask)
        change = torch.where(on, (step.updated_entropy - step.entropy).double(), 0.0).sum()
        local = torch.cat([covariance_sums(step.old_logprobs, advantages, on),   # [n, Σx, ΣA, Σx·A] each
                           covariance_sums(step.old_logprobs, advantages, on & (advantages > 0)),
                           covariance_sums(step.old_logprobs, advantages, on & (advantages < 0)),
                           change.reshape(1)])
        total = global_sum(local, trainer=trainer)
        (n, sx, sa, sxa), pos, neg, change = total[0:4], total[4:8], total[8:12], total[12]
        if n == 0:
            nan = torch.tensor(float("nan"))
            return dict.fromkeys(("entropy/cov", "entropy/cov_pos", "entropy/cov_neg", "entropy/predicted_change",
                                  "entropy/measured_change"), nan)
        mean_x, mean_a = sx / n, sa / n

        def centred(part) -> torch.Tensor:  # Σ over the part of (x − mean_x)(A − mean_a), / n
            n_s, sx_s, sa_s, sxa_s = part
            return (sxa_s - mean_a * sx_s - mean_x * sa_s + n_s * mean_x * mean_a) / n

        cov = centred((n, sx, sa, sxa))
        return {"entropy/cov": cov, "entropy/cov_pos": centred(pos), "entropy/cov_neg": centred(neg),
                "entropy/predicted_change": -cov, "entropy/measured_change": change / n}
