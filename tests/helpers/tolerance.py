"""Where the tests' floating-point bounds come from (docs/design.md, "Tolerances in tests").

Three kinds of bound, and exactness:

* a reduction or a short chain of roundings, bounded a priori from the dtype's unit roundoff
  ``u = eps / 2``: Higham, *Accuracy and Stability of Numerical Algorithms* (2nd ed., 2002),
  §3.1 and §4.2: ``|fl(Σ x_i) - Σ x_i| <= γ_{n-1} Σ|x_i|`` for any order of the additions and
  ``|fl(xᵀy) - xᵀy| <= γ_n Σ|x_i y_i|``, ``γ_n = n·u / (1 - n·u)``; a chain of k roundings has
  relative error <= γ_k. Two evaluations in different orders differ by at most twice the bound;
* a whole network's forward / backward, where no single reduction length applies: a float64
  run of the same maths beside it, and the fp32 path under test must be as accurate as the
  trusted fp32 path (:func:`assert_as_accurate`);
* float64 maths on O(1) values: :data:`FLOAT64_REL`.

Results claimed bit-identical are compared with ``torch.equal`` / ``==``, never through here, and
computed on one torch thread (:func:`torch_threads`): MKL gives a row of a matrix product the same
bits whatever the product's height there (>= 8 rows on AVX-512), and two fits compared bit for bit
held in a pytest worker only there (tests/integration/test_training.py).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

__all__ = ["unit_roundoff", "gamma", "rounding_tol", "underflow_tol", "reduction_tol", "log_softmax_tol", "FLOAT64_REL", "approx64",
           "AS_ACCURATE_FACTOR", "assert_as_accurate", "assert_within", "torch_threads"]


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u = eps / 2: the largest relative error of one correctly rounded operation (2**-24 in fp32)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's γ_n = n·u / (1 - n·u): the relative error of n chained roundings (needs n·u < 1)."""
    nu = n * unit_roundoff(dtype)
    if not 0 <= nu < 1:
        raise ValueError(f"gamma needs 0 <= n·u < 1, got n={n} for {dtype}")
    return nu / (1 - nu)


def rounding_tol(dtype: torch.dtype, roundings: int, magnitude: float = 1.0) -> float:
    """γ_k · magnitude: a chain of ``roundings`` operations on values of size ``magnitude``.

    Count +, -, ×, / and sqrt as one rounding each, exp / log / pow as two: torch's CPU kernels
    (SLEEF's u10 functions when vectorised, the C library otherwise) are accurate to 1 ulp = 2u,
    not correctly rounded. Used as ``rtol`` with the default magnitude 1."""
    return gamma(roundings, dtype) * magnitude


def underflow_tol(dtype: torch.dtype, roundings: int) -> float:
    """The absolute error that gradual underflow adds to ``roundings`` operations whose results may be
    subnormal: fl(x op y) = (x op y)(1 + δ) + η, |η| <= u·(smallest normal) (Higham §2.1)."""
    return roundings * unit_roundoff(dtype) * torch.finfo(dtype).smallest_normal


def reduction_tol(dtype: torch.dtype, n: int, magnitude: float, evaluations: int = 2) -> float:
    """atol for an n-term sum or dot product whose terms have absolute sum ``magnitude``.

    One evaluation is within γ_n·Σ|x_i| of the exact value in any order (a dot product's n
    products and n - 1 additions are n roundings per term); ``evaluations=2`` (two orders, e.g.
    two kernels, both in ``dtype``) doubles it, ``evaluations=1`` is against an exact (float64)
    reference. Pass ``n * max|x_i|`` as ``magnitude`` when only a bound on the terms is known."""
    return evaluations * gamma(n, dtype) * magnitude


def log_softmax_tol(logits: torch.Tensor, temperature: float = 1.0) -> tuple[float, float]:
    """(atol of the label log-probs, atol of the entropy) of fp32 ``softmax(logits / τ)`` along the
    last dim against exact maths on the same logits, for the algorithm of
    ``aspo_lit.maths.logprobs.chunk_forward`` (z = fl(logits/τ), m = max z, d = z - m, S = Σ exp d,
    log Z = m + log S, lp = z_y - log Z, H = log Z - Σ exp(d)·z / S) and for torch's log_softmax.

    A first-order bound (terms O(u²·(M + V)²) dropped), with M = max|logits|/τ, V = the vocab,
    w = softmax: each exp carries u|d_j| from rounding d_j plus 2u of its own; w_j <= exp(d_j)
    (S >= 1) gives Σ w_j|d_j| = H - log S <= log V and Σ w_j d_j² <= V·max x²e^-x <= 0.55·V, so
    no error term grows with M·V except the sums' γ_{V-1}·M. The rounding of logits/τ (τ != 1)
    adds 2uM to lp and 2uM·log V to H (∂H/∂z_j = -w_j(z_j - E_w z)).
      lp: u·(3M + 5 log V + 2) + γ_{V-1}                      [+ 2uM when τ != 1]
      H:  u·(3M + 0.55V + log²V + 9 log V + 2) + γ_{V-1}·(2M + 1)  [+ 2uM·log V when τ != 1]
    """
    u, V = unit_roundoff(torch.float32), logits.shape[-1]
    M = logits.detach().abs().max().item() / temperature if logits.numel() else 0.0
    log_v, g = math.log(V), gamma(max(V - 1, 1), torch.float32)
    scaled = temperature != 1.0
    lp = u * (3 * M + 5 * log_v + 2 + (2 * M if scaled else 0.0)) + g
    entropy = (u * (3 * M + 0.55 * V + log_v ** 2 + 9 * log_v + 2 + (2 * M * log_v if scaled else 0.0))
               + g * (2 * M + 1))
    return lp, entropy


