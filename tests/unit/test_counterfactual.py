"""The counterfactual weight diagnostic (`aspo_lit.maths.counterfactual`, `CounterfactualWeights`): its
maths on hand-computed inputs, every loss's weight on a hand-made step whose statistics were
worked out by hand, on-policy data (r ≡ 1) where every loss agrees, the run's own loss arguments,
and two ranks giving what one process gives."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from aspo_lit.callbacks import CounterfactualWeights, EntropyMechanism
from aspo_lit.maths.counterfactual import (
    FORCED_ENTROPY,
    SHIPPED_LOSSES,
    average_ranks,
    decile_means,
    entropy_change,
    entropy_split_sums,
    flip_change_sums,
    quantiles,
    share,
    shipped_losses,
    spearman,
    token_weights,
)
from aspo_lit.maths.losses import get_policy_loss
from aspo_lit.maths.step import StepOutput
from tests.helpers.ranks import on_ranks
from tests.helpers.tolerance import FLOAT64_REL, approx64, rounding_tol, unit_roundoff
from tests.unit.test_callbacks import DummyModule, fit, last_logged

U = unit_roundoff(torch.float32)


# --------------------------------------------------------------------------- the maths, by hand
def test_average_ranks_share_ties_and_spearman_by_hand():
    assert average_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    # no ties: 1 - 6·Σd²/(n(n²-1)) with d = (0, -1, 1, 0): 1 - 12/60
    assert float(spearman(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 3.0, 2.0, 4.0]))) == approx64(0.8)
    # ties: ranks (1, 2.5, 2.5, 4) vs (1, 2, 3, 4): Σdxdy = 4.5, Σdx² = 4.5, Σdy² = 5 -> sqrt(0.9)
    assert float(spearman(torch.tensor([1.0, 2.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0, 4.0]))) == approx64(math.sqrt(0.9))
    assert float(spearman(torch.tensor([1.0, 2.0]), torch.tensor([-5.0, -7.0]))) == approx64(-1.0)
    assert math.isnan(spearman(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 3.0])))  # a constant has no rank order
    assert math.isnan(spearman(torch.tensor([1.0]), torch.tensor([2.0])))


def test_quantiles_interpolate_as_numpy():
    # sorted (1, 2, 3, 4): positions 0, 1.5, 2.7, 3 of the order statistics
    assert quantiles(torch.tensor([4.0, 1.0, 3.0, 2.0]), [0.0, 0.5, 0.9, 1.0]).tolist() == pytest.approx(
        [1.0, 2.5, 3.7, 4.0], rel=FLOAT64_REL, abs=0)
    assert torch.isnan(quantiles(torch.tensor([]), [0.5])).all()
    with pytest.raises(ValueError, match=r"quantiles must be in \[0, 1\]"):
        quantiles(torch.tensor([1.0]), [1.5])


def test_decile_means_cut_the_population_into_equal_counts():
    key = torch.tensor([7.0, 3.0, 15.0, 0.0, 11.0, 19.0, 1.0, 9.0, 4.0, 18.0, 2.0, 13.0, 6.0, 17.0, 5.0, 10.0,
                        8.0, 14.0, 12.0, 16.0])      # 0..19 shuffled: two tokens a decile
    means, values = decile_means(key, torch.stack([2 * key, -key], -1))
    assert means.tolist() == [2 * k + 0.5 for k in range(10)]           # (2k + 2k+1) / 2, exact
    assert values[:, 0].tolist() == [4 * k + 1 for k in range(10)]
    assert values[:, 1].tolist() == [-(2 * k + 0.5) for k in range(10)]
    # 5 tokens: the i-th lowest is in decile floor(2i): 1, 3, 5, 7, 9; the others are empty
    means, _ = decile_means(torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7], dtype=torch.float64), torch.zeros(5, 1))
    assert means[0::2].tolist() == [0.1, 0.3, 0.5, 0.7, 0.9] and torch.isnan(means[1::2]).all()


def test_flip_change_sums_and_entropy_change_by_hand():
    w_grpo, w_aspo = torch.tensor([[1.0, 0.5, 2.0, 0.0]]), torch.tensor([[1.0, 2.0, 0.5, 4.0]])
    positive = torch.tensor([[True, True, True, False]])
    forced = torch.tensor([[True, False, True, True]])
    # A > 0: |Δ| = (0, 1.5, 1.5), w = (1, 0.5, 2); forced: tokens 0, 2 (token 3 is forced, but A <= 0); free: 1
    assert flip_change_sums(w_grpo, w_aspo, positive, forced).tolist() == [3.0, 3.5, 1.5, 3.0, 1.5, 0.5]
    # [N, N_forced, Σ_forced H, Σ_free H] over the response tokens: the padding token 3 is not one
    entropy, mask = torch.tensor([[0.125, 1.0, 0.0625, 0.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert entropy_split_sums(entropy, mask, forced).tolist() == [3.0, 2.0, 0.1875, 1.0]
    assert math.isnan(share(torch.tensor(1.0), torch.tensor(0.0)))
    # x = (0, -1, -2), y = (1, 0, -1): E[xy] = 2/3, E[x] = -1, E[y] = 0 -> -Cov = -2/3
    sums = torch.tensor([3.0, -3.0, 0.0, 2.0], dtype=torch.float64)
    assert float(entropy_change(sums)) == approx64(-2 / 3)
    assert math.isnan(entropy_change(torch.zeros(4, dtype=torch.float64)))


# --------------------------------------------------------------------------- a hand-made step
# (π_old, r, π_old's entropy H) per token. Row 0 has A = +1, row 1 A = -1 (and one padding column).
# ε = 0.2, c = 3; forced: H < log 1.2 = 0.182 (row 0 token 0, row 1 token 0).
HAND = [[(0.9, 1.1, 0.1), (0.5, 0.5, 1.0), (0.2, 2.0, 2.0), (0.4, 0.25, 1.5), (0.1, 1.0, 2.5)],
        [(0.8, 0.5, 0.05), (0.3, 1.5, 1.2), (0.6, 4.0, 0.5)]]
HAND_ADVANTAGES = (1.0, -1.0)
S_POS = (1.1 * 0.5 * 2.0 * 0.25 * 1.0) ** (1 / 5)   # GSPO's sequence ratio: the geometric mean of r
S_NEG = (0.5 * 1.5 * 4.0) ** (1 / 3)
# Each loss's weight w (Prop. 4.1), by hand from its definition (aspo_lit/maths/losses.py):
HAND_WEIGHTS = {
    # m·r: r = 2 > 1.2 (A > 0) and r = 0.5 < 0.8 (A < 0) clipped, r = 4 > c (A < 0) dual-clipped
    "grpo": [[1.1, 0.5, 0.0, 0.25, 1.0], [0.0, 1.5, 0.0]],
    "grpo_no_is": [[1.0, 1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0]],
    # A > 0: the row's mean ratio (1.1 + 0.5 + 2 + 0.25 + 1) / 5 on GRPO's unclipped tokens
    "grpo_pos_mean": [[0.97, 0.97, 0.0, 0.97, 0.97], [0.0, 1.5, 0.0]],
    "cispo": [[1.1, 0.8, 1.2, 0.8, 1.0], [0.8, 1.2, 1.2]],       # clip(r, 0.8, 1.2), no token masked
    # the sequence ratio s on every token: A > 0, s = 0.772 < 1.2; A < 0, s = 1.442 > 0.8: unclipped (no dual clip)
    "gspo": [[S_POS] * 5, [S_NEG] * 3],
    # A > 0: 1/r, 1/0.25 = 4 > c soft-clipped to 3; A < 0: r, r = 4 > c soft-clipped to 3
    "aspo": [[1 / 1.1, 2.0, 0.0, 3.0, 1.0], [0.0, 1.5, 3.0]],
    "aspo_no_dual_clip": [[1 / 1.1, 2.0, 0.0, 4.0, 1.0], [0.0, 1.5, 4.0]],
}


def hand_step(rows=HAND, advantages=HAND_ADVANTAGES, width=5, entropy_shift=0.0) -> StepOutput:
    """`rows` as a StepOutput: log π_old and log π_θ = log(π_old·r) each rounded once to fp32; π_θ's
    entropy is π_old's + ``entropy_shift`` on response tokens."""
    n = len(rows)
    mask, old, lp, entropy = (torch.zeros(n, width, dtype=torch.float64) for _ in range(4))
    for i, row in enumerate(rows):
        for t, (pi_old, r, h) in enumerate(row):
            mask[i, t], old[i, t], lp[i, t], entropy[i, t] = 1.0, math.log(pi_old), math.log(pi_old * r), h
    mask, old, lp, entropy = mask.float(), old.float(), lp.float(), entropy.float()
    advantages = torch.tensor(advantages, dtype=torch.float32)
    return StepOutput(response_mask=mask, old_logprobs=old, entropy=entropy, logprobs=lp, ratio=(lp - old).exp(),
                      updated_entropy=entropy + entropy_shift * mask, token_weight=torch.zeros_like(mask),
                      advantages=advantages,
                      rewards=(advantages > 0).float(), response_lengths=mask.sum(1).long(),
                      truncated=torch.zeros(n, dtype=torch.bool), texts=["x"] * n, stats={})


