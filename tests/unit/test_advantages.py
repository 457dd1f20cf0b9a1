"""Group-relative advantages (eq. 1) against a plain-Python (float64) reference; bounds from
`advantage_tol` (docs/design.md, "Tolerances in tests")."""

from __future__ import annotations

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aspo_lit.maths.advantages import group_advantages
from tests.helpers.tolerance import assert_within, gamma, rounding_tol, underflow_tol, unit_roundoff

pytestmark = pytest.mark.numerics


def reference(rewards: list[float], group_size: int, norm: str, eps: float = 1e-6) -> list[float]:
    out = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g:g + group_size]
        mean = statistics.fmean(group)
        scale = statistics.stdev(group) + eps if norm == "std" else 1.0   # stdev: unbiased (n-1)
        out += [0.0 if len(set(group)) == 1 else (r - mean) / scale for r in group]
    return out


def advantage_tol(rewards: list[float], group_size: int, norm: str, eps: float = 1e-6) -> torch.Tensor:
    """Per-element bound on |fp32 advantage - exact|. Per group: the mean of G rewards is off by
    γ_G·mean|R|, each centred R_i - mean by that and u·|R_i - mean| more; the std (Welford's update,
    relative error O(G·u·κ) with κ ~ |mean|/std, Chan, Golub & LeVeque 1983) by O(G·u·(|mean| + std)):
    E = γ_{2G+3}·(mean|R| + max|R_i - mean|) bounds both. Then A_i = c_i / (std + eps) is off by
    E·(1 + |A_i|) / (std + eps) plus the division's and eps-add's 2u·|A_i|; for norm="none" by E.
    Subnormal rewards (hypothesis draws them) add gradual underflow's absolute error to E."""
    bounds = []
    for g in range(0, len(rewards), group_size):
        group = torch.tensor(rewards[g:g + group_size], dtype=torch.float64)
        centred = group - group.mean()
        err = (gamma(2 * group_size + 3) * (group.abs().mean() + centred.abs().max())
               + underflow_tol(torch.float32, 2 * group_size + 3))
        if norm == "std":
            scale = group.std() + eps
            bounds.append(err * (1 + centred.abs() / scale) / scale + 2 * unit_roundoff() * centred.abs() / scale)
        else:
            bounds.append(err.expand(group_size))
    return torch.cat(bounds)


def test_grpo_std_normalisation_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv, all_equal = group_advantages(rewards, group_size=4)
    std = (3 * 0.25**2 + 0.75**2) / 3  # unbiased variance of [1, 0, 0, 0]
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std**0.5 + 1e-6)
    # mean 0.25, centred values and std 0.5 are exact; then + eps and / on each side: 2 roundings each
    torch.testing.assert_close(adv[:4], expected, rtol=rounding_tol(torch.float32, 4), atol=0)
    assert adv[4:].eq(0).all()
    assert all_equal.tolist() == [False, True]


def test_norm_none_is_mean_centred_only():
    adv, all_equal = group_advantages(torch.tensor([3.0, 1.0, 2.0, 1.0, 0.0, 2.0]), 3, norm="none")
    assert torch.equal(adv, torch.tensor([1.0, -1.0, 0.0, 0.0, -1.0, 1.0]))  # means 2 and 1: every step exact
    assert all_equal.tolist() == [False, False]


def test_all_equal_groups_are_exactly_zero():
    rewards = torch.full((32,), 0.7)   # fp32: mean(16 × 0.7) != 0.7, and std ~ 1e-8 would amplify it
    adv, all_equal = group_advantages(rewards, 16)
    assert adv.eq(0).all() and all_equal.all()


@settings(max_examples=40, deadline=None)
@given(
    group_size=st.integers(2, 6),
    groups=st.integers(1, 4),
    norm=st.sampled_from(["std", "none"]),
    data=st.data(),
)
def test_property_matches_reference(group_size, groups, norm, data):
    values = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-5, 5, allow_nan=False, width=32))
    rewards = data.draw(st.lists(values, min_size=group_size * groups, max_size=group_size * groups))
    adv, all_equal = group_advantages(torch.tensor(rewards), group_size, norm=norm)
    expected = torch.tensor(reference(rewards, group_size, norm), dtype=torch.float64)
    bound = advantage_tol(rewards, group_size, norm)
    assert_within(adv, expected, bound, name="advantages")
    assert all_equal.tolist() == [len(set(rewards[g:g + group_size])) == 1
                                  for g in range(0, len(rewards), group_size)]
    # each group's advantages are centred: the exact ones sum to 0, the fp32 sum adds γ_G·Σ|A_i|
    group_bound = bound.view(groups, group_size).sum(-1) + gamma(group_size) * adv.double().abs().view(groups, -1).sum(-1)
    assert_within(adv.view(groups, group_size).sum(-1), torch.zeros(groups), group_bound, name="group sums")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rewards=torch.zeros(5), group_size=2), "multiple of group_size"),
        (dict(rewards=torch.zeros(4), group_size=1), "group_size"),
        (dict(rewards=torch.zeros(4, 1), group_size=2), "rewards"),
        (dict(rewards=torch.zeros(4), group_size=2, norm="batch"), r"norm 'batch'.*std.*none"),
        (dict(rewards=torch.tensor([0.0, float("nan")]), group_size=2), "rewards"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(**kwargs)
