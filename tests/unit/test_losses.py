"""Policy losses against the paper's own formulas (Prop. 4.1, App. A.2, SPEC "Policy losses").

Every expected value here is written independently of aspo_lit.maths.losses: token weights from the
paper's definitions in float64, aggregation weights from eq. 1 / DAPO / Dr.GRPO, gradients compared
with autograd through the library. Bounds count the library's fp32 roundings (`ratio_rtol`,
tests/helpers/tolerance.py; docs/design.md, "Tolerances in tests"); exact results are compared exactly.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aspo_lit.maths.losses import (
    POLICY_LOSSES,
    PolicyLoss,
    agg_normalizer,
    aggregate,
    effective_token_weight,
    get_policy_loss,
    kl_penalty,
    register_policy_loss,
)
from tests.helpers.tolerance import gamma, reduction_tol, rounding_tol

pytestmark = pytest.mark.numerics

BUILTIN = ["grpo", "grpo_no_is", "grpo_pos_mean", "aspo", "aspo_no_dual_clip", "cispo", "gspo"]
AGGS = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
EPS_LOW, EPS_HIGH, C = 0.2, 0.28, 3.0  # ε_high ≠ ε_low so a swapped bound is caught
STAT_KEYS = {"clip/pos_high", "clip/neg_low", "clip/pos_dual", "clip/neg_dual", "ratio/pos_mean", "ratio/neg_mean"}


# ---------------------------------------------------------------------------------------------
# independent reference formulas

def agg_weight(mask: torch.Tensor, agg: str, norm_length: int | None = None) -> torch.Tensor:
    """∂loss/∂ℓ_t for each token, from the definitions of the three aggregation modes."""
    m = mask.double()
    lengths = m.sum(-1, keepdim=True)
    responses = max(int((lengths > 0).sum()), 1)
    if agg == "token-mean":                       # DAPO: 1 / #tokens
        return m / max(float(m.sum()), 1.0)
    if agg == "seq-mean-token-mean":              # eq. 1: 1/G Σ_i 1/|o_i| Σ_t
        return m / lengths.clamp_min(1) / responses
    length = norm_length or mask.shape[-1]        # Dr.GRPO: 1/G Σ_i 1/L Σ_t
    return m / (responses * length)


def reference_weight(name, log_ratio, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, c=C):
    """Token weight w with ∂ℓ_t/∂lp_t = -w·A, from SPEC "Policy losses" (float64)."""
    r = log_ratio.double().exp()
    pos, neg = adv > 0, adv < 0
    pos_high = pos & (r > 1 + eps_high)
    neg_low = neg & (r < 1 - eps_low)
    grpo_mask = ~(pos_high | neg_low | (neg & (r > c)))            # Prop. 4.1 m, with verl's dual clip
    if name == "grpo":
        w = grpo_mask * r
    elif name == "grpo_no_is":
        w = grpo_mask.double()
    elif name == "grpo_pos_mean":
        row_mean = (r * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)
        w = torch.where(pos, (~pos_high) * row_mean, grpo_mask * r)
    elif name in ("aspo", "aspo_no_dual_clip"):
        w = torch.where(pos, 1 / r, r)                                 # flipped for A > 0 (eq. 3)
        w = torch.where(pos_high | neg_low, 0.0, w)                    # step 1: hard mask
        if name == "aspo":
            w = torch.where(~(pos_high | neg_low) & (w > c), c, w)     # step 3: soft dual clip
    elif name == "cispo":
        w = r.clamp(1 - eps_low, 1 + eps_high)
    elif name == "gspo":
        seq = ((log_ratio.double() * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)).exp()
        seq = seq.expand_as(r)
        w = seq * ~((pos & (seq > 1 + eps_high)) | (neg & (seq < 1 - eps_low)))
    else:
        raise AssertionError(name)
    return torch.where(mask.bool() & (adv != 0), w.double(), 0.0)


def near_a_bound(log_ratio, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, c=C, tol=1e-3):
    """Tokens (or, for sequence ratios, rows) whose ratio sits within tol of a clip bound."""
    bounds = torch.tensor([1 - eps_low, 1 + eps_high, c, 1 / c], dtype=torch.float64)
    r = log_ratio.double().exp()
    seq = ((log_ratio.double() * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)).exp()
    token_near = ((r.unsqueeze(-1) / bounds - 1).abs() < tol).any(-1)
    row_near = ((seq.unsqueeze(-1) / bounds - 1).abs() < tol).any(-1).expand_as(r)
    return token_near | row_near


def ratio_rtol(log_ratio: torch.Tensor, mask: torch.Tensor) -> float:
    """Relative error of the library's fp32 token weight w, and of ∂loss/∂lp = -w·A·(aggregation weight),
    against float64 maths on the same fp32 log-ratio: exp (2 roundings), 1/r as exp(-log r), clamp or c
    (<= 1), ×A and the backward of the two aggregation divisions (3), a cast of either side (1): 8.
    GRPO-pos-mean's row mean of T ratios adds γ_T; GSPO's mean log-ratio is off by γ_T·max|log r|
    absolute, i.e. relative in its exp: T·(1 + max|log r|) roundings more covers both."""
    max_log_ratio = float(log_ratio.detach().abs().max()) if log_ratio.numel() else 0.0
    return rounding_tol(torch.float32, 8 + math.ceil(mask.shape[-1] * (1 + max_log_ratio)))


#: the hand-computed ASPO gradients: the library's ≤ 6 roundings (exp 2, ×A, the two aggregation
#: divisions' backward) and the test's own exp of r (2) in float64 otherwise
HAND_RTOL = rounding_tol(torch.float32, 8)


#: a share of exact integer counts (k of n tokens), rounded once to fp32
COUNT_REL = rounding_tol(torch.float32, 1)


def assert_near(actual, expected, rel=HAND_RTOL):
    assert float(actual) == pytest.approx(float(expected), rel=rel, abs=0)


def loss_magnitude(loss_fn, lp, old, adv, mask) -> float:
    """Σ_t |ℓ_t|·(aggregation weight): the absolute sum of the terms the loss adds up."""
    inputs = loss_fn.prepare_inputs(lp, old, adv, mask)
    per_token, _ = loss_fn.token_loss(*inputs, *loss_fn.token_eps(inputs[-1], None))
    return float(aggregate(per_token.detach().abs(), mask, loss_fn.loss_agg, norm_length=loss_fn.norm_length))


def loss_sum_roundings(mask) -> int:
    """Roundings any term of the aggregated loss passes through: the row sum (T - 1), /|o_i|, the sum of
    rows (B - 1), /normaliser, and up to 3 micro-batch totals added."""
    B, T = mask.shape
    return T + B + 3


def grad_wrt_logprobs(loss_fn, lp, old, adv, mask, **kw):
    lp = lp.detach().clone().requires_grad_(True)
    loss, stats = loss_fn(lp, old, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad, stats


def make_loss(name, **kw):
    return get_policy_loss(name, eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip=C, **kw)


def region_batch():
    """One token in every region of both signs (the ratio r chosen, lp = log 0.3 + log r)."""
    cases = [  # (A, r)
        (1.0, 0.15), (1.0, 0.5), (1.0, 0.9), (1.0, 1.1), (1.0, 1.5), (1.0, 6.0),     # A > 0
        (-1.0, 0.3), (-1.0, 0.9), (-1.0, 1.5), (-1.0, 2.5), (-1.0, 4.0), (-1.0, 9.0),  # A < 0
        (0.0, 2.0),
    ]
    adv = torch.tensor([a for a, _ in cases]).view(-1, 1) * 0.7
    log_ratio = torch.tensor([math.log(r) for _, r in cases]).view(-1, 1)
    old = torch.full_like(log_ratio, math.log(0.3))
    lp = old + log_ratio
    mask = torch.ones_like(lp)
    return lp, old, adv.view(-1), mask


# ---------------------------------------------------------------------------------------------
# Prop. 4.1 and App. A.2

@pytest.mark.parametrize("agg", AGGS)
def test_prop_4_1_grpo_gradient_is_weighted_log_likelihood(agg):
    lp, old, adv, mask = region_batch()
    _, grad, _ = grad_wrt_logprobs(make_loss("grpo", loss_agg=agg), lp, old, adv, mask)

    # J_WLL = Σ sg(m·r)·A·lp, aggregated the same way; loss = -J_WLL
    r = (lp - old).exp()
    a = adv.view(-1, 1)
    m = ((a >= 0) & (r <= 1 + EPS_HIGH)) | ((a < 0) & (r >= 1 - EPS_LOW) & (r <= C))
    lp_wll = lp.detach().clone().requires_grad_(True)
    j_wll = (agg_weight(mask, agg).float() * (m * r).detach() * a * lp_wll).sum()
    (grad_wll,) = torch.autograd.grad(-j_wll, lp_wll)
    # both fp32, each within ratio_rtol of the same maths; zero-weight tokens are exact zeros on both sides
    torch.testing.assert_close(grad, grad_wll, rtol=2 * ratio_rtol(lp - old, mask), atol=0)
    # each region behaves as the proof says: clipped and dual-clipped tokens get nothing
    active = grad.view(-1) != 0
    assert active.tolist() == [True, True, True, True, False, False,
                               False, True, True, True, False, False, False]


def test_app_a2_aspo_token_gradients():
    lp, old, adv, mask = region_batch()
    agg = "seq-mean-token-mean"
    _, grad, _ = grad_wrt_logprobs(make_loss("aspo", loss_agg=agg), lp, old, adv, mask)
    r = (lp - old).exp().view(-1).double()
    a = adv.double()
    w_agg = agg_weight(mask, agg).view(-1)
    g = grad.view(-1).double()
    # active positive tokens: (π_old/π)·A × aggregation weight
    for i in (1, 2, 3):
        assert_near(g[i], -w_agg[i] * a[i] / r[i])
    # 1/r = 1/0.15 > c: soft dual clip keeps the gradient at c·A
    assert_near(g[0], -w_agg[0] * C * a[0])
    # hard-masked tokens (A>0, r>1+ε_high; A<0, r<1-ε_low): no gradient
    assert g[4] == 0 and g[5] == 0 and g[6] == 0
    # negative tokens as GRPO (r·A) ...
    for i in (7, 8, 9):
        assert_near(g[i], -w_agg[i] * r[i] * a[i])
    # ... except the dual clip is soft: r > c keeps a c·A gradient instead of none
    for i in (10, 11):
        assert_near(g[i], -w_agg[i] * C * a[i])
    assert g[12] == 0


def test_app_a2_positive_aspo_weight_is_inverse_probability_ratio_in_pi():
    """The flipped gradient (π_old/π)·∇lp, checked through the probabilities themselves."""
    pi_old = torch.tensor([[0.9, 0.5, 0.05]])
    pi = torch.tensor([[0.8, 0.45, 0.045]])   # 1/r = 1.125, 1.111, 1.111: active, no dual clip
    adv = torch.tensor([1.0])
    mask = torch.ones_like(pi)
    lp = pi.log()
    _, grad, _ = grad_wrt_logprobs(make_loss("aspo", loss_agg="token-mean"), lp, pi_old.log(), adv, mask)
    # the library's exp(old - lp) from fp32 logs: each log off by 2u·|log p| (<= 3.1 here), the difference and
    # exp 3u more, then ×A, /3; the test's quotient and /3: (2·(3.1 + 3.0) + 7) = 19.2 roundings
    torch.testing.assert_close(grad, -(pi_old / pi) / 3, rtol=rounding_tol(torch.float32, 20), atol=0)


def test_aspo_no_dual_clip_has_no_cap():
    lp, old, adv, mask = region_batch()
    agg = "token-mean"
    _, grad, stats = grad_wrt_logprobs(make_loss("aspo_no_dual_clip", loss_agg=agg), lp, old, adv, mask)
    r = (lp - old).exp().view(-1).double()
    w_agg = agg_weight(mask, agg).view(-1)
    g = grad.view(-1).double()
    assert_near(g[0], -w_agg[0] * adv[0] / r[0])    # 1/r = 6.67 > c, uncapped
    assert_near(g[10], -w_agg[10] * r[10] * adv[10])  # r = 4 > c, uncapped
    assert float(stats["clip/pos_dual"]) == 0 and float(stats["clip/neg_dual"]) == 0


def test_aspo_forward_values():
    """Value of each ASPO term: -A/r (flipped), -c·A·lp (soft dual clip), constants when masked."""
    lp, old, adv, mask = region_batch()
    loss_fn = make_loss("aspo", loss_agg="token-mean")
    inputs = loss_fn.prepare_inputs(lp, old, adv, mask)
    per_token, _ = loss_fn.token_loss(*inputs, *loss_fn.token_eps(inputs[-1], None))
    r = (lp - old).exp().view(-1)
    a = adv
    v = per_token.view(-1)
    # fp32 on both sides, <= 8 roundings in all: the library's log1p (2), exp (2) and products, the test's
    # fp32 constant, exp or quotient and product
    tol = dict(rtol=rounding_tol(torch.float32, 8), atol=0)
    torch.testing.assert_close(v[1:4], -a[1:4] / r[1:4], **tol)
    torch.testing.assert_close(v[0], -C * a[0] * lp.view(-1)[0], **tol)
    torch.testing.assert_close(v[10:12], -C * a[10:12] * lp.view(-1)[10:12], **tol)
    torch.testing.assert_close(v[7:10], -a[7:10] * r[7:10], **tol)
    torch.testing.assert_close(v[4:6], -a[4:6] / (1 + EPS_HIGH), **tol)     # hard-masked: the flipped bound
    torch.testing.assert_close(v[6], -a[6] * (1 - EPS_LOW), **tol)


@pytest.mark.parametrize("name", ["grpo_no_is", "grpo_pos_mean", "cispo", "gspo", "aspo", "aspo_no_dual_clip", "grpo"])
@pytest.mark.parametrize("agg", AGGS)
def test_gradients_match_spec_definitions(name, agg):
    torch.manual_seed(1)
    B, T = 5, 7
    old = torch.randn(B, T) * 0.5 - 1.5
    lp = old + torch.empty(B, T).uniform_(-1.8, 1.8)
    adv = torch.tensor([1.3, -0.7, 0.0, 0.4, -2.0])
    mask = torch.ones(B, T)
    mask[0, 5:] = 0
    mask[3, 2:] = 0
    _, grad, _ = grad_wrt_logprobs(make_loss(name, loss_agg=agg), lp, old, adv, mask)
    w = reference_weight(name, lp - old, adv.view(-1, 1), mask)
    expected = -agg_weight(mask, agg) * w * adv.view(-1, 1).double()
    keep = ~near_a_bound(lp - old, mask)
    # zero-weight tokens (clipped, A = 0) are exact zeros on both sides
    torch.testing.assert_close(grad.double()[keep], expected[keep], rtol=ratio_rtol(lp - old, mask), atol=0)


def test_grpo_pos_mean_uses_response_mean_ratio():
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    ratios = torch.tensor([[0.7, 1.0, 1.1, 1.5]])       # last token padded: excluded from the mean
    old = lp - ratios.log()
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([2.0])
    weight = effective_token_weight(make_loss("grpo_pos_mean"), lp, old, adv, mask)
    expected = torch.tensor([[2.8 / 3] * 3 + [0.0]], dtype=torch.float64)
    # each r = exp(lp - (lp - log r)) from fp32 values: log (2u·|log r| <= 0.9u), the two subtractions
    # (u·|lp| each, <= 1.1u), exp (2u); then the sum of 3, /3, ×A and /A of effective_token_weight: < 16
    torch.testing.assert_close(weight.double(), expected, rtol=rounding_tol(torch.float32, 16), atol=0)


# ---------------------------------------------------------------------------------------------
# numerics

@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("gap", [50.0, -50.0])
def test_extreme_log_ratio_is_finite(name, gap):
    old = torch.full((2, 3), -1.0)
    lp = old + gap
    adv = torch.tensor([1.0, -1.0])
    loss, grad, stats = grad_wrt_logprobs(make_loss(name), lp, old, adv, torch.ones(2, 3))
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(torch.as_tensor(v.value)) for v in stats.values())


def test_extreme_lagging_positive_token_keeps_capped_gradient_in_aspo():
    """lp - old = -50 on A>0: 1/r is astronomically large, ASPO's soft dual clip gives c·A."""
    old = torch.zeros(1, 1)
    lp = old - 50
    _, grad, stats = grad_wrt_logprobs(make_loss("aspo", loss_agg="token-mean"), lp, old, torch.tensor([0.5]),
                                       torch.ones(1, 1))
    assert grad.item() == -C * 0.5  # c·A·(1/1 token): products of small dyadic numbers, exact
    assert float(stats["clip/pos_dual"]) == 1