def hand_columns(index: int) -> list[list[float]]:
    return [[token[index] for token in row] for row in HAND]


# The fp32 inputs carry rounding: log π_old and log π_θ once each (u·|value|), and the loss's log r =
# lp - old once more (u·|log r|), so log r is off by at most u·(max|lp| + max|old| + max|log r|)
# (absolute). A weight is exp of it (2 roundings) times a few more: ASPO's x - 2·sg(x) (u·|log r|), the
# backward's product and -grad/A (2), GSPO's / the positive-mean's mean over <= 5 tokens (6): relative
# <= 2·LOG_RATIO_ABS + γ_10.
LOG_RATIO_ABS = U * (max(abs(math.log(p * r)) for row in HAND for p, r, _ in row)
                     + max(abs(math.log(p)) for row in HAND for p, _, _ in row)
                     + max(abs(math.log(r)) for row in HAND for _, r, _ in row))
WEIGHT_REL = 2 * LOG_RATIO_ABS + rounding_tol(torch.float32, 10)


def test_every_loss_weight_on_the_hand_step():
    step = hand_step()
    weights = token_weights(shipped_losses(), step.logprobs, step.old_logprobs, step.advantages,
                            step.response_mask, step.entropy)
    assert list(weights) == list(SHIPPED_LOSSES) == list(HAND_WEIGHTS)
    for name, rows in HAND_WEIGHTS.items():
        for i, row in enumerate(rows):
            assert weights[name][i, :len(row)].tolist() == pytest.approx(row, rel=WEIGHT_REL, abs=0), name
        assert float(weights[name][1, 3]) == 0.0, name           # padding


