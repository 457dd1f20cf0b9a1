"""Per-token log-probs of the sampled tokens and full-vocabulary entropy, from logits, in chunks.

A 150k vocabulary makes ``[tokens × vocab]`` fp32 tensors huge (8k tokens × 151,936 × 4 B ≈
5 GB each), and the obvious ``log_softmax`` → ``gather`` materialises several of them, in the
forward and again for the backward. Here the sequence positions are processed a chunk at a time:
each chunk is upcast to fp32 (the maths is fp32 whatever the logits' dtype), reduced to per-token
numbers, and freed; the backward (a custom autograd function) recomputes each chunk's softmax
from the saved per-token ``log Z``. Peak extra memory is O(chunk × vocab) fp32 -- plus, in the
backward, the gradient of the logits itself, in the logits' own dtype.

Logits must be finite (a model's logits are); they are not scanned for NaN/inf.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

__all__ = ["token_logprobs", "token_entropy", "logprobs_and_entropy"]


def _validate(logits: Tensor, labels: Tensor | None, chunk_size: int, temperature: float) -> None:
    if not isinstance(logits, Tensor) or logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating [B, T, V] tensor, got {getattr(logits, 'shape', type(logits))}")
    if labels is not None:
        if not isinstance(labels, Tensor) or labels.shape != logits.shape[:2]:
            raise ValueError(f"labels must be a [B, T] tensor matching logits {tuple(logits.shape[:2])}, "
                             f"got {getattr(labels, 'shape', type(labels))}")
        if labels.is_floating_point() or labels.dtype == torch.bool:
            raise ValueError(f"labels must hold integer token ids, got dtype {labels.dtype}")
        if labels.numel() and (labels.min() < 0 or labels.max() >= logits.shape[-1]):
            raise ValueError(f"labels must be token ids in [0, {logits.shape[-1]}) (the vocab size)")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _position_slices(logits: Tensor, chunk_size: int) -> Iterator[slice]:
    """Slices of sequence positions holding about ``chunk_size`` tokens (all rows, ≥ 1 position)."""
    batch, length = logits.shape[:2]
    step = max(1, chunk_size // max(batch, 1))
    for start in range(0, length, step):
        yield slice(start, min(start + step, length))


def _scaled_fp32(chunk: Tensor, temperature: float) -> Tensor:
    """``chunk / temperature`` in fp32, never modifying ``chunk``."""
    z = chunk.float()
    return z / temperature if temperature != 1.0 else z


def chunk_forward(z: Tensor, labels: Tensor | None, with_entropy: bool):
    """Log Z, label log-probs and entropy of one chunk of fp32 logits ``z`` ``[B, t, V]``.

    One ``[B, t, V]`` temporary: ``p = exp(z - max z)``; ``log Z = max z + log Σp``;
    ``H = log Z - Σ softmax·z``.
    """
    z_max = z.amax(dim=-1, keepdim=True)
    p = (z - z_max).exp_()
    p_sum = p.sum(dim=-1, keepdim=True)
    log_z = (z_max + p_sum.log()).squeeze(-1)
    logprobs = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_z if labels is not None else None
    entropy = log_z - (p.mul_(z).sum(dim=-1) / p_sum.squeeze(-1)) if with_entropy else None
    return log_z, logprobs, entropy


class _ChunkedLogprobs(torch.autograd.Function):
    """Label log-probs with a chunked, recomputing backward: ∂lp/∂z_j = (δ_j,label − softmax_j)/τ."""

    @staticmethod
    def forward(ctx, logits, labels, chunk_size, temperature, with_entropy):
        batch, length = labels.shape
        logprobs = logits.new_empty((batch, length), dtype=torch.float32)
        log_z = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_empty(0)
        for pos in _position_slices(logits, chunk_size):
            z = _scaled_fp32(logits[:, pos], temperature)
            chunk_log_z, chunk_logprobs, chunk_entropy = chunk_forward(z, labels[:, pos], with_entropy)
            log_z[:, pos] = chunk_log_z
            logprobs[:, pos] = chunk_logprobs
            if with_entropy:
                entropy[:, pos] = chunk_entropy
        ctx.save_for_backward(logits, labels, log_z)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        logits, labels, log_z = ctx.saved_tensors
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for pos in _position_slices(logits, ctx.chunk_size):
            z = _scaled_fp32(logits[:, pos], ctx.temperature)
            softmax = (z - log_z[:, pos, None]).exp_()
            grad = grad_logprobs[:, pos, None].float()
            chunk_grad = softmax.mul_(-grad).scatter_add_(-1, labels[:, pos, None], grad)
            if ctx.temperature != 1.0:
                chunk_grad.div_(ctx.temperature)
            grad_logits[:, pos] = chunk_grad
        return grad_logits, None, None, None, None


def logprobs_and_entropy(logits: Tensor, labels: Tensor, chunk_size: int = 1024, with_entropy: bool = True,
                         temperature: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """``log softmax(logits/τ)[label]`` ``[B, T]`` (differentiable) and the full-vocabulary entropy
    ``[B, T]`` (detached; None unless ``with_entropy``), both fp32, computed ``chunk_size`` tokens
    at a time so no ``[B·T × V]`` fp32 tensor ever exists.

    ``logits`` ``[B, T, V]`` in any float dtype (bf16 is upcast per chunk); ``labels`` ``[B, T]``
    token ids; ``temperature`` divides the logits (the sampling temperature).
    """
    _validate(logits, labels, chunk_size, temperature)
    logprobs, entropy = _ChunkedLogprobs.apply(logits, labels, chunk_size, float(temperature), with_entropy)
    return logprobs, (entropy if with_entropy else None)


def token_logprobs(logits: Tensor, labels: Tensor, chunk_size: int = 1024, temperature: float = 1.0) -> Tensor:
    """Per-token log-probs of ``labels`` ``[B, T]`` fp32, chunked (see :func:`logprobs_and_entropy`)."""
    return logprobs_and_entropy(logits, labels, chunk_size, with_entropy=False, temperature=temperature)[0]


@torch.no_grad()
def token_entropy(logits: Tensor, chunk_size: int = 1024, temperature: float = 1.0) -> Tensor:
    """Full-vocabulary entropy of ``softmax(logits/τ)`` per position, ``[B, T]`` fp32, detached."""
    _validate(logits, None, chunk_size, temperature)
    entropy = logits.new_empty(logits.shape[:2], dtype=torch.float32)
    for pos in _position_slices(logits, chunk_size):
        entropy[:, pos] = chunk_forward(_scaled_fp32(logits[:, pos], temperature), None, True)[2]
    return entropy
