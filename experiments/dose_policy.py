"""The dose-response study's policy (docs/studies/dose-protocol.md): a tabular autoregressive softmax
over ``T`` positions and a vocabulary of ``V`` tokens, with a logit per (position, previous token,
token), for many seeds at once (a leading seed dimension; every operation is per seed).

The task is outcome-supervised: reward 1 when the tokens at the three forking positions form one of
the valid patterns (several correct modes, so collapsing onto one of them costs no reward). The
forking positions start non-uniform (four plausible tokens hold ~3/4 of the mass, unevenly, per
seed); the other positions are reward-irrelevant filler and start uniform: the control.

Everything a run reports about the policy is exact -- the expected entropy at each position under
the policy's own state distribution, the expected reward and the probability of each valid pattern
-- computed from the tables by the chain rule, not sampled.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

T, V = 12, 16
FORKS = (2, 6, 10)
PLAUSIBLE = 4          # tokens 0..3 are the plausible ones at a forking position
PLAUSIBLE_MASS = 0.75  # their share of the mass at the start, before the per-seed spread
START_SPREAD = 0.7     # sd of the per-seed logit noise on the plausible tokens
MODE_KEPT = 0.01       # a valid pattern is kept while the policy puts >= 1 % of its mass on it


def valid_patterns() -> Tensor:
    """``[V, V, V]`` bool: the triples of plausible tokens whose sum is divisible by 4 (16 of 64)."""
    valid = torch.zeros(V, V, V, dtype=torch.bool)
    for a in range(PLAUSIBLE):
        for b in range(PLAUSIBLE):
            for c in range(PLAUSIBLE):
                valid[a, b, c] = (a + b + c) % 4 == 0
    return valid


VALID = valid_patterns()


def initial_logits(seeds: list[int]) -> Tensor:
    """``[S, T, V, V]`` float64 tables, one per seed: 0 at the filler positions (uniform); at a
    forking position, logit b + 0.7·N(0, 1) on each plausible token (the same for every previous
    token; b sets their mass to 3/4 before the noise) and 0 on the others."""
    bias = math.log(PLAUSIBLE_MASS / (1 - PLAUSIBLE_MASS) * (V - PLAUSIBLE) / PLAUSIBLE)
    tables = torch.zeros(len(seeds), T, V, V, dtype=torch.float64)
    for i, seed in enumerate(seeds):
        g = torch.Generator().manual_seed(10_000 + seed)
        for t in FORKS:
            tables[i, t, :, :PLAUSIBLE] = bias + START_SPREAD * torch.randn(PLAUSIBLE, generator=g, dtype=torch.float64)
    return tables


def sample(logits: Tensor, uniforms: Tensor) -> Tensor:
    """``[S, B, T]`` tokens by inverse CDF from ``uniforms`` ``[S, B, T]`` in [0, 1): the same
    uniforms give the same tokens under the same tables (common random numbers across arms).
    Position 0 reads previous token 0."""
    probs = torch.softmax(logits.detach(), -1)
    seeds, batch, _ = uniforms.shape
    tokens = torch.zeros(seeds, batch, T, dtype=torch.long)
    prev = torch.zeros(seeds, batch, dtype=torch.long)
    rows = torch.arange(seeds)[:, None]
    for t in range(T):
        cdf = probs[rows, t, prev].cumsum(-1)                      # [S, B, V]
        pick = torch.searchsorted(cdf, uniforms[:, :, t:t + 1].contiguous().to(cdf.dtype)).squeeze(-1).clamp_max(V - 1)
        tokens[:, :, t] = pick
        prev = pick
    return tokens


def previous(tokens: Tensor) -> Tensor:
    """``[S, B, T]``: the previous token of each position (0 before position 0)."""
    return torch.cat([torch.zeros_like(tokens[..., :1]), tokens[..., :-1]], -1)


def token_logprobs(logits: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """``(log π(y_t | t, y_{t-1}), H(π(· | t, y_{t-1})))``, ``[S, B, T]`` each; the log-probs carry
    the gradient to ``logits``, the entropy is detached."""
    logp = torch.log_softmax(logits, -1)                           # [S, T, V, V]
    seeds, batch, _ = tokens.shape
    s = torch.arange(seeds)[:, None, None]
    t = torch.arange(T)[None, None, :]
    rows = logp[s, t, previous(tokens)]                            # [S, B, T, V]
    entropy = -(rows.detach().exp() * rows.detach()).sum(-1)
    return rows.gather(-1, tokens[..., None]).squeeze(-1), entropy


def rewards(tokens: Tensor) -> Tensor:
    """``[S, B]`` float: 1 when the forking positions' tokens form a valid pattern."""
    return VALID[tokens[..., FORKS[0]], tokens[..., FORKS[1]], tokens[..., FORKS[2]]].to(torch.float64)


def table_entropy(logits: Tensor) -> Tensor:
    """``[S, T, V]``: the entropy of every row of the tables."""
    logp = torch.log_softmax(logits.detach(), -1)
    return -(logp.exp() * logp).sum(-1)


def position_entropy(logits: Tensor) -> Tensor:
    """``[S, T]``: the expected entropy at each position under the policy's own distribution of the
    previous token (exact: the marginals by the chain rule)."""
    probs = torch.softmax(logits.detach(), -1)
    rows = table_entropy(logits)
    seeds = logits.shape[0]
    marginal = torch.zeros(seeds, V, dtype=logits.dtype)
    marginal[:, 0] = 1.0                                           # position 0 reads previous token 0
    out = torch.empty(seeds, T, dtype=logits.dtype)
    for t in range(T):
        out[:, t] = (marginal * rows[:, t]).sum(-1)
        marginal = torch.einsum("sp,spv->sv", marginal, probs[:, t])
    return out


def pattern_probs(logits: Tensor) -> Tensor:
    """``[S, V, V, V]``: the exact probability of each triple of tokens at the forking positions."""
    probs = torch.softmax(logits.detach(), -1)
    seeds = logits.shape[0]
    marginal = torch.zeros(seeds, V, dtype=logits.dtype)
    marginal[:, 0] = 1.0
    for t in range(FORKS[0]):
        marginal = torch.einsum("sp,spv->sv", marginal, probs[:, t])
    first = torch.einsum("sp,spv->sv", marginal, probs[:, FORKS[0]])      # P(f1)
    links = []
    for a, b in zip(FORKS[:-1], FORKS[1:]):
        link = probs[:, a + 1]
        for t in range(a + 2, b + 1):
            link = link @ probs[:, t]                               # P(token at t | token at a)
        links.append(link)
    return first[:, :, None, None] * links[0][:, :, :, None] * links[1][:, None, :, :]


def outcome(logits: Tensor) -> dict[str, Tensor]:
    """Per seed ``[S]``: the expected reward, the mean expected entropy over the forking and over
    the filler positions, and the number of valid patterns kept (mass >= ``MODE_KEPT``)."""
    entropy = position_entropy(logits)
    fork = torch.zeros(T, dtype=torch.bool)
    fork[list(FORKS)] = True
    patterns = pattern_probs(logits)
    valid = patterns * VALID
    return {"reward": valid.flatten(1).sum(-1), "fork_entropy": entropy[:, fork].mean(-1),
            "filler_entropy": entropy[:, ~fork].mean(-1),
            "modes_kept": (valid.flatten(1) >= MODE_KEPT).sum(-1).to(logits.dtype)}