def change_rel(w_grpo, w_aspo) -> float:
    """Relative error of Σ|w_grpo − w_aspo| / Σ w_grpo when each weight is off by <= WEIGHT_REL: each
    |Δ| by WEIGHT_REL·(w_g + w_a), so the numerator by WEIGHT_REL·Σ(w_g + w_a)/Σ|Δ|, the denominator
    by WEIGHT_REL."""
    change = sum(abs(g - a) for g, a in zip(w_grpo, w_aspo))
    return WEIGHT_REL * (sum(w_grpo) + sum(w_aspo)) / change + WEIGHT_REL


def cov_tol(x, y, rel: float) -> float:
    """|Δ Cov(x, y)| when x and y carry relative errors <= rel: to first order
    rel·(2·E|xy| + E|x|·|E y| + |E x|·E|y|); the float64 arithmetic adds nothing visible."""
    x, y = np.asarray(x), np.asarray(y)
    return rel * (2 * np.abs(x * y).mean() + np.abs(x).mean() * abs(y.mean()) + abs(x.mean()) * np.abs(y).mean())


def test_flip_statistics_of_the_hand_step():
    """Every statistic of the hand step against its value worked out by hand."""
    out = {k: float(v) for k, v in CounterfactualWeights().compute(None, None, hand_step(entropy_shift=0.25)).items()}
    g, a = HAND_WEIGHTS["grpo"][0], HAND_WEIGHTS["aspo"][0]
    # Σ|w_grpo - w_aspo| over A > 0 = 0.21/1.1 + 1.5 + 0 + 2.75 + 0, Σ w_grpo = 2.85; forced: token 0,
    # |1.1 - 1/1.1| / 1.1 = 0.21/1.21; free: tokens 1-4, 4.25 / 1.75
    assert out["flip/weight_change"] == pytest.approx((0.21 / 1.1 + 1.5 + 2.75) / 2.85, rel=change_rel(g, a), abs=0)
    assert out["flip/weight_change_forced"] == pytest.approx(0.21 / 1.21, rel=change_rel(g[:1], a[:1]), abs=0)
    assert out["flip/weight_change_free"] == pytest.approx(4.25 / 1.75, rel=change_rel(g[1:], a[1:]), abs=0)
    assert out["flip/forced_weight_share"] == pytest.approx(1.1 / 2.85, rel=2 * WEIGHT_REL, abs=0)  # two sums
    # 8 response tokens, 2 forced; the entropies are fp32 roundings of the hand values (u each)
    assert out["flip/forced_token_share"] == 0.25
    assert out["flip/entropy_forced"] == pytest.approx((0.1 + 0.05) / 8, rel=rounding_tol(torch.float32, 1), abs=0)
    assert out["flip/entropy_free"] == pytest.approx(8.7 / 8, rel=rounding_tol(torch.float32, 1), abs=0)
    # the A > 0 tokens by π_old: 0.1, 0.2, 0.4, 0.5, 0.9 -> deciles 1, 3, 5, 7, 9 (5 tokens); π_old =
    # exp(fp32 log π_old): u·|log π_old| <= 2.3u, then float64
    for k, (pi_old, w_g, w_a) in zip((1, 3, 5, 7, 9), [(0.1, 1.0, 1.0), (0.2, 0.0, 0.0), (0.4, 0.25, 3.0),
                                                       (0.5, 0.5, 2.0), (0.9, 1.1, 1 / 1.1)]):
        assert out[f"flip/pi_old_decile{k:02d}"] == pytest.approx(pi_old, rel=rounding_tol(torch.float32, 3), abs=0)
        assert out[f"flip/w_grpo_decile{k:02d}"] == pytest.approx(w_g, rel=WEIGHT_REL, abs=0)
        assert out[f"flip/w_aspo_decile{k:02d}"] == pytest.approx(w_a, rel=WEIGHT_REL, abs=0)
    assert all(math.isnan(out[f"flip/{q}_decile{k:02d}"]) for k in (2, 4, 6, 8, 10) for q in ("pi_old", "w_grpo", "w_aspo"))
    # active A > 0 tokens (GRPO does not clip them): π_old 0.9, 0.5, 0.4, 0.1 with r 1.1, 0.5, 0.25, 1.0:
    # ranks (4, 3, 2, 1) and (4, 2, 1, 3), Σd² = 0 + 1 + 1 + 4 = 6 -> 1 - 36/60; the ranks are exact
    assert out["flip/spearman_pi_old_ratio"] == approx64(0.4)
    # |log r|, A > 0: 0, log 1.1, log 2, log 2, log 4 -> p50 log 2, p90 (position 3.6) 1.6·log 2,
    # p99 1.96·log 2, max 2·log 2; A < 0: log 1.5, log 2, log 4 -> log 2, 1.8·log 2, 1.98·log 2, 2·log 2.
    # A convex combination of two order statistics, each off by <= LOG_RATIO_ABS (then float64)
    log2 = math.log(2)
    expected = {"pos": (log2, 1.6 * log2, 1.96 * log2, 2 * log2), "neg": (log2, 1.8 * log2, 1.98 * log2, 2 * log2)}
    for sign, values in expected.items():
        for q, value in zip(("p50", "p90", "p99", "max"), values):
            assert out[f"flip/abs_log_ratio_{sign}_{q}"] == pytest.approx(value, rel=0, abs=LOG_RATIO_ABS + FLOAT64_REL), (sign, q)
    # −Cov(log π_old, w·A) over the 8 response tokens, each loss with its hand weights
    x = [math.log(p) for row in hand_columns(0) for p in row]
    changes = {}
    for name, rows in HAND_WEIGHTS.items():
        y = [w * adv for row, adv in zip(rows, HAND_ADVANTAGES) for w in row]
        changes[name] = -np.cov(x, y, bias=True)[0, 1]
        assert out[f"flip/entropy_change_pooled/{name}"] == pytest.approx(changes[name], rel=0, abs=cov_tol(x, y, WEIGHT_REL)), name
    y_grpo = [w * adv for row, adv in zip(HAND_WEIGHTS["grpo"], HAND_ADVANTAGES) for w in row]
    y_aspo = [w * adv for row, adv in zip(HAND_WEIGHTS["aspo"], HAND_ADVANTAGES) for w in row]
    assert out["flip/entropy_change_pooled_gap"] == pytest.approx(changes["grpo"] - changes["aspo"], rel=0,
                                                           abs=cov_tol(x, y_grpo, WEIGHT_REL) + cov_tol(x, y_aspo, WEIGHT_REL))
    assert abs(out["flip/entropy_change_pooled_gap"]) > 0.1    # the flip changes the predicted entropy change here
    # state-centred: −(1/8)·Σ r·(log π_θ + H_θ)·w·A under π_θ (H_θ = H + 0.25), −(1/8)·Σ (log π_old + H)·w·A
    # under π_old. r·w·A is off by <= 3·WEIGHT_REL relative; log π and H by u·(|log π| + H) + u·|log r|
    tokens = [(p, r, h, adv) for row, adv in zip(HAND, HAND_ADVANTAGES) for p, r, h in row]
    for name, rows in HAND_WEIGHTS.items():
        w = [x for row in rows for x in row]
        for key, shift, ratio in (("state", 0.25, True), ("state_old", 0.0, False)):
            scale = [(r if ratio else 1.0) * wt * abs(adv) for (p, r, h, adv), wt in zip(tokens, w)]
            centred = [math.log(p * r if ratio else p) + h + shift for p, r, h, _ in tokens]
            terms = [c * x * (1 if adv > 0 else -1) for c, x, (*_, adv) in zip(scale, centred, tokens)]
            tol = sum(c * (3 * WEIGHT_REL * abs(x) + 2 * U * (abs(x) + 4) + LOG_RATIO_ABS)
                      for c, x in zip(scale, centred)) / 8
            assert out[f"flip/entropy_change_{key}/{name}"] == pytest.approx(-sum(terms) / 8, rel=0, abs=tol), (key, name)
    assert out["flip/entropy_change_state_gap"] != pytest.approx(out["flip/entropy_change_state_old_gap"], abs=0.01)


