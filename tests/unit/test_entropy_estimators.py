"""The two first-order entropy estimators of `aspo_lit.maths.counterfactual` on a tabular softmax
policy, where every action's logit is known and the entropy change is exact: the state-centred one
estimates the exact first-order change; the pooled one is off by its between-state term."""

from __future__ import annotations

import math

import torch

from aspo_lit.maths.counterfactual import (
    covariance_sums,
    entropy_change,
    first_order_entropy_change,
    shipped_losses,
    state_centred_entropy_change,
    state_centred_sums,
    token_weights,
)

S, V, DRAWS = 6, 8, 4000
Z_SCORE = 5.0      # a seeded draw; 5 SE leaves a 6e-7 chance that a right estimator misses


def entropy(logits):
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def tabular_policy():
    """π_old over S states of very different entropies (temperatures 0.1 to 3: near-forced to near
    uniform), π_θ a small move from it, an advantage for every (state, action) whose state mean
    rises with the state's entropy (so the pooled covariance has a between-state part), and GRPO's
    weight w(s, a) for every action, from the shipped loss."""
    g = torch.Generator().manual_seed(3)
    temperature = torch.tensor([0.1, 0.3, 0.6, 1.0, 2.0, 3.0], dtype=torch.float64)[:, None]
    z_old = torch.randn(S, V, generator=g, dtype=torch.float64) / temperature
    z_theta = z_old + 0.3 * torch.randn(S, V, generator=g, dtype=torch.float64)
    advantage = torch.randn(S, V, generator=g, dtype=torch.float64) + entropy(z_old)[:, None]
    lp, old = torch.log_softmax(z_theta, -1), torch.log_softmax(z_old, -1)
    # each (state, action) one response of one token: w(s, a) at log π_θ(a|s), log π_old(a|s), A(s, a)
    w = token_weights({"grpo": shipped_losses()["grpo"]}, lp.reshape(-1, 1).float(), old.reshape(-1, 1).float(),
                      advantage.reshape(-1).float(), torch.ones(S * V, 1))["grpo"].double().reshape(S, V)
    return z_old, z_theta, w * advantage


def test_first_order_entropy_change_is_the_derivative_of_the_entropy():
    z_old, z_theta, y = tabular_policy()
    for z in (z_old, z_theta):
        first = float(first_order_entropy_change(z, y))
        eta = 1e-6
        exact = float(entropy(z + eta * y).sum() - entropy(z).sum()) / eta
        # ΔH/η = first-order + O(η·|y|²): the second derivative of H in the logits is O(1) per state
        assert abs(exact - first) <= 1e-4 * max(1.0, abs(first)), (exact, first)
        assert abs(first) > 0.05


def draws(z_old, z_theta, y):
    """DRAWS tokens per state sampled from π_old, each with what a StepOutput has of it."""
    g = torch.Generator().manual_seed(11)
    old, lp = torch.log_softmax(z_old, -1), torch.log_softmax(z_theta, -1)
    actions = torch.multinomial(old.exp(), DRAWS, replacement=True, generator=g)       # [S, DRAWS]
    pick = lambda table: table.gather(1, actions)
    h_old, h_theta = entropy(z_old)[:, None].expand(S, DRAWS), entropy(z_theta)[:, None].expand(S, DRAWS)
    return pick(old), pick(lp), h_old, h_theta, pick(y)


def mean_and_se(terms):
    return float(terms.mean()), float(terms.std() / math.sqrt(terms.numel()))


def test_state_centred_estimates_the_exact_first_order_change_under_either_policy():
    z_old, z_theta, y = tabular_policy()
    old, lp, h_old, h_theta, y_t = draws(z_old, z_theta, y)
    mask = torch.ones_like(old)
    r = (lp - old).exp()
    for name, z, sums, terms in (
            ("π_old", z_old, state_centred_sums(old, h_old, y_t, mask), (old + h_old) * y_t),
            ("π_θ", z_theta, state_centred_sums(lp, h_theta, y_t, mask, r), r * (lp + h_theta) * y_t)):
        estimate = float(state_centred_entropy_change(sums))
        _, se = mean_and_se(terms)
        exact = float(first_order_entropy_change(z, y)) / S       # the estimator is a mean over the S·DRAWS tokens
        assert abs(estimate - exact) <= Z_SCORE * se, (name, estimate, exact, se)
        assert abs(exact) > 20 * se, name                          # the check can tell a wrong estimator


def test_pooled_carries_the_between_state_covariance():
    """−Cov_pooled(log π_old, y) → −E_s Cov_s − Cov_s(E[log π_old | s], E[y | s]) (the law of total
    covariance, states equally weighted): the second term, exact here, is its offset."""
    z_old, z_theta, y = tabular_policy()
    old, _, h_old, _, y_t = draws(z_old, z_theta, y)
    pooled = float(entropy_change(covariance_sums(old, y_t, torch.ones_like(old))))
    p = torch.softmax(z_old, -1)
    state_mean_logp, state_mean_y = -entropy(z_old), (p * y).sum(-1)
    between = float((state_mean_logp * state_mean_y).mean() - state_mean_logp.mean() * state_mean_y.mean())
    exact = float(first_order_entropy_change(z_old, y)) / S
    centred = (old - old.mean()) * (y_t - y_t.mean())
    _, se = mean_and_se(centred)
    assert abs(pooled - (exact - between)) <= Z_SCORE * se, (pooled, exact, between, se)
    assert abs(between) > 20 * se and abs(pooled - exact) > 10 * se    # the pooled one misses the exact one
