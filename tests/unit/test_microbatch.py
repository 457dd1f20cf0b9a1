"""Token-budget micro-batches, their padding fraction, and trimming a micro-batch to its own width."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aspo_lit.maths.microbatch import padding_fraction, token_budget_micro_batches, trim_to_micro_batch
from aspo_lit.rollout.base import Completion
from aspo_lit.rollout.batch import pack_rollouts


def _cost(lengths, rows, fixed_width):
    return rows.numel() * (fixed_width + int(lengths[rows].max()))


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=60), max_tokens=st.integers(1, 2000),
       fixed_width=st.integers(0, 50))
def test_partition_and_budget(lengths, max_tokens, fixed_width):
    lengths = torch.tensor(lengths)
    micro = token_budget_micro_batches(lengths, max_tokens, fixed_width=fixed_width)
    every = torch.cat(micro)
    assert every.dtype == torch.long
    assert sorted(every.tolist()) == list(range(len(lengths)))  # each row exactly once
    for rows in micro:
        assert rows.numel() >= 1
        assert rows.numel() == 1 or _cost(lengths, rows, fixed_width) <= max_tokens
    # greedy: the next micro-batch's first row would not have fitted into the previous one
    for prev, nxt in zip(micro, micro[1:]):
        assert (prev.numel() + 1) * (fixed_width + int(lengths[nxt[0]])) > max_tokens
    assert 0.0 <= padding_fraction(lengths, micro, fixed_width=fixed_width) < 1.0


def test_sorted_groups_and_determinism():
    lengths = torch.tensor([5, 1, 9, 1, 5, 3])
    micro = token_budget_micro_batches(lengths, max_tokens=12)
    # sorted (stable): rows 1, 3 (len 1), 5 (3), 0, 4 (5), 2 (9)
    assert [m.tolist() for m in micro] == [[1, 3, 5], [0, 4], [2]]
    again = token_budget_micro_batches(lengths.clone(), max_tokens=12)
    assert all(torch.equal(a, b) for a, b in zip(micro, again))


def test_fixed_width_counts_in_the_cost():
    lengths = torch.tensor([2, 2, 2, 2])
    assert [m.numel() for m in token_budget_micro_batches(lengths, 8)] == [4]
    assert [m.numel() for m in token_budget_micro_batches(lengths, 8, fixed_width=2)] == [2, 2]


def test_single_over_long_row_gets_its_own_micro_batch():
    lengths = torch.tensor([3, 100, 4, 2])
    micro = token_budget_micro_batches(lengths, max_tokens=10)  # sorted: 2, 3, 4, 100
    assert [m.tolist() for m in micro] == [[3, 0], [2], [1]]  # 2·3 ≤ 10 < 3·4; 100 > 10 alone
    micro = token_budget_micro_batches(lengths, max_tokens=5)
    assert [m.tolist() for m in micro] == [[3], [0], [2], [1]]
    assert token_budget_micro_batches(torch.tensor([50]), 10)[0].tolist() == [0]


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="lengths is empty"):
        token_budget_micro_batches(torch.tensor([], dtype=torch.long), 10)
    with pytest.raises(ValueError, match="lengths"):
        token_budget_micro_batches(torch.tensor([1.0, 2.0]), 10)
    with pytest.raises(ValueError, match="lengths"):
        token_budget_micro_batches(torch.tensor([[1, 2]]), 10)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        token_budget_micro_batches(torch.tensor([1, -1]), 10)
    with pytest.raises(ValueError, match="max_tokens"):
        token_budget_micro_batches(torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="fixed_width"):
        token_budget_micro_batches(torch.tensor([1]), 10, fixed_width=-1)
    with pytest.raises(ValueError, match="micro_batches"):
        padding_fraction(torch.tensor([1]), [])


@pytest.mark.numerics
def test_padding_fraction():
    lengths = torch.tensor([1, 3, 4])
    # integer token counts and one float64 division: exactly the quotient written here
    # one micro-batch at width 4: computed 12, needed 8
    assert padding_fraction(lengths, [torch.arange(3)]) == 4 / 12
    # with 2 prompt columns: computed 3·6 = 18, needed 8 + 6 = 14
    assert padding_fraction(lengths, [torch.arange(3)], fixed_width=2) == 4 / 18
    assert padding_fraction(lengths, [torch.tensor([0]), torch.tensor([1, 2])]) == 1 / 9
    assert padding_fraction(torch.tensor([0, 0]), [torch.tensor([0, 1])]) == 0.0


def _packed():
    prompts = [[5, 6], [7, 8, 9, 10]]
    completions = [[Completion([11, 12, 13], "", "stop"), Completion([14], "", "stop")],
                   [Completion([15, 16, 17, 18, 19, 20], "", "length"), Completion([], "", "stop")]]
    return pack_rollouts(prompts, completions, pad_token_id=0)


def test_trim_to_micro_batch_keeps_prompt_and_longest_response():
    packed = _packed()
    P, ids, mask, lengths = packed["prompt_length"], packed["input_ids"], packed["attention_mask"], \
        packed["response_lengths"]
    assert P == 4 and ids.shape == (4, 10)
    rows = torch.tensor([3, 1, 0])
    t_ids, t_mask = trim_to_micro_batch(ids, mask, P, lengths, rows)
    assert t_ids.shape == t_mask.shape == (3, P + 3)
    assert torch.equal(t_ids, ids[rows, :P + 3]) and torch.equal(t_mask, mask[rows, :P + 3])
    assert int(mask[rows, P + 3:].sum()) == 0  # only padding was cut
    t_ids, _ = trim_to_micro_batch(ids, mask, P, lengths, torch.tensor([3]))  # empty response: prompt only
    assert t_ids.shape == (1, P)
    t_ids, _ = trim_to_micro_batch(ids, mask, P, lengths, torch.tensor([2, 0]))
    assert torch.equal(t_ids, ids[[2, 0]])


def test_trim_errors():
    packed = _packed()
    P, ids, mask, lengths = packed["prompt_length"], packed["input_ids"], packed["attention_mask"], \
        packed["response_lengths"]
    with pytest.raises(ValueError, match="rows"):
        trim_to_micro_batch(ids, mask, P, lengths, torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="prompt_length"):
        trim_to_micro_batch(ids, mask, 11, lengths, torch.tensor([0]))
    with pytest.raises(ValueError, match="response_lengths"):
        trim_to_micro_batch(ids, mask, P, lengths[:2], torch.tensor([0]))
    with pytest.raises(ValueError, match="response_lengths"):
        trim_to_micro_batch(ids, mask, P + 1, lengths, torch.tensor([2]))  # 6 > 10 - 5 columns
    with pytest.raises(ValueError, match="attention_mask"):
        trim_to_micro_batch(ids, mask[:, :-1], P, lengths, torch.tensor([0]))