# --------------------------------------------------------------------------- on-policy: r ≡ 1
def on_policy_step() -> StepOutput:
    """One epoch, one mini-batch: every token's log π_θ at its update is log π_old (r ≡ 1). Advantages of
    both signs and 0; entropies on both sides of the forced threshold."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 4, 6, 2, 5, 6])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).float()
    old = torch.log(torch.rand(6, 6, generator=generator).clamp_min(0.01)) * mask
    entropy = 2.0 * torch.rand(6, 6, generator=generator) ** 2 * mask
    advantages = torch.tensor([1.2, -0.8, 0.0, 0.4, -1.5, 0.7])
    return StepOutput(response_mask=mask, old_logprobs=old, entropy=entropy, logprobs=old.clone(),
                      ratio=torch.ones_like(mask), updated_entropy=entropy, token_weight=mask.clone(),
                      advantages=advantages, rewards=(advantages > 0).float(), response_lengths=lengths,
                      truncated=torch.zeros(6, dtype=torch.bool), texts=["x"] * 6, stats={})


def test_on_policy_every_loss_weighs_every_token_one():
    """r ≡ 1: every shipped loss's weight is 1 on every token that has a gradient (A ≠ 0), so the
    flip changes nothing, every loss predicts the same entropy change, and that change is
    EntropyMechanism's −Cov(log π_old, A)."""
    step = on_policy_step()
    weights = token_weights(shipped_losses(), step.logprobs, step.old_logprobs, step.advantages,
                            step.response_mask, step.entropy)
    carries_gradient = step.response_mask * (step.advantages != 0).float()[:, None]
    for name, w in weights.items():
        assert torch.equal(w, carries_gradient), name
    out = CounterfactualWeights().compute(None, None, step)
    forced = (step.entropy < FORCED_ENTROPY) & (step.response_mask > 0) & (step.advantages > 0)[:, None]
    assert 0 < int(forced.sum()) < int(((step.response_mask > 0) & (step.advantages > 0)[:, None]).sum())
    assert float(out["flip/weight_change"]) == 0.0
    assert float(out["flip/weight_change_forced"]) == 0.0 and float(out["flip/weight_change_free"]) == 0.0
    assert float(out["flip/entropy_change_pooled_gap"]) == 0.0
    assert float(out["flip/entropy_change_state_gap"]) == float(out["flip/entropy_change_state_old_gap"]) == 0.0
    changes = {float(out[f"flip/entropy_change_pooled/{name}"]) for name in SHIPPED_LOSSES}
    assert len(changes) == 1                         # the same sums: bit for bit
    predicted = float(EntropyMechanism().compute(None, None, step)["entropy/predicted_change"])
    assert abs(predicted) > 0.05
    # both in float64 from the same fp32 inputs, centred in two orders: float64 rounding on O(1) sums
    assert changes.pop() == approx64(predicted)
    for k in range(1, 11):
        assert float(out[f"flip/w_grpo_decile{k:02d}"]) == float(out[f"flip/w_aspo_decile{k:02d}"]) == 1.0
    assert all(float(out[f"flip/abs_log_ratio_{s}_max"]) == 0.0 for s in ("pos", "neg"))
    assert math.isnan(out["flip/spearman_pi_old_ratio"])   # r constant: no rank order


