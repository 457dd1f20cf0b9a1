"""`StepOutput`: what one training step hands to the callbacks (docs/design.md, "Step diagnostics").

`ASPOModule.training_step` consumes one rollout batch and returns one `StepOutput`; every
diagnostic callback reads it in ``on_train_batch_end`` instead of running a forward pass of its
own. The fields are this rank's rows of the rollout batch; their names and shapes are the same on
every rank by construction (the class fixes them; the module declares every statistic's name before
the step runs), which is what lets the callbacks reduce them across ranks with collectives.

It is a `Mapping` of its fields as well, because Lightning's manual optimisation requires
``training_step`` to return one (``outputs["rewards"]`` works too).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from aspo_lit.maths.stats import Stat

__all__ = ["StepOutput", "updates_per_rollout"]


def updates_per_rollout(num_prompts: int, mini_batch_size: int, ppo_epochs: int) -> int:
    """Optimizer steps one rollout batch of ``num_prompts`` prompts gives: ``ppo_epochs`` passes of
    ``mini_batch_size``-prompt mini-batches. 1 means every update is on-policy (r ≡ 1)."""
    return ppo_epochs * math.ceil(num_prompts / mini_batch_size)


@dataclass(eq=False)
class StepOutput(Mapping):
    """One rollout batch's update, seen from this rank. ``N`` responses, ``T`` response columns.

    Per token ``[N, T]``, fp32, detached (0 on padding unless said otherwise):
        response_mask: 1.0 on response tokens (EOS included when sampled), 0.0 on padding.
        old_logprobs: ``log π_old`` of the sampled tokens: the training policy before this rollout
            batch's first update (eq. 1's π_old), from the pre-update pass.
        entropy: token entropy of π_old (nats), from the same pre-update pass.
        logprobs: ``log π_θ`` at the token's last update: the forward of the last mini-batch that
            held the token, in the last PPO epoch, i.e. *before* that mini-batch's optimizer step.
        ratio: the importance ratio the loss used at that forward, exactly as the loss computes it
            (`PolicyLoss.ratio`: ``exp(clamp(logprobs - old_logprobs, ±clamp_log_ratio))``; GSPO's
            sequence ratio); 1 on padding.
        updated_entropy: token entropy at the token's last update (the same forward as ``logprobs``).
        token_weight: the effective token weight ``w`` (Prop. 4.1, ``∂ℓ/∂lp = -w·A``) at that forward.
    Per response ``[N]``:
        advantages: the group advantage of eq. 1 (before any truncated-IS weight).
        rewards, response_lengths (tokens), truncated (bool: cut at the length limit).
    first_minibatch: ``[N]`` bool, the responses whose last update was the rollout batch's first
        optimizer step, whose forward ran before any step (r = 1 up to numerics): the first
        mini-batch when ``ppo_epochs`` = 1, no response otherwise. None where not known.
    texts: the decoded responses (``N`` strings).
    stats: every scalar of the step under the name it is logged as, each a `Stat` that carries its
        own weight and reduction: the loss's statistics (clip shares, ratio means, a user loss's
        own), ``train/pg_loss``, ``train/kl``, ``train/grad_norm``, ``train/skipped_steps``,
        ``train/updates_per_rollout``, the DataModule's ``batch/*``, ``timing/*`` and the
        sampler/trainer mismatch ``rollout/*``.
    """

    response_mask: Tensor
    old_logprobs: Tensor
    entropy: Tensor
    logprobs: Tensor
    ratio: Tensor
    updated_entropy: Tensor
    token_weight: Tensor
    advantages: Tensor
    rewards: Tensor
    response_lengths: Tensor
    truncated: Tensor
    texts: list[str]
    stats: dict[str, Stat] = field(default_factory=dict)
    first_minibatch: Tensor | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.response_mask.shape)
        if len(shape) != 2:
            raise ValueError(f"StepOutput.response_mask must be [N, T], got shape {shape}")
        for name in ("old_logprobs", "entropy", "logprobs", "ratio", "updated_entropy", "token_weight"):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"StepOutput.{name} has shape {tuple(getattr(self, name).shape)}; "
                                 f"response_mask has {shape}")
        for name in ("advantages", "rewards", "response_lengths", "truncated", "first_minibatch"):
            if getattr(self, name) is not None and tuple(getattr(self, name).shape) != shape[:1]:
                raise ValueError(f"StepOutput.{name} has shape {tuple(getattr(self, name).shape)}; "
                                 f"it must be [N] = [{shape[0]}]")
        if len(self.texts) != shape[0]:
            raise ValueError(f"StepOutput.texts has {len(self.texts)} strings for {shape[0]} responses")
        bad = [name for name, stat in self.stats.items() if not isinstance(stat, Stat)]
        if bad:
            raise ValueError(f"StepOutput.stats must hold Stat values (aspo_lit.maths.stats); not: {bad}")

    # -- the Mapping view Lightning asks for -------------------------------------------------------

    __eq__ = object.__eq__      # identity: tensors have no single truth value to compare by
    __hash__ = object.__hash__

    def __getitem__(self, key: str) -> Any:
        if key not in _FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_FIELDS)

    def __len__(self) -> int:
        return len(_FIELDS)

    def copy(self) -> "StepOutput":
        """A shallow copy (Lightning copies what ``training_step`` returns)."""
        return dataclasses.replace(self, stats=dict(self.stats))


_FIELDS = tuple(f.name for f in dataclasses.fields(StepOutput))