@pytest.mark.parametrize("name", BUILTIN)
def test_bf16_inputs_use_fp32_maths(name):
    torch.manual_seed(2)
    old = (torch.randn(3, 8) - 1).bfloat16()
    lp = (old.float() + torch.randn(3, 8) * 0.3).bfloat16()
    adv = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.ones(3, 8)
    loss_fn = make_loss(name)
    loss_bf16, _ = loss_fn(lp, old, adv, mask)
    loss_fp32, _ = loss_fn(lp.float(), old.float(), adv, mask)
    assert loss_bf16.dtype == torch.float32
    assert torch.equal(loss_bf16, loss_fp32)  # bf16 -> fp32 is exact: the same fp32 maths, the same bits


# ---------------------------------------------------------------------------------------------
# aggregation and micro-batching

def random_batch(seed, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g) * 0.5 - 1.0
    lp = old + torch.empty(B, T).uniform_(-1.5, 1.5, generator=g)
    adv = torch.randn(B, generator=g)
    lengths = torch.tensor([9, 3, 1, 6, 0, 7])[:B]
    mask = (torch.arange(T) < lengths.view(-1, 1)).float()
    return lp, old, adv, mask


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("agg", AGGS)
def test_micro_batch_accumulation_equals_whole_batch(name, agg):
    lp, old, adv, mask = random_batch(3)
    loss_fn = make_loss(name, loss_agg=agg)
    full_loss, full_grad, _ = grad_wrt_logprobs(loss_fn, lp, old, adv, mask)

    normalizer = agg_normalizer(mask, agg)
    lp_leaf = lp.detach().clone().requires_grad_(True)
    total = 0.0
    for rows in ([0, 1], [2, 3, 4], [5]):
        micro_len = max(int(mask[rows].sum(-1).max()), 1)        # each micro-batch re-padded to its own T
        micro = [x[rows][:, :micro_len] for x in (lp_leaf, old, mask)]
        loss, _ = loss_fn(micro[0], micro[1], adv[rows], micro[2], normalizer=normalizer)
        loss.backward()
        total = total + loss.detach()
    # two fp32 orders of one sum, and GSPO / pos-mean row means over other widths (ratio_rtol per term, twice)
    rtol = ratio_rtol(lp - old, mask)
    magnitude = loss_magnitude(loss_fn, lp, old, adv, mask)
    atol = reduction_tol(torch.float32, loss_sum_roundings(mask), magnitude) + 2 * rtol * magnitude
    torch.testing.assert_close(total, full_loss.detach(), rtol=0, atol=atol)
    torch.testing.assert_close(lp_leaf.grad, full_grad, rtol=2 * rtol, atol=0)