def test_a_batch_without_gradient_logs_nan():
    """Every group solved or failed (A = 0 everywhere): no token has a weight, so every share, decile,
    correlation and quantile is undefined (NaN), not 0, and nothing raises."""
    step = hand_step(advantages=(0.0, 0.0))
    out = CounterfactualWeights().compute(None, None, step)
    assert len(out) == 70
    undefined = [k for k in out if not k.startswith(("flip/entropy_change", "flip/forced_token_share", "flip/entropy_f"))]
    assert all(math.isnan(out[k]) for k in undefined), [k for k in undefined if not math.isnan(out[k])]
    assert all(float(out[f"flip/entropy_change_{key}/{name}"]) == 0.0              # w·A ≡ 0
               for name in SHIPPED_LOSSES for key in ("pooled", "state", "state_old"))
    assert float(out["flip/forced_token_share"]) == 0.25


# --------------------------------------------------------------------------- the run's loss, a real fit
def test_counterfactual_losses_use_the_run_loss_arguments():
    """The losses are built with the run's ε and c: with c = 5 ASPO's 1/r = 4 (A > 0) and r = 4 (A < 0)
    are no longer capped, and GRPO's A < 0 token at r = 4 is no longer dual-clipped."""
    run = SimpleNamespace(loss_fn=get_policy_loss("aspo", dual_clip=5.0))
    out = CounterfactualWeights().compute(None, run, hand_step())
    default = CounterfactualWeights().compute(None, None, hand_step())
    # A > 0 token 3: |0.25 - 4| instead of |0.25 - 3|
    g, a = HAND_WEIGHTS["grpo"][0], HAND_WEIGHTS["aspo_no_dual_clip"][0]
    assert float(out["flip/weight_change"]) == pytest.approx((0.21 / 1.1 + 1.5 + 3.75) / 2.85, rel=change_rel(g, a), abs=0)
    assert float(out["flip/w_aspo_decile05"]) == pytest.approx(4.0, rel=WEIGHT_REL, abs=0)
    assert float(default["flip/w_aspo_decile05"]) == pytest.approx(3.0, rel=WEIGHT_REL, abs=0)
    with pytest.raises(ValueError, match="forced_entropy must be > 0"):
        CounterfactualWeights(forced_entropy=0.0)


