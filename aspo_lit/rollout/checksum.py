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

With tensor parallelism each engine rank holds part of the model; ``tp_part`` says, per
parameter, whether its rank's sums are partial (``sharded``: added over the TP group) or the
whole tensor's (``replicated``: counted once).

The two kinds are kept apart. The plain sums are exact: the engine holds the trainer's values
cast to its dtype, and both ends sum the same numbers in fp64 (relative differences ~1e-15 in
any dtype), so a one-step-stale embedding shows even at lr 1e-7. The projected sums go through
the engine's GEMM, so they agree to its rounding: ~3e-8 relative in fp32 on CPU (measured), about
1e-3 in bf16; a stale packed LM head differs by ~7e-3 (measured, tiny tied llama).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

import torch

__all__ = ["probe_vector", "tensor_checksum", "checksum_of", "relative_difference", "weights_match", "tp_part"]

#: vLLM's layer families, by how tensor parallelism splits them: ``column`` (ColumnParallelLinear,
#: QKV and merged gate/up: split along the outputs), ``row`` (RowParallelLinear: split along the
#: inputs), ``replicated`` (ReplicatedLinear, the MoE router), ``lm_head`` and ``embedding``
#: (vocab-parallel: split along the vocabulary), ``experts`` (the fused MoE experts) and ``other``
#: (norms and anything else held whole)
LayerKind = Literal["column", "row", "replicated", "lm_head", "embedding", "experts", "other"]
TPPart = Literal["sharded", "replicated"]


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


def tp_part(kind: LayerKind, param: str, *, expert_parallel: bool = False) -> TPPart:
    """Whether a vLLM parameter is split over the TP group (``sharded``) or held whole by every
    rank (``replicated``), by its layer's family and its name within the layer.

    * ``replicated`` and ``other`` layers: whole on every rank.
    * ``row``: the weight is split along its inputs; the bias is whole on every rank (added once,
      after the all-reduce).
    * ``experts``: ``w13_weight`` [E, 2I, H], ``w2_weight`` [E, H, I] and ``w13_bias`` [E, 2I] are
      split along the intermediate size I; ``w2_bias`` [E, H] is whole on every rank, except with
      expert parallelism, which splits every expert tensor along E.
    * ``column``, ``lm_head``, ``embedding``: split along their outputs (the vocabulary for the
      last two), the bias with them."""
    if kind not in get_args(LayerKind):
        raise ValueError(f"tp_part: kind must be one of {get_args(LayerKind)}, got {kind!r}")
    if kind in ("replicated", "other"):
        return "replicated"
    if kind == "row" and param == "bias":
        return "replicated"
    if kind == "experts" and param == "w2_bias" and not expert_parallel:
        return "replicated"
    return "sharded"


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