@pytest.mark.parametrize("agg", AGGS)
def test_plain_call_normalises_over_exactly_its_tensors(agg):
    """With lp = old and no clipping, ℓ_t = -A: the loss is the aggregation of -A by definition."""
    lp, _, adv, mask = random_batch(4)
    for rows in ([0, 1], [2, 3, 4, 5], list(range(6))):
        micro_mask = mask[rows]
        loss, _ = make_loss("grpo", loss_agg=agg)(lp[rows], lp[rows], adv[rows], micro_mask)
        weighted = agg_weight(micro_mask, agg) * adv[rows].double().view(-1, 1)
        expected = -weighted.sum()
        # r = exp(0) = 1 exactly, so ℓ_t = -A exactly: only the fp32 sum rounds, against float64
        atol = reduction_tol(torch.float32, loss_sum_roundings(micro_mask), float(weighted.abs().sum()), evaluations=1)
        assert loss.item() == pytest.approx(expected.item(), rel=0, abs=atol)


def test_seq_mean_token_sum_norm_uses_norm_length_constant():
    lp, _, adv, mask = random_batch(5)
    loss, _ = make_loss("grpo", loss_agg="seq-mean-token-sum-norm", norm_length=100)(lp, lp, adv, mask)
    weighted = agg_weight(mask, "seq-mean-token-sum-norm", norm_length=100) * adv.double().view(-1, 1)
    atol = reduction_tol(torch.float32, loss_sum_roundings(mask), float(weighted.abs().sum()), evaluations=1)
    assert loss.item() == pytest.approx(-weighted.sum().item(), rel=0, abs=atol)  # ℓ_t = -A exactly, as above