def test_split_by_first_minibatch_is_each_part_alone():
    """``split_first_minibatch``: every flip/* value over row 0 (the first mini-batch) and over row 1
    is what the callback computes on a step of that row alone; the whole-batch values are unchanged."""
    step = dataclasses.replace(hand_step(entropy_shift=0.25), first_minibatch=torch.tensor([True, False]))
    out = CounterfactualWeights(split_first_minibatch=True).compute(None, None, step)
    whole = CounterfactualWeights().compute(None, None, step)
    assert len(out) == 3 * len(whole)
    for name, index in (("first_minibatch", 0), ("later_minibatches", 1)):
        alone = CounterfactualWeights().compute(None, None, hand_step(rows=HAND[index:index + 1],
                                                                      advantages=HAND_ADVANTAGES[index:index + 1],
                                                                      entropy_shift=0.25))
        for key, value in alone.items():
            got = float(out[key.replace("flip/", f"flip/{name}/", 1)])
            assert got == pytest.approx(float(value), rel=1e-6, abs=1e-12, nan_ok=True), (name, key)
    assert all(float(out[k]) == pytest.approx(float(v), rel=0, abs=0, nan_ok=True) for k, v in whole.items())
    assert out["flip/first_minibatch/weight_change"] != pytest.approx(out["flip/later_minibatches/weight_change"])
    with pytest.raises(ValueError, match="needs StepOutput.first_minibatch"):
        CounterfactualWeights(split_first_minibatch=True).compute(None, None, hand_step())


