"""The update's bookkeeping (aspo_lit/maths/update_plan.py): the row plan of the optimizer steps, what the
update starts from (`PreUpdate`) and what it leaves (`UpdateRecord`). Small CPU tensors; every
value is exact (indices, copies, dyadic log-probs), so every comparison is equality."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from aspo_lit.maths.update_plan import (
    PreUpdate,
    UpdateRecord,
    epoch_minibatches,
    minibatch_rows,
    rows_per_minibatch,
)


def _lists(minibatches: list[torch.Tensor]) -> list[list[int]]:
    return [rows.tolist() for rows in minibatches]


# --- the row plan --------------------------------------------------------------------------------


@pytest.mark.parametrize("mini_batch_size, group_size, world, rows", [
    (16, 8, 1, 128),   # the paper's 16-prompt mini-batch, one process
    (16, 8, 4, 32),
    (16, 16, 32, 8),   # Qwen3-30B-A3B's 32 GPUs: 8 responses per rank per step
])
def test_rows_per_minibatch_counts_responses_per_rank(mini_batch_size, group_size, world, rows):
    assert rows_per_minibatch(mini_batch_size, group_size, world) == rows


def test_rows_per_minibatch_refuses_an_uneven_split():
    with pytest.raises(ValueError, match=r"mini_batch_size=1 prompts x data.group_size=16 = 16 .* 32 processes"):
        rows_per_minibatch(1, 16, 32)


def test_minibatch_rows_are_consecutive_slices():
    """No generator: the j-th optimizer step takes rows [j·R, (j+1)·R), the last one what is left."""
    assert _lists(minibatch_rows(10, 4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert _lists(minibatch_rows(8, 8)) == [list(range(8))]


def test_shuffled_minibatch_rows_partition_the_rows_deterministically():
    """A generator: slices of one `randperm` of the rows, the same for the same seed."""
    plan = minibatch_rows(12, 4, torch.Generator().manual_seed(0))
    assert [rows.shape for rows in plan] == [torch.Size([4])] * 3 and all(r.dtype == torch.long for r in plan)
    assert sorted(torch.cat(plan).tolist()) == list(range(12))  # every row once
    assert torch.cat(plan).tolist() != list(range(12))          # shuffled
    assert torch.equal(torch.cat(plan), torch.randperm(12, generator=torch.Generator().manual_seed(0)))
    assert _lists(minibatch_rows(12, 4, torch.Generator().manual_seed(0))) == _lists(plan)
    assert _lists(minibatch_rows(12, 4, torch.Generator().manual_seed(1))) != _lists(plan)


def test_epoch_minibatches_shuffle_each_epoch_anew():
    """`ppo_epochs` passes, each a partition of the rows; a generator draws each epoch's shuffle in
    turn (epoch e is its e-th `randperm`), none repeats the same order without one."""
    assert _lists(epoch_minibatches(8, 4, 3)) == [[0, 1, 2, 3], [4, 5, 6, 7]] * 3
    plan = epoch_minibatches(8, 4, 3, torch.Generator().manual_seed(0))
    assert len(plan) == 6 and all(rows.shape == (4,) for rows in plan)
    draws = torch.Generator().manual_seed(0)
    epochs = [torch.cat(plan[2 * e: 2 * e + 2]) for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(8))
        assert torch.equal(epoch, torch.randperm(8, generator=draws))
    assert epochs[0].tolist() != epochs[1].tolist()


def test_the_record_is_made_in_the_last_epoch_only():
    assert [UpdateRecord.made_at(i, 4, 3) for i in range(12)] == [False] * 8 + [True] * 4
    assert [UpdateRecord.made_at(i, 4, 1) for i in range(4)] == [True] * 4


# --- PreUpdate -----------------------------------------------------------------------------------


@pytest.mark.parametrize("with_ref", [True, False])
def test_pre_update_starts_empty(with_ref):
    pre = PreUpdate.empty((3, 5), torch.device("cpu"), with_ref=with_ref)
    tensors = [pre.old_logprobs, pre.entropy] + ([pre.ref_logprobs] if with_ref else [])
    for x in tensors:
        assert x.shape == (3, 5) and x.dtype == torch.float32 and not x.any()
    assert len({x.data_ptr() for x in tensors}) == len(tensors)  # each its own buffer
    assert (pre.ref_logprobs is None) == (not with_ref)
    for flags in (pre.pending_old, pre.pending_entropy, pre.trainer_rows):
        assert flags.shape == (3,) and flags.dtype == torch.bool and not flags.any()
    assert pre.trainer_logprobs is None


def test_leave_to_first_update_marks_those_rows_only():
    pre = PreUpdate.empty((4, 2), "cpu", with_ref=False)
    pre.leave_to_first_update(torch.tensor([1, 2]))
    assert pre.pending_old.tolist() == [False, True, True, False]
    assert pre.pending_entropy.tolist() == [False, True, True, False]
    assert not pre.trainer_rows.any()


def test_fill_from_update_takes_pending_rows_at_their_first_visit():
    """The first mini-batch's old log-probs and entropy come from its first update forward, into
    π_old and the record; a later visit, or a row the pass computed, keeps its values."""
    pre = PreUpdate.empty((4, 3), "cpu", with_ref=False)
    pre.old_logprobs[2:] = -2.0  # computed by the pre-update pass
    pre.entropy[2:] = 3.0
    pre.leave_to_first_update(torch.tensor([0, 1]))
    record = UpdateRecord.before_update(pre.old_logprobs, pre.entropy, {})
    first = torch.tensor([0, 1])
    logprobs, entropy = -torch.arange(1.0, 7.0).reshape(2, 3), torch.arange(1.0, 7.0).reshape(2, 3) / 4
    pre.fill_from_update(first, logprobs, entropy, record)
    for x, y in ((pre.old_logprobs, logprobs), (record.logprobs, logprobs), (pre.entropy, entropy),
                 (record.entropy, entropy)):
        assert torch.equal(x[:2], y)
    assert not pre.pending_old.any() and not pre.pending_entropy.any()
    pre.fill_from_update(first, logprobs - 1, entropy + 1, record)  # a later epoch's visit
    pre.fill_from_update(torch.tensor([2, 3]), logprobs - 1, entropy + 1, record)  # computed rows
    assert torch.equal(pre.old_logprobs[:2], logprobs) and torch.equal(pre.entropy[:2], entropy)
    assert torch.equal(pre.old_logprobs[2:], torch.full((2, 3), -2.0))
    assert torch.equal(pre.entropy[2:], torch.full((2, 3), 3.0))
    assert pre.trainer_logprobs is None


def test_fill_from_update_keeps_the_trainers_logprobs_on_the_trainer_rows():
    """Old log-probs from the sampler: every row's entropy is left to the update, and the trainer's
    own log-probs are kept on the first mini-batch's rows (for `rollout/*`), the sampler's π_old stays."""
    pre = PreUpdate.empty((4, 2), "cpu", with_ref=False)
    sampler = torch.full((4, 2), -0.5)
    pre.old_logprobs.copy_(sampler)
    pre.pending_entropy[:] = True
    pre.trainer_rows[:2] = True
    pre.trainer_logprobs = torch.zeros(4, 2)
    record = UpdateRecord.before_update(pre.old_logprobs, pre.entropy, {})
    for rows, value in ((torch.tensor([0, 1]), -1.0), (torch.tensor([2, 3]), -3.0)):
        pre.fill_from_update(rows, torch.full((2, 2), value), torch.full((2, 2), -value), record)
    assert torch.equal(pre.old_logprobs, sampler) and torch.equal(record.logprobs, sampler)
    assert pre.entropy[:, 0].tolist() == [1.0, 1.0, 3.0, 3.0] and torch.equal(record.entropy, pre.entropy)
    assert pre.trainer_logprobs[:, 0].tolist() == [-1.0, -1.0, 0.0, 0.0]
    assert not pre.pending_entropy.any()


def _exact(stats) -> dict[str, tuple[float, float, str]]:
    return {name: (float(s.value), float(s.weight), s.reduce) for name, s in stats.items()}


def test_mismatch_stats_compare_the_sampler_with_pi_old_on_every_response_token():
    pre = PreUpdate.empty((2, 3), "cpu", with_ref=False)
    rollout = torch.tensor([[-0.5, -0.25, -8.0], [-8.0, -0.75, 0.0]])  # the -8.0 are padding
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    stats = _exact(pre.mismatch_stats(SimpleNamespace(rollout_logprobs=rollout, top_p=1.0), mask))
    assert stats["rollout/logprob_diff_max"] == (0.75, 1.0, "max")
    assert stats["rollout/logprob_diff_mean"] == (0.375, 4.0, "mean")  # (0.5 + 0.25 + 0.75 + 0) / 4
    assert "rollout/kept_mass" not in stats
    nucleus = pre.mismatch_stats(SimpleNamespace(rollout_logprobs=rollout, top_p=0.9), mask)
    assert "rollout/kept_mass" in nucleus  # the batch's top_p reaches the statistics


def test_mismatch_stats_with_the_samplers_old_logprobs_use_the_trainer_rows_only():
    """π_old is the sampler's: the trainer's log-probs exist on the first mini-batch's rows only."""
    pre = PreUpdate.empty((2, 3), "cpu", with_ref=False)
    rollout = torch.zeros(2, 3)
    pre.old_logprobs.copy_(rollout)  # the sampler's: no gap to measure there
    pre.trainer_rows[0] = True
    pre.trainer_logprobs = torch.tensor([[0.5, 0.25, 9.0], [4.0, 4.0, 4.0]])  # row 1: not the trainer's
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    stats = _exact(pre.mismatch_stats(SimpleNamespace(rollout_logprobs=rollout, top_p=1.0), mask))
    assert stats["rollout/logprob_diff_max"] == (0.5, 1.0, "max")
    assert stats["rollout/logprob_diff_mean"] == (0.375, 2.0, "mean")