#: rel for float64 maths on O(1) values: 4,500 float64 units (eps = 2.2e-16) of relative error, so
#: any well-conditioned computation of fewer than 4,500 roundings (every one in these tests is a
#: few dozen at most) passes, and any wrong formula (relative error >> 1e-12) fails.
FLOAT64_REL = 1e-12


def approx64(expected, scale: float = 1.0):
    """pytest.approx for float64 (Python float) maths on O(1) values: rel :data:`FLOAT64_REL`, and
    abs ``FLOAT64_REL * scale`` where the expected value is 0 but the terms summed to it are of size
    ``scale``."""
    return pytest.approx(expected, rel=FLOAT64_REL, abs=FLOAT64_REL * scale)


#: c in ||got - truth||_inf <= c · max(||ref - truth||_inf, u·||truth||_inf). Both fp32 paths round
#: the same maths, reductions of the same lengths in other orders, so their errors against float64
#: are draws of one size; their largest elements differ by a factor of at most 2.6 over the network
#: tests' shapes (21 seeds x 4 tiny models x 2 batch shapes, every parameter's gradient, 168 cases)
#: natively and under ATEN_CPU_CAPABILITY=default / avx2. Under MKL_ENABLE_INSTRUCTIONS=AVX2 one case
#: of 168 (seed 11, untied qwen2, shared prompts) reaches 6x: torch's CPU flash-attention backward is
#: 4x less accurate there for a KV-cached query (its math backend is not); the tests' own seed-0 cases
#: stay <= 2.6x everywhere. 4 keeps a 1.5x margin; a real defect (a dropped term, a bf16 step, a
#: misplaced mask) is off by > 100x.
AS_ACCURATE_FACTOR = 4.0


def assert_as_accurate(got: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, *, name: str = "",
                       factor: float = AS_ACCURATE_FACTOR) -> None:
    """``got`` (the fp32 path under test) is as accurate as ``ref`` (the trusted fp32 path) against
    ``truth`` (the same maths in float64): ``||got - truth||_inf <= factor · max(||ref - truth||_inf,
    u·||truth||_inf)``. The bound travels across CPUs: a kernel that rounds worse raises both errors."""
    if got.shape != ref.shape or got.shape != truth.shape:
        raise ValueError(f"{name}: shapes differ: got {tuple(got.shape)}, ref {tuple(ref.shape)}, "
                         f"truth {tuple(truth.shape)}")
    if truth.dtype != torch.float64:
        raise ValueError(f"{name}: truth must be float64, got {truth.dtype}")
    truth = truth.detach()
    got_err = (got.detach().double() - truth).abs().max().item() if got.numel() else 0.0
    ref_err = (ref.detach().double() - truth).abs().max().item() if ref.numel() else 0.0
    floor = unit_roundoff(ref.dtype) * (truth.abs().max().item() if truth.numel() else 0.0)
    bound = factor * max(ref_err, floor)
    assert got_err <= bound, (f"{name}: |got - float64| = {got_err:.3g} > {factor} x max(|ref - float64| = "
                              f"{ref_err:.3g}, u·|float64| = {floor:.3g}) = {bound:.3g}")


def assert_within(got: torch.Tensor, want: torch.Tensor, atol, *, name: str = "") -> None:
    """|got - want| <= atol elementwise, ``atol`` a float or a tensor broadcasting against them (a
    per-element bound derived at the call site); compared in float64 so the check adds no rounding."""
    err = (got.detach().double() - want.detach().double()).abs()
    bound = torch.as_tensor(atol, dtype=torch.float64).expand_as(err)
    bad = ~(err <= bound)  # NaN fails too
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(f"{name}: {int(bad.sum())} of {err.numel()} elements off by more than their bound; "
                             f"first at flat index {i}: |{got.flatten()[i].item()!r} - {want.flatten()[i].item()!r}| "
                             f"= {err.flatten()[i].item():.3g} > {bound.flatten()[i].item():.3g}")


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's intra-op threads set to ``threads`` inside the block, the caller's count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