class HandStepModule(DummyModule):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        return hand_step()


def test_logged_through_a_trainer(tmp_path):
    """Every metric reaches the logger, once per rollout batch, as the callback computed it."""
    logged = last_logged(fit(tmp_path, [CounterfactualWeights()], module=HandStepModule()).log_dir)
    direct = CounterfactualWeights().compute(None, None, hand_step())
    assert len(direct) == 70
    for name, value in direct.items():
        if math.isnan(value):
            assert math.isnan(logged[name]), name
        else:   # logged as fp32: one rounding
            assert logged[name] == pytest.approx(float(value), rel=rounding_tol(torch.float32, 1), abs=0), name


# --------------------------------------------------------------------------- two ranks
def _rank_compute(rank: int, world_size: int) -> dict[str, float]:
    trainer = SimpleNamespace(world_size=world_size, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    step = hand_step(rows=[HAND[rank]], advantages=(HAND_ADVANTAGES[rank],))   # rank 0: A > 0 row; rank 1: A < 0
    return {k: float(v) for k, v in CounterfactualWeights().compute(trainer, None, step).items()}


@pytest.mark.slow        # ~25 s on 2 cores: spawning two processes that import torch
@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_two_ranks_log_what_one_process_logs():
    """Rank 0 holds the A > 0 row, rank 1 the A < 0 row: the sums add up, and the deciles, the rank
    correlation and the quantiles see both ranks' tokens (one rank alone would give other values)."""
    expected = {k: float(v) for k, v in CounterfactualWeights().compute(None, None, hand_step()).items()}
    results = on_ranks(_rank_compute)
    for rank in range(2):
        for name, value in expected.items():
            if math.isnan(value):
                assert math.isnan(results[rank][name]), (rank, name)
            else:   # float64 sums of O(1) terms in another order
                assert results[rank][name] == approx64(value, scale=10.0), (rank, name)
