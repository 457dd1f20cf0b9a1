"""The bookkeeping of one rollout batch's PPO update: which rows each optimizer step takes, what
the update starts from and what it leaves.

`ASPOModule.training_step` (docs/design.md, "One update under FSDP2") runs ``ppo_epochs`` passes
over the rollout batch, each split into mini-batches of ``mini_batch_size`` prompts over all ranks
(the paper's 64-prompt batch in 16-prompt mini-batches: 4 optimizer steps per rollout batch), as
verl's actor does (``ppo_mini_batch_size``, ``ppo_epochs``; ``shuffle`` for standard PPO):

* the row plan: `rows_per_minibatch` (this rank's responses per optimizer step),
  `minibatch_rows` (one epoch's mini-batches), `epoch_minibatches` (every epoch's);
* `PreUpdate`: eq. 1's π_old log-probs and entropy and the KL reference's log-probs, with the rows
  whose old log-probs / entropy are left to the first update forward that computes them (before
  the first optimizer step π_θ = π_old, so that forward gives the same numbers: one pass fewer);
* `UpdateRecord`: each token's log-prob, ratio, entropy and effective weight (Prop. 4.1) at its
  last update, and the pieces of the step's statistics (docs/design.md, "Step diagnostics"), made
  in the last epoch only (`UpdateRecord.made_at`), where it stays;
* `EncodedPrompts`: prompts encoded once for a set of rows (``model.share_prompt``;
  `aspo_lit.training.forward`, "Shared prompts").

Pure torch: no model runs here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from aspo_lit.maths.sampler_mismatch import mismatch_stats
from aspo_lit.maths.stats import Stat, StatAccumulator

if TYPE_CHECKING:
    from aspo_lit.rollout.batch import RolloutBatch
    from aspo_lit.training.forward import PromptStates


def rows_per_minibatch(mini_batch_size: int, group_size: int, world_size: int) -> int:
    """Responses per rank per optimizer step: `mini_batch_size` prompts x G responses over all ranks.

    Counted in responses, as verl does (`ppo_mini_batch_size * n // world_size`), so a mini-batch of
    16 prompts works on 32 GPUs (8 responses each) without changing its size.
    """
    rows = mini_batch_size * group_size
    if rows % world_size:
        raise ValueError(f"model.mini_batch_size={mini_batch_size} prompts x data.group_size={group_size} = {rows} "
                         f"responses cannot be split evenly over {world_size} processes")
    return rows // world_size


def minibatch_rows(num_rows: int, rows_per_minibatch: int, generator: torch.Generator | None = None) -> list[Tensor]:
    """This rank's response rows split into mini-batches of `rows_per_minibatch` consecutive rows.

    As verl's actor (and the authors' code built on it): the rollout batch's prompts are already in
    random order, and each optimizer step takes the next slice. With contiguous slices, rank r's
    j-th slice is exactly its share of the global j-th slice, so the optimizer steps do not depend
    on the number of processes. A `generator` shuffles the rows first (standard PPO; then the
    steps do depend on the world size).
    """
    order = torch.randperm(num_rows, generator=generator) if generator is not None else torch.arange(num_rows)
    return [order[i : i + rows_per_minibatch] for i in range(0, num_rows, rows_per_minibatch)]


def epoch_minibatches(num_rows: int, rows_per_minibatch: int, ppo_epochs: int,
                      generator: torch.Generator | None = None) -> list[Tensor]:
    """The rows of every optimizer step of a rollout batch, epoch after epoch: `minibatch_rows`
    once per epoch (a `generator` draws each epoch's shuffle in turn)."""
    return [rows for _ in range(ppo_epochs) for rows in minibatch_rows(num_rows, rows_per_minibatch, generator)]


@dataclass
class EncodedPrompts:
    """Prompts encoded once for a set of rows (`share_prompt`): their `PromptStates` and each row's
    entry in them (``slot[row]``, -1 for rows not encoded)."""

    states: PromptStates
    slot: Tensor  # [N] long


@dataclass
class PreUpdate:
    """What the update starts from: π_old's log-probs and entropy, the reference log-probs, and
    which rows' old log-probs (``pending_old``) or entropy (``pending_entropy``) are left to the
    first update forward that computes them (`ASPOModule._pre_update_pass`). With the sampler's
    old log-probs, ``trainer_logprobs`` keeps the trainer's own on the ``trainer_rows`` (the first
    mini-batch's, where π_θ = π_old), for ``rollout/*``."""

    old_logprobs: Tensor
    entropy: Tensor
    ref_logprobs: Tensor | None
    pending_old: Tensor  # [N] bool
    pending_entropy: Tensor  # [N] bool
    trainer_rows: Tensor  # [N] bool
    trainer_logprobs: Tensor | None = None

    @classmethod
    def empty(cls, shape: tuple[int, int], device, with_ref: bool) -> "PreUpdate":
        zeros = lambda: torch.zeros(shape, dtype=torch.float32, device=device)  # noqa: E731
        flags = lambda: torch.zeros(shape[0], dtype=torch.bool, device=device)  # noqa: E731
        return cls(zeros(), zeros(), zeros() if with_ref else None, flags(), flags(), flags())

    def leave_to_first_update(self, rows: Tensor) -> None:
        """Leave the old log-probs and entropy of ``rows`` (the first mini-batch's) to their first
        update forward. Exact: π_θ = π_old before the first optimizer step, and the pre-update pass
        computes rows in the micro-batches that forward uses, so it would give the same numbers."""
        self.pending_old[rows] = True
        self.pending_entropy[rows] = True

    def fill_from_update(self, rows: Tensor, logprobs: Tensor, entropy: Tensor, record: "UpdateRecord") -> None:
        """Take the pending old log-probs / entropy of ``rows`` from this update forward (their first
        visit, before the optimizer step that follows it)."""
        if bool(self.pending_old[rows].any()):
            self.old_logprobs[rows] = logprobs
            record.logprobs[rows] = logprobs
            self.pending_old[rows] = False
        if bool(self.pending_entropy[rows].any()):
            self.entropy[rows] = entropy
            record.entropy[rows] = entropy
            self.pending_entropy[rows] = False
            if self.trainer_logprobs is not None and bool(self.trainer_rows[rows].all()):
                self.trainer_logprobs[rows] = logprobs

    def mismatch_stats(self, batch: RolloutBatch, mask: Tensor) -> dict[str, Stat]:
        """``rollout/*``: the sampler's log-probs against the trainer's π_old, on every response
        token, or (old log-probs from the sampler) on the first mini-batch's only."""
        if self.trainer_logprobs is None:
            return mismatch_stats(self.old_logprobs, batch.rollout_logprobs, mask, batch.top_p)
        return mismatch_stats(self.trainer_logprobs, batch.rollout_logprobs, mask * self.trainer_rows[:, None],
                              batch.top_p)


@dataclass
class UpdateRecord:
    """What the update leaves: each token's log-prob, ratio, entropy and effective weight at its
    last update (`StepOutput`), and the pieces of the step's statistics."""

    logprobs: Tensor
    ratio: Tensor
    entropy: Tensor
    token_weight: Tensor
    stats: StatAccumulator
    skipped_steps: int = 0

    @classmethod
    def before_update(cls, old_logprobs: Tensor, entropy: Tensor, stat_reductions: dict[str, str]) -> "UpdateRecord":
        """A token no update reached (a skipped micro-batch) keeps π_old: ratio 1, weight 0."""
        return cls(old_logprobs.detach().clone(), torch.ones_like(old_logprobs), entropy.detach().clone(),
                   torch.zeros_like(old_logprobs), StatAccumulator(stat_reductions))

    @staticmethod
    def made_at(step: int, steps_per_epoch: int, ppo_epochs: int) -> bool:
        """Whether optimizer step ``step`` (counted over all epochs) records its tokens: in the last
        epoch only, whose values stay (exact: the loss never reads the record, and a token's last
        update is in the last epoch)."""
        return step >= (ppo_epochs - 1) * steps_per_epoch

    def at_last_update(self, rows: Tensor, logprobs: Tensor, entropy: Tensor, ratio: Tensor,
                       token_weight: Tensor) -> None:
        self.logprobs[rows] = logprobs
        self.entropy[rows] = entropy
        self.ratio[rows] = ratio
        self.token_weight[rows] = token_weight