def test_all_padding_batch_gives_zero_loss_not_nan():
    for agg in AGGS:
        loss, stats = make_loss("aspo", loss_agg=agg)(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2),
                                                       torch.zeros(2, 3))
        assert loss.item() == 0 and all(torch.isfinite(torch.as_tensor(v.value)) for v in stats.values())


def test_aggregate_and_normalizer_directly():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # small integers, sums and quotients exactly representable: exact; 10/6 is rounded once
    assert aggregate(per_token, mask, "token-mean").item() == 10 / 4
    assert aggregate(per_token, mask, "seq-mean-token-mean").item() == (2 + 4) / 2
    assert aggregate(per_token, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3), rel=COUNT_REL)
    assert aggregate(per_token, mask, "token-mean", normalizer=8.0).item() == 10 / 8
    assert agg_normalizer(mask, "seq-mean-token-sum-norm", norm_length=10).item() == 20


# ---------------------------------------------------------------------------------------------
# property tests

@st.composite
def batches(draw):
    B = draw(st.integers(1, 5))
    T = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))           # 0: empty row
    signs = draw(st.lists(st.sampled_from([-1.0, 0.0, 1.0]), min_size=B, max_size=B))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.sampled_from([0.1, 1.0, 3.0]))
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g) - 1.0
    lp = old + torch.empty(B, T).uniform_(-spread, spread, generator=g)
    magnitude = torch.rand(B, generator=g) + 0.1
    adv = torch.tensor(signs) * magnitude
    mask = (torch.arange(T) < torch.tensor(lengths).view(-1, 1)).float()
    return lp, old, adv, mask


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), name=st.sampled_from(BUILTIN), agg=st.sampled_from(AGGS))
def test_property_gradient_matches_reference(batch, name, agg):
    lp, old, adv, mask = batch
    loss, grad, stats = grad_wrt_logprobs(make_loss(name, loss_agg=agg), lp, old, adv, mask)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    expected = -agg_weight(mask, agg) * reference_weight(name, lp - old, adv.view(-1, 1), mask) * adv.view(-1, 1)
    keep = ~near_a_bound(lp - old, mask)
    torch.testing.assert_close(grad.double()[keep], expected[keep], rtol=ratio_rtol(lp - old, mask), atol=0)
    assert (grad[mask == 0] == 0).all()


