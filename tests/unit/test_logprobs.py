"""Chunked log-probs and entropy against the naive full-vocabulary computation.

The naive reference runs in float64 on the same logits; the fp32 chunked values must lie within
the a-priori bound of `tests.helpers.tolerance.log_softmax_tol` (docs/design.md, "Tolerances in tests")."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aspo_lit.maths.logprobs import logprobs_and_entropy, token_entropy, token_logprobs
from tests.helpers.tolerance import assert_within, log_softmax_tol, rounding_tol

pytestmark = pytest.mark.numerics


def naive(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def sample(B=3, T=7, V=50, seed=0, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * scale).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    return logits, labels


def assert_near_naive(lp, entropy, logits, labels, temperature=1.0):
    """Within the first-order fp32 bound of `log_softmax_tol` of the float64 maths on the same logits."""
    ref_lp, ref_entropy = naive(logits, labels, temperature)
    lp_tol, entropy_tol = log_softmax_tol(logits, temperature)
    assert_within(lp, ref_lp, lp_tol, name="lp")
    assert_within(entropy, ref_entropy, entropy_tol, name="entropy")


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 21, 4096])
def test_chunked_equals_naive(chunk_size):
    logits, labels = sample()
    lp, entropy = logprobs_and_entropy(logits, labels, chunk_size=chunk_size)
    assert lp.dtype == entropy.dtype == torch.float32
    assert_near_naive(lp, entropy, logits, labels)
    # the same chunks through the same chunk_forward: the same bits
    assert torch.equal(token_logprobs(logits, labels, chunk_size), lp)
    assert torch.equal(token_entropy(logits, chunk_size), entropy)


def test_temperature_divides_logits():
    logits, labels = sample(seed=1)
    lp, entropy = logprobs_and_entropy(logits, labels, chunk_size=4, temperature=0.6)
    assert_near_naive(lp, entropy, logits, labels, temperature=0.6)


def test_bf16_logits_with_fp32_maths():
    logits, labels = sample(seed=2, dtype=torch.bfloat16)
    lp, entropy = logprobs_and_entropy(logits, labels, chunk_size=3)
    assert lp.dtype == torch.float32
    assert_near_naive(lp, entropy, logits.float(), labels)   # the same bf16 values, float64 maths


def test_entropy_of_uniform_and_one_hot():
    V = 64
    uniform = torch.zeros(1, 2, V)
    peaked = torch.full((1, 1, V), -1e4)
    peaked[..., 3] = 0
    # uniform: S = V exactly and Σ softmax·z = 0, so H = fl(log V): one log, within 1 ulp (2u relative)
    assert_within(token_entropy(uniform, 1), torch.full((1, 2), math.log(V), dtype=torch.float64),
                  rounding_tol(torch.float32, 2, math.log(V)))
    # one-hot: exp(-1e4) underflows to exactly 0, so S = 1, log Z = 0 and Σ softmax·z = 0: H is exactly 0
    assert torch.equal(token_entropy(peaked, 1), torch.zeros(1, 1))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradient_equals_naive(temperature):
    logits, labels = sample(seed=3)
    weights = torch.randn(labels.shape, dtype=torch.float64)
    x = logits.double().requires_grad_(True)
    lp, _ = logprobs_and_entropy(x, labels, chunk_size=4, temperature=temperature)
    (grad,) = torch.autograd.grad((lp * weights).sum(), x)
    x_ref = logits.double().requires_grad_(True)
    ref_lp, _ = naive(x_ref, labels, temperature)
    (ref_grad,) = torch.autograd.grad((ref_lp * weights).sum(), x_ref)
    # the chunked maths is fp32 whatever the logits' dtype: (onehot - softmax)·w/τ with softmax = exp(z - log Z)
    # off by <= lp's bound (relative, as softmax <= 1), w stored in fp32, then ×, +, /τ: 4 roundings of |g| <= |w|/τ
    lp_tol, _ = log_softmax_tol(logits, temperature)
    scale = weights.abs().max().item() / temperature
    assert_within(grad, ref_grad, scale * (lp_tol + rounding_tol(torch.float32, 4)), name="grad")


def test_gradient_in_bf16_keeps_dtype():
    logits, labels = sample(seed=4, dtype=torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    token_logprobs(x, labels, chunk_size=2).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    x_ref = logits.float().requires_grad_(True)
    naive(x_ref, labels)[0].sum().backward()
    # onehot - softmax in fp32 (softmax off by <= lp's bound), then stored in bf16 (one rounding, u = 2**-8);
    # the reference's float64 gradient stored in fp32 (one rounding) plus the softmax's relative 2u
    lp_tol, _ = log_softmax_tol(logits.float())
    torch.testing.assert_close(x.grad.float(), x_ref.grad,
                               rtol=rounding_tol(torch.bfloat16, 1) + rounding_tol(torch.float32, 3), atol=lp_tol)


def test_non_contiguous_logits_slice():
    """The usual call: logits[:, P-1:-1] of a [B, P+T, V] model output (a strided view)."""
    logits, labels = sample(B=2, T=10, seed=5)
    view = logits[:, 2:-1]
    assert not view.is_contiguous()
    lp, entropy = logprobs_and_entropy(view, labels[:, 2:-1], chunk_size=3)
    assert_near_naive(lp, entropy, view, labels[:, 2:-1])


def test_entropy_is_detached_and_optional():
    logits, labels = sample(seed=6)
    x = logits.requires_grad_(True)
    lp, entropy = logprobs_and_entropy(x, labels, chunk_size=4)
    assert lp.requires_grad and not entropy.requires_grad
    assert logprobs_and_entropy(x, labels, with_entropy=False)[1] is None


@settings(max_examples=20, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(1, 9), V=st.integers(2, 40), chunk_size=st.integers(1, 40),
       seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.1, 3.0, 30.0]))
def test_property_chunked_equals_naive(B, T, V, chunk_size, seed, scale):
    logits, labels = sample(B, T, V, seed, scale)
    lp, entropy = logprobs_and_entropy(logits, labels, chunk_size=chunk_size)
    assert_near_naive(lp, entropy, logits, labels)
    lp_tol, entropy_tol = log_softmax_tol(logits)
    assert (entropy >= -entropy_tol).all() and (lp <= lp_tol).all()  # H >= 0 and lp <= 0, up to rounding


@pytest.mark.parametrize(
    "logits, labels, kwargs, match",
    [
        (torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), {}, "logits"),
        (torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), {}, "labels"),
        (torch.zeros(2, 3, 5), torch.full((2, 3), 5), {}, r"labels.*\[0, 5\)"),
        (torch.zeros(2, 3, 5), torch.zeros(2, 3), {}, "integer"),
        (torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), {"chunk_size": 0}, "chunk_size"),
        (torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), {"temperature": 0.0}, "temperature"),
    ],
)
def test_bad_input(logits, labels, kwargs, match):
    with pytest.raises(ValueError, match=match):
        logprobs_and_entropy(logits, labels, **kwargs)
