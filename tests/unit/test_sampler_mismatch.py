"""Sampler/trainer mismatch metrics and truncated importance sampling (TIS) of the policy loss."""

from __future__ import annotations

import math

import pytest
import torch

from aspo_lit.maths.losses import aggregate, get_policy_loss
from aspo_lit.maths.sampler_mismatch import mismatch_stats, truncated_is_weights
from tests.helpers.tolerance import rounding_tol

pytestmark = pytest.mark.numerics


def test_mismatch_stats_over_response_tokens():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    engine = torch.tensor([[-1.5, -2.0, -1.0], [-0.5, -0.7, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the 9.0 is padding
    stats = mismatch_stats(old, engine, mask)
    # the differences are exact but for fp32's -0.7 (u relative); then a sum of 5 and /5; each exp 2u more
    assert float(stats["rollout/logprob_diff_mean"]) == pytest.approx((0.5 + 0 + 2 + 0 + 0.2) / 5,
                                                                     rel=rounding_tol(torch.float32, 6), abs=0)
    assert float(stats["rollout/logprob_diff_max"]) == 2.0
    ratios = [math.exp(0.5), 1.0, math.exp(-2.0), 1.0, math.exp(0.2)]
    assert float(stats["rollout/is_ratio_mean"]) == pytest.approx(sum(ratios) / 5, rel=rounding_tol(torch.float32, 8), abs=0)
    assert float(stats["rollout/is_ratio_max"]) == pytest.approx(math.exp(0.5), rel=rounding_tol(torch.float32, 2), abs=0)
    assert float(stats["rollout/is_ratio_mean"].weight) == 5        # weighed by this rank's tokens
    assert stats["rollout/is_ratio_max"].reduce == "max"


def test_mismatch_stats_have_the_same_names_without_tokens():
    """A rank with no response tokens (or a batch without the engine's log-probs) returns the same
    statistics, empty: the ranks' reductions need the same names on every rank."""
    old = torch.zeros(2, 3)
    full = mismatch_stats(old, old - 0.5, torch.ones(2, 3))
    for empty in (mismatch_stats(old, old - 0.5, torch.zeros(2, 3)), mismatch_stats(old, None, torch.ones(2, 3))):
        assert list(empty) == list(full)
        assert all(float(empty[k].weight) == 0 for k in empty if k.endswith("_mean"))
        assert all(float(empty[k]) == float("-inf") for k in empty if k.endswith("_max"))


def test_tis_weights_are_truncated_ratios():
    old = torch.tensor([[0.0, -1.0, -5.0]])
    engine = torch.tensor([[-2.0, -1.0, -1.0]])
    w = truncated_is_weights(old, engine, cap=3.0)
    # exp(2) = 7.4 is capped; exp(0) = 1 is exact, exp(-4) one fp32 exp (1 ulp)
    assert w.tolist()[0] == pytest.approx([3.0, 1.0, math.exp(-4.0)], rel=rounding_tol(torch.float32, 2), abs=0)
    with pytest.raises(ValueError, match="rollout_is_cap"):
        truncated_is_weights(old, engine, cap=0.0)


@pytest.mark.parametrize("name", ["grpo", "aspo", "cispo", "grpo_no_is"])
def test_tis_on_the_advantage_weights_each_token_term(name):
    """The module applies TIS as a per-token advantage; the gradient equals weighting each token's loss."""
    gen = torch.Generator().manual_seed(0)
    B, T = 6, 7
    old = -torch.rand(B, T, generator=gen) * 3
    logprobs = (old + 0.3 * torch.randn(B, T, generator=gen)).requires_grad_(True)
    engine = old + 0.5 * torch.randn(B, T, generator=gen)
    adv = torch.randn(B, generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.2).float()
    w = truncated_is_weights(old, engine, cap=2.0)
    loss_fn = get_policy_loss(name, loss_agg="token-mean")

    loss, _ = loss_fn(logprobs, old, adv[:, None] * w, mask)
    (grad,) = torch.autograd.grad(loss, logprobs)

    eps = torch.full((B, T), 0.2)
    per_token, _ = loss_fn.token_loss(logprobs, old, adv[:, None].expand(B, T), mask, eps, eps)
    expected = aggregate(per_token * w, mask, "token-mean")
    (want,) = torch.autograd.grad(expected, logprobs)
    # the same products in another order: <= 4 roundings each side (exp 2, ×A·w, /N); exact zeros off the mask
    rtol = rounding_tol(torch.float32, 8)
    assert torch.allclose(grad, want, rtol=rtol, atol=0)
    assert not torch.allclose(grad, torch.autograd.grad(loss_fn(logprobs, old, adv, mask)[0], logprobs)[0], rtol=rtol, atol=0)