@settings(max_examples=25, deadline=None)
@given(batch=batches(), name=st.sampled_from(BUILTIN))
def test_property_stats(batch, name):
    lp, old, adv, mask = batch
    _, stats = make_loss(name)(lp, old, adv, mask)
    assert set(stats) == STAT_KEYS
    assert all(v.reduce == "mean" and not v.value.requires_grad and v.value.dtype == torch.float32
               and v.value.dim() == 0 for v in stats.values())
    pos = (adv.view(-1, 1) > 0) & (mask > 0)
    neg = (adv.view(-1, 1) < 0) & (mask > 0)
    for key in ("clip/pos_high", "clip/pos_dual", "ratio/pos_mean"):   # each weighed by its sign's tokens
        assert float(stats[key].weight) == pos.sum()
    for key in ("clip/neg_low", "clip/neg_dual", "ratio/neg_mean"):
        assert float(stats[key].weight) == neg.sum()
    for key in ("clip/pos_high", "clip/neg_low", "clip/pos_dual", "clip/neg_dual"):
        assert 0 <= float(stats[key]) <= 1
    r = (lp - old).exp()
    if name == "gspo":  # its ratio is the response's sequence ratio (the one it clips)
        r = (((lp - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)).exp().expand_as(r)
    expected_pos_mean = r[pos].mean().item() if pos.any() else 0.0
    # two fp32 means of the same positive ratios (each ratio within ratio_rtol: GSPO's row means may round
    # otherwise), each within γ_{n+1} of the exact mean
    rel = 2 * gamma(int(pos.sum()) + 1) + 2 * ratio_rtol(lp - old, mask)
    assert float(stats["ratio/pos_mean"]) == pytest.approx(expected_pos_mean, rel=rel, abs=0)
    if name == "grpo" and neg.any():
        expected = ((r < 1 - EPS_LOW) & neg).sum() / neg.sum()
        assert float(stats["clip/neg_low"]) == pytest.approx(expected.item(), rel=COUNT_REL, abs=0)


@settings(max_examples=15, deadline=None)
@given(batch=batches(), name=st.sampled_from(BUILTIN), agg=st.sampled_from(AGGS),
       split=st.integers(1, 4))
def test_property_micro_batch_accumulation(batch, name, agg, split):
    lp, old, adv, mask = batch
    loss_fn = make_loss(name, loss_agg=agg)
    _, full_grad, _ = grad_wrt_logprobs(loss_fn, lp, old, adv, mask)
    normalizer = agg_normalizer(mask, agg)
    lp_leaf = lp.detach().clone().requires_grad_(True)
    for rows in torch.arange(lp.shape[0]).split(split):
        loss, _ = loss_fn(lp_leaf[rows], old[rows], adv[rows], mask[rows], normalizer=normalizer)
        loss.backward()
    # per token, only GSPO's / pos-mean's row means can round otherwise (as in the micro-batch test above)
    torch.testing.assert_close(lp_leaf.grad, full_grad, rtol=2 * ratio_rtol(lp - old, mask), atol=0)


# ---------------------------------------------------------------------------------------------
# stats on a hand-made batch

def test_stats_by_hand():
    ratios = torch.tensor([[1.5, 1.0, 0.2, 1.0], [0.5, 4.0, 1.0, 1.0]])
    old = torch.full_like(ratios, -1.0)
    lp = old + ratios.log()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    _, aspo = make_loss("aspo")(lp, old, adv, mask)
    assert float(aspo["clip/pos_high"]) == pytest.approx(1 / 3, rel=COUNT_REL)    # r = 1.5
    assert float(aspo["clip/pos_dual"]) == pytest.approx(1 / 3, rel=COUNT_REL)    # 1/r = 5 > c
    assert float(aspo["clip/neg_low"]) == 1 / 4     # r = 0.5 (1 of 4: exact)
    assert float(aspo["clip/neg_dual"]) == 1 / 4    # r = 4 > c
    # each r = exp((-1 + log r) + 1) in fp32: log (2u·|log r| <= 3.2u), two roundings of |lp| <= 2.7 (5.4u),
    # exp (2u); then a sum of 3-4 and a division: < 16 roundings
    rel = rounding_tol(torch.float32, 16)
    assert float(aspo["ratio/pos_mean"]) == pytest.approx((1.5 + 1.0 + 0.2) / 3, rel=rel, abs=0)
    assert float(aspo["ratio/neg_mean"]) == pytest.approx((0.5 + 4 + 1 + 1) / 4, rel=rel, abs=0)
    assert float(aspo["clip/pos_high"].weight) == 3 and float(aspo["clip/neg_low"].weight) == 4
    _, grpo = make_loss("grpo")(lp, old, adv, mask)
    assert float(grpo["clip/pos_dual"]) == 0 and float(grpo["clip/neg_dual"]) == 1 / 4


# ---------------------------------------------------------------------------------------------
# effective token weight and the entropy-dependent ε

def test_effective_token_weight():
    lp, old, adv, mask = region_batch()
    mask[2] = 0
    r = (lp - old).exp()
    for name in BUILTIN:
        w = effective_token_weight(make_loss(name), lp, old, adv, mask)
        expected = reference_weight(name, lp - old, adv.view(-1, 1), mask).float()
        torch.testing.assert_close(w, expected, rtol=ratio_rtol(lp - old, mask), atol=0)  # zeros are exact zeros
        assert w[2] == 0 and w[12] == 0          # masked; A = 0
    w_grpo = effective_token_weight(make_loss("grpo"), lp, old, adv, mask)
    # Prop. 4.1: w = m·r; -(-A·r)/A from the same fp32 r: two roundings
    assert w_grpo[1].item() == pytest.approx(r[1].item(), rel=rounding_tol(torch.float32, 2), abs=0)


def test_entropy_dependent_eps():
    # one response; the last real token is the only one above the 80th entropy percentile
    entropy = torch.tensor([[0.1, 0.2, 0.3, 0.4, 5.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])       # padded tokens must not move the percentile
    old = torch.full((1, 7), -1.0)
    lp = old + math.log(1.3)                             # r = 1.3: above 1.2, below 1.4
    adv = torch.tensor([1.0])
    loss_fn = get_policy_loss("grpo", eps_high_entropy=0.4, entropy_quantile=0.8)
    w = effective_token_weight(loss_fn, lp, old, adv, mask, entropy=entropy)
    # r = exp(fl(-1 + fl(log 1.3)) + 1) (the last subtraction exact by Sterbenz): 2 roundings, exp 2, then ×A and
    # /A, and fp32's 1.3: < 8; the zeros are exact
    torch.testing.assert_close(w, torch.tensor([[0, 0, 0, 0, 1.3, 0, 0]]), rtol=rounding_tol(torch.float32, 8), atol=0)
    _, stats = loss_fn(lp, old, adv, mask, entropy=entropy)
    assert float(stats["clip/pos_high"]) == pytest.approx(4 / 5, rel=COUNT_REL)
    with pytest.raises(ValueError, match="entropy"):
        loss_fn(lp, old, adv, mask)


# ---------------------------------------------------------------------------------------------
# KL

def test_kl_penalty_kinds():
    lp = torch.tensor([[-1.0, -2.0, -0.5, -30.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5, -1.0]])
    d = ref - lp.detach()
    # the same fp32 operations on the same values as the library's (-(ref - lp) = lp - ref exactly): the same bits
    assert torch.equal(kl_penalty(lp, ref, "k1"), lp.detach() - ref)
    assert torch.equal(kl_penalty(lp, ref, "kl"), lp.detach() - ref)
    assert torch.equal(kl_penalty(lp, ref, "k2"), 0.5 * (lp.detach() - ref) ** 2)
    assert torch.equal(kl_penalty(lp, ref, "mse"), 0.5 * (lp.detach() - ref) ** 2)
    k3 = kl_penalty(lp, ref, "k3")
    expected = (d.exp() - d - 1).clamp(-10, 10)
    assert torch.equal(k3, expected)
    assert torch.equal(kl_penalty(lp, ref, "low_var_kl"), expected)
    assert k3[0, 3] == 10 and k3[0, 2] == 0
    k3.sum().backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 3] == 0
    huge = kl_penalty(torch.tensor([[-500.0]], requires_grad=True), torch.tensor([[0.0]]))
    assert huge.item() == 10


# ---------------------------------------------------------------------------------------------
# registry

def test_registry_has_builtins_and_classes():
    for name in BUILTIN:
        assert issubclass(POLICY_LOSSES[name], PolicyLoss)
        assert isinstance(get_policy_loss(name), POLICY_LOSSES[name])


def test_user_registered_function_loss():
    @register_policy_loss("test_scaled_reinforce")
    def scaled_reinforce(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, scale=1.0):
        return -scale * advantages * logprobs

    try:
        loss_fn = get_policy_loss("test_scaled_reinforce", scale=2.0, loss_agg="token-mean")
        lp, old, adv, mask = random_batch(6)
        loss, stats = loss_fn(lp, old, adv, mask)
        expected = -(2.0 * adv.view(-1, 1) * lp * mask).sum() / mask.sum()
        # two fp32 token-mean sums of the same products (2 roundings each before the sum)
        magnitude = float((2.0 * adv.view(-1, 1) * lp * mask).abs().sum() / mask.sum())
        assert loss.item() == pytest.approx(expected.item(), rel=0,
                                            abs=reduction_tol(torch.float32, loss_sum_roundings(mask) + 2, magnitude))
        assert set(stats) == STAT_KEYS
        # scale 1 against 2: half the loss, far outside any rounding
        assert get_policy_loss("test_scaled_reinforce")(lp, old, adv, mask)[0].item() != pytest.approx(loss.item(), rel=0.1)
        with pytest.raises(ValueError, match="scale"):
            get_policy_loss("test_scaled_reinforce", temperature=2.0)
        assert scaled_reinforce.loss_class is POLICY_LOSSES["test_scaled_reinforce"]
    finally:
        POLICY_LOSSES.pop("test_scaled_reinforce", None)


def test_user_registered_class_loss():
    @register_policy_loss("test_clip_only")
    class ClipOnly(PolicyLoss):
        def __init__(self, weight: float = 1.0, **kw):
            super().__init__(**kw)
            self.weight = weight

        def token_loss(self, logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
            ratio = self.log_ratio(logprobs, old_logprobs).exp()
            return -self.weight * ratio * advantages, {"clip/pos_high": ratio > 1 + eps_high}

    try:
        loss_fn = get_policy_loss("test_clip_only", weight=3.0, eps_high=0.1)
        lp, old, adv, mask = random_batch(7)
        _, grad, stats = grad_wrt_logprobs(loss_fn, lp, old, adv, mask)
        r = (lp - old).exp()
        expected = -agg_weight(mask, "seq-mean-token-mean") * 3.0 * r.double() * adv.view(-1, 1)
        torch.testing.assert_close(grad.double(), expected, rtol=ratio_rtol(lp - old, mask), atol=0)
        assert 0 <= float(stats["clip/pos_high"]) <= 1
    finally:
        POLICY_LOSSES.pop("test_clip_only", None)


# ---------------------------------------------------------------------------------------------
# bad input

def test_unknown_names_list_valid_choices():
    with pytest.raises(ValueError, match=r"policy loss 'nope'.*aspo.*grpo"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match=r"loss_agg 'mean'.*seq-mean-token-mean.*token-mean"):
        get_policy_loss("aspo", loss_agg="mean")
    with pytest.raises(ValueError, match=r"loss_agg 'mean'.*token-mean"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "mean")
    with pytest.raises(ValueError, match=r"KL kind 'k4'.*k1.*k3.*low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    with pytest.raises(ValueError, match=r"hparam.*'clip'.*eps_low"):
        get_policy_loss("grpo", clip=0.2)
    with pytest.raises(ValueError, match="dual_clip"):
        get_policy_loss("aspo", dual_clip=0.5)


def test_bad_shapes_and_values():
    loss_fn = get_policy_loss("aspo")
    lp, old, mask, adv = torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2)
    with pytest.raises(ValueError, match="old_logprobs"):
        loss_fn(lp, torch.zeros(2, 4), adv, mask)
    with pytest.raises(ValueError, match="mask"):
        loss_fn(lp, old, adv, torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"advantages.*\[B\]"):
        loss_fn(lp, old, torch.ones(3), mask)
    with pytest.raises(ValueError, match="logprobs"):
        loss_fn(torch.zeros(6), old, adv, mask)
    with pytest.raises(ValueError, match="mask"):
        loss_fn(lp, old, adv, torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty(lp, torch.zeros(1, 3))
    for bad in (float("nan"), float("inf")):
        poisoned = lp.clone()
        poisoned[1, 2] = bad
        with pytest.raises(ValueError, match="^logprobs"):
            loss_fn(poisoned, old, adv, mask)
        with pytest.raises(ValueError, match="old_logprobs"):
            loss_fn(lp, poisoned, adv, mask)
        with pytest.raises(ValueError, match="advantages"):
            loss_fn(lp, old, torch.tensor([1.0, bad]), mask)
    with pytest.raises(ValueError, match="normalizer"):
        loss_fn(lp, old, adv, mask, normalizer=float("nan"))


# ---------------------------------------------------------------------------------------------
# a user loss's own statistics, and naming a user's loss

def test_user_statistics_are_kept_with_their_weights():
    """Statistics a loss adds are reduced, not dropped: a [B, T] tensor as its mean over the
    response tokens, a Stat as it declares itself; clip flags as shares of their sign's tokens."""
    from aspo_lit.maths.stats import Stat

    class Flagging(PolicyLoss):
        def token_loss(self, logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
            ratio = self.log_ratio(logprobs, old_logprobs).exp()
            return -ratio * advantages, {"clip/pos_high": ratio > 1 + eps_high, "large_ratio": ratio > 1.0,
                                         "position_mean": torch.arange(mask.shape[1]).float().expand_as(mask),
                                         "user/flagged_count": Stat.sum((ratio > 1.0)[mask].sum())}

    ratios = torch.tensor([[1.5, 1.0, 0.2, 1.0], [0.5, 4.0, 1.0, 1.0]])
    old = torch.full_like(ratios, -1.0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    _, stats = Flagging(eps_high=0.2)(old + ratios.log(), old, torch.tensor([1.0, -1.0]), mask)
    # shares and means of small integers: exact sums, one rounding in the division
    assert float(stats["large_ratio"]) == pytest.approx(2 / 7, rel=COUNT_REL) and float(stats["large_ratio"].weight) == 7
    assert float(stats["position_mean"]) == pytest.approx((0 + 1 + 2 + 0 + 1 + 2 + 3) / 7, rel=COUNT_REL)
    assert stats["user/flagged_count"].reduce == "sum" and float(stats["user/flagged_count"]) == 2
    assert float(stats["clip/pos_high"]) == pytest.approx(1 / 3, rel=COUNT_REL)      # of the 3 A > 0 tokens
    assert Flagging().stat_reductions() == {**dict.fromkeys(STAT_KEYS, "mean"), "large_ratio": "mean",
                                            "position_mean": "mean", "user/flagged_count": "sum"}


def test_ratio_is_the_one_the_loss_clamps():
    lp, old = torch.tensor([[30.0, 0.5]]), torch.zeros(1, 2)
    ratio = get_policy_loss("aspo", clamp_log_ratio=20.0).ratio(lp, old, torch.ones(1, 2))
    exp_rel = rounding_tol(torch.float32, 2)  # exact log-ratios (clamped to 20, 0.5), then one fp32 exp (1 ulp)
    assert ratio.tolist()[0] == pytest.approx([math.exp(20.0), math.exp(0.5)], rel=exp_rel, abs=0)
    seq = get_policy_loss("gspo").ratio(lp, old, torch.tensor([[0, 1]]))
    # its sequence ratio (of the one real token: the mean 0.5 / 1 is exact)
    assert seq.tolist()[0] == pytest.approx([math.exp(0.5), math.exp(0.5)], rel=exp_rel, abs=0)


def test_loss_named_by_import_path_or_entry_point(tmp_path, monkeypatch):
    """A user's loss needs no registration: an import path, or an installed package's entry point
    of the `aspo_lit.maths.losses` group, names it (as `--model.loss=...` does)."""
    package = tmp_path / "site" / "userlosses"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from aspo_lit.maths.losses import GRPOLoss\n\n"
        "class Halved(GRPOLoss):\n"
        "    def token_loss(self, *args):\n"
        "        per_token, flags = super().token_loss(*args)\n"
        "        return 0.5 * per_token, flags\n")
    dist = tmp_path / "site" / "userlosses-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: userlosses\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[aspo_lit.maths.losses]\nhalved = userlosses:Halved\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    lp, old, adv, mask = random_batch(5)
    full = get_policy_loss("grpo", eps_high=0.3)(lp, old, adv, mask)[0]
    for name in ("userlosses:Halved", "userlosses.Halved", "halved"):
        loss_fn = get_policy_loss(name, eps_high=0.3)
        assert type(loss_fn).__name__ == "Halved" and loss_fn.eps_high == 0.3, name
        assert loss_fn(lp, old, adv, mask)[0].item() == 0.5 * full.item(), name  # × 0.5 commutes with every rounding
    with pytest.raises(ValueError, match="installed entry points: halved"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match="not a PolicyLoss"):
        get_policy_loss("aspo_lit.maths.losses:aggregate")
    with pytest.raises(ValueError, match="cannot import 'no_such_package.losses'"):
        get_policy_loss("no_such_package.losses:X")
