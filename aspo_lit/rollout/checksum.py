"""A weight checksum both ends of a push compute: did the engine get the trainer's weights?

The trainer computes it from its full tensors (Hugging Face checkpoint names); vLLM's worker
computes it from its own layers *through their compute path* (`quant_method.apply`), because on
CPU vLLM repacks every linear weight into an opaque GEMM handle after loading: the parameters
themselves can no longer be read. Both ends reduce a tensor the same way:

* a 2-D linear weight ``W`` [N, K] (projections, MLP, router, LM head): ``sum(W @ r_K)``, with
  ``r_K`` a fixed ±1 vector of length K. Sums over output rows commute with vLLM's fusions
  (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``: concatenations along N), so the fused
  layer's value is the sum of its parts. The LM head goes through the same product, so a stale
  packed ``lm_head`` (the tied-embedding reload bug) changes the checksum.
* anything else (the embedding table, norms, biases, 3-D expert stacks): the plain sum.

The two kinds are kept apart. The plain sums are exact: the engine holds the trainer's values
cast to its dtype, and both ends sum the same numbers in fp64 (relative differences ~1e-15 in
any dtype), so a one-step-stale embedding shows even at lr 1e-7. The projected sums go through
the engine's GEMM, so they agree to its rounding: ~3e-8 relative in fp32 on CPU (measured), about
1e-3 in bf16; a stale packed LM head differs by ~7e-3 (measured, tiny tied llama).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["probe_vector", "tensor_checksum", "checksum_of", "relative_difference", "weights_match"]


def probe_vector(k: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ±1 vector of length ``k`` both ends multiply linear weights by (seeded by ``k``)."""
    gen = torch.Generator().manual_seed(1_000_003 + int(k))
    return (torch.randint(0, 2, (int(k),), generator=gen) * 2 - 1).to(dtype=dtype, device=device)


def is_projected(name: str, tensor: torch.Tensor) -> bool:
    """A 2-D weight applied as a matrix product (everything 2-D except the embedding table)."""
    return tensor.ndim == 2 and name.endswith(".weight") and not name.endswith("embed_tokens.weight")


def tensor_checksum(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> tuple[str, float]:
    """One checkpoint tensor's kind (``plain`` or ``projected``) and value, as the engine holds it
    (cast to ``dtype``)."""
    t = tensor.detach().to(dtype)
    if is_projected(name, t):
        r = probe_vector(t.shape[1], torch.float64, t.device)
        return "projected", float((t.double() @ r).sum())
    return "plain", float(t.sum(dtype=torch.float64))


def checksum_of(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, float]:
    """``{"plain", "projected"}`` sums and their scales (``*_abs``: the sum of |per-tensor values|)
    over a full state dict (use ``state_dict()``: a tied model's ``lm_head`` is a key there, and the
    engine applies it as its LM head)."""
    out = {"plain": 0.0, "projected": 0.0, "plain_abs": 0.0, "projected_abs": 0.0}
    for name, tensor in named_tensors:
        kind, value = tensor_checksum(name, tensor, dtype)
        out[kind] += value
        out[kind + "_abs"] += abs(value)
    return out


def relative_difference(engine: dict[str, float], trainer: dict[str, float]) -> dict[str, float]:
    """Per kind, |engine - trainer| relative to the trainer's scale."""
    return {kind: abs(engine[kind] - trainer[kind]) / max(trainer[kind + "_abs"], 1e-30)
            for kind in ("plain", "projected")}


#: largest relative differences of an engine that holds the trainer's weights, by engine dtype
#: (measured: plain ~1e-15; projected 3e-8 in fp32 on CPU; bf16 output rounding ~1e-3)
TOLERANCE = {torch.float32: {"plain": 1e-12, "projected": 1e-6}, torch.float64: {"plain": 1e-12, "projected": 1e-9}}
TOLERANCE_LOW_PRECISION = {"plain": 1e-12, "projected": 2e-2}


def weights_match(engine: dict[str, float], trainer: dict[str, float], dtype: torch.dtype) -> tuple[bool, dict[str, float]]:
    """Whether the engine holds the trainer's weights, and the relative differences."""
    diff = relative_difference(engine, trainer)
    tol = TOLERANCE.get(dtype, TOLERANCE_LOW_PRECISION)
    return all(diff[k] <= tol[k] for k in diff), diff
