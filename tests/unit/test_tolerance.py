"""The tolerance helpers (tests/helpers/tolerance.py): their bounds hold for real fp32 evaluations and are
crossed by real defects (a dropped term, a bf16 step, a wrong temperature)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.tolerance import (
    AS_ACCURATE_FACTOR,
    assert_as_accurate,
    assert_within,
    gamma,
    log_softmax_tol,
    reduction_tol,
    rounding_tol,
    underflow_tol,
    unit_roundoff,
)

pytestmark = pytest.mark.numerics


def test_unit_roundoff_and_gamma():
    assert unit_roundoff(torch.float32) == 2.0 ** -24 and unit_roundoff(torch.float64) == 2.0 ** -53
    assert unit_roundoff(torch.bfloat16) == 2.0 ** -8
    u = 2.0 ** -24
    assert gamma(10) == pytest.approx(10 * u / (1 - 10 * u), rel=1e-15) and gamma(0) == 0.0
    assert rounding_tol(torch.float32, 3, 2.0) == 2 * gamma(3)
    assert underflow_tol(torch.float32, 2) == 2 * 2.0 ** -150
    with pytest.raises(ValueError, match="n·u < 1"):
        gamma(2 ** 24)


@pytest.mark.parametrize("n", [2, 100, 4096])
def test_reduction_tol_bounds_two_orders_and_not_a_dropped_term(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)  # terms of many sizes: orders matter
    forward, backward = x.sum(), x.flip(0).cumsum(0)[-1]        # a vectorised sum, a sequential one
    exact = x.double().sum()
    magnitude = float(x.abs().double().sum())
    assert abs(float(forward) - float(backward)) <= reduction_tol(torch.float32, n, magnitude)
    assert abs(float(backward) - float(exact)) <= reduction_tol(torch.float32, n, magnitude, evaluations=1)
    largest = int(x.abs().argmax())
    dropped = torch.cat([x[:largest], x[largest + 1:]]).sum()  # a real defect: the largest term missing
    assert abs(float(dropped) - float(exact)) > reduction_tol(torch.float32, n, magnitude)


def _matmul_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 48, generator=g)
    return a, b, a.double() @ b.double()


def test_as_accurate_accepts_another_fp32_order_and_rejects_a_bf16_step():
    a, b, truth = _matmul_case()
    ref = a @ b
    other_order = sum(a[:, i::4] @ b[i::4] for i in range(4))  # the same products, summed in 4 strided parts
    assert_as_accurate(other_order, ref, truth)
    with pytest.raises(AssertionError, match="got - float64"):
        assert_as_accurate((a.bfloat16() @ b.bfloat16()).float(), ref, truth)
    with pytest.raises(AssertionError):  # an error of AS_ACCURATE_FACTOR + 1 times the reference's
        worst = (ref.double() - truth).abs().max().item()
        assert_as_accurate(ref + (AS_ACCURATE_FACTOR + 1) * max(worst, 1e-6), ref, truth)
    with pytest.raises(ValueError, match="float64"):
        assert_as_accurate(ref, ref, truth.float())
    with pytest.raises(ValueError, match="shapes"):
        assert_as_accurate(ref[:1], ref, truth)


def test_assert_within_elementwise_bounds_and_nan():
    want = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert_within(torch.tensor([1.1, 2.0, 3.3]), want, torch.tensor([0.2, 0.0, 0.31]))
    with pytest.raises(AssertionError, match="1 of 3 elements.*flat index 2"):
        assert_within(torch.tensor([1.1, 2.0, 3.4]), want, torch.tensor([0.2, 0.0, 0.31]))
    with pytest.raises(AssertionError, match="1 of 3"):
        assert_within(torch.tensor([1.0, float("nan"), 3.0]), want, 1.0)


@pytest.mark.parametrize("scale", [0.1, 3.0, 30.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_softmax_tol_holds_for_torch_and_not_for_a_wrong_temperature(scale, temperature):
    g = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(64, 50, generator=g) * scale
    labels = torch.randint(0, 50, (64,), generator=g)
    lp_tol, entropy_tol = log_softmax_tol(logits, temperature)
    exact = torch.log_softmax(logits.double() / temperature, -1)
    exact_lp, exact_entropy = exact.gather(-1, labels[:, None])[:, 0], -(exact.exp() * exact).sum(-1)
    fp32 = torch.log_softmax(logits / temperature, -1)
    assert_within(fp32.gather(-1, labels[:, None])[:, 0], exact_lp, lp_tol)
    assert_within(torch.logsumexp(logits / temperature, -1) - (fp32.exp() * logits / temperature).sum(-1),
                  exact_entropy, entropy_tol)
    wrong = torch.log_softmax(logits.double() / (temperature * 1.01), -1).gather(-1, labels[:, None])[:, 0]
    with pytest.raises(AssertionError):
        assert_within(wrong, exact_lp, lp_tol)
    assert lp_tol < 1e-3 * max(1.0, logits.abs().max().item() / temperature) and math.isfinite(entropy_tol)