# --- UpdateRecord --------------------------------------------------------------------------------


def test_before_update_every_token_keeps_pi_old():
    """A token no update reaches keeps π_old's log-prob and entropy, ratio 1 and weight 0, in
    tensors of its own (detached copies: writing the record leaves π_old alone)."""
    old = torch.tensor([[-0.5, -1.0], [-2.0, -0.25]], requires_grad=True)
    entropy = torch.tensor([[1.5, 0.5], [0.25, 2.0]])
    reductions = {"train/pg_loss": "mean", "train/grad_norm": "mean"}
    record = UpdateRecord.before_update(old, entropy, reductions)
    assert torch.equal(record.logprobs, old.detach()) and not record.logprobs.requires_grad
    assert torch.equal(record.entropy, entropy)
    assert torch.equal(record.ratio, torch.ones(2, 2)) and torch.equal(record.token_weight, torch.zeros(2, 2))
    assert record.stats.expected == reductions and record.skipped_steps == 0
    record.logprobs[0] = 7.0
    record.entropy[0] = 7.0
    assert old[0].tolist() == [-0.5, -1.0] and entropy[0].tolist() == [1.5, 0.5]


def test_at_last_update_overwrites_its_rows_only():
    record = UpdateRecord.before_update(torch.zeros(3, 2), torch.zeros(3, 2), {})
    rows = torch.tensor([1])
    record.at_last_update(rows, torch.full((1, 2), -1.0), torch.full((1, 2), 2.0), torch.full((1, 2), 0.5),
                          torch.full((1, 2), 0.25))
    for x, value, before in ((record.logprobs, -1.0, 0.0), (record.entropy, 2.0, 0.0), (record.ratio, 0.5, 1.0),
                             (record.token_weight, 0.25, 0.0)):
        assert x[:, 0].tolist() == [before, value, before] and x[:, 1].tolist() == [before, value, before]
