"""Label log-probs and entropy straight from hidden states and the LM-head weight, in chunks.

The fused-linear pattern (verl's ``FusedLinearForPPO``, Liger's fused linear cross-entropy):
rather than building ``logits = hidden @ W.T`` for every token (``[tokens × vocab]``: 32k tokens ×
151,936 × 4 B ≈ 20 GB in fp32) and reducing it afterwards, the tokens are processed ``chunk_size``
at a time: each chunk's logits are computed, reduced to a label log-prob, a log-normaliser and
(optionally) the entropy, and freed. The backward (a custom autograd function) recomputes each
chunk's logits from the saved hidden states and accumulates the gradients of the hidden states,
of ``W`` and of the bias. Peak extra memory is O(chunk × vocab) whatever the number of tokens,
plus one fp32 ``[vocab × hidden]`` gradient accumulator.

When every chunk's logits together are small (at most `KEEP_LOGITS_MAX` fp32 values: the CPU
testbeds' 1k vocabulary, never a 150k one beyond a hundred tokens) and a gradient is needed, the
forward keeps them for the backward instead of recomputing them: the same matmul on the same
inputs gives the same bits, so the result is identical and one matmul per chunk is saved.

Numerics: the matmul runs in the weight's dtype (as the model's own ``lm_head`` would, so bf16
weights give the same logits as the unfused path); everything after it -- bias, ``/temperature``,
softmax, log-probs, entropy, the logits' gradient and the weight-gradient accumulation -- is fp32.
The entropy is detached (non-differentiable), as in :mod:`aspo_lit.maths.logprobs`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from aspo_lit.maths.logprobs import chunk_forward

__all__ = ["fused_linear_logprobs", "KEEP_LOGITS_MAX"]

#: most fp32 logits (tokens x vocab, 64 MB) the forward keeps for the backward instead of recomputing
KEEP_LOGITS_MAX = 1 << 24


def _logits_fp32(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """``(hidden @ W.T + b) / τ`` as a fresh fp32 ``[n, V]`` tensor (matmul in the weight's dtype)."""
    z = F.linear(hidden.to(weight.dtype), weight).float()
    if bias is not None:
        z.add_(bias.float())
    return z.div_(temperature) if temperature != 1.0 else z


def _spans(n: int, chunk_size: int):
    for start in range(0, n, chunk_size):
        yield slice(start, min(start + chunk_size, n))


class _FusedLinearLogprobs(torch.autograd.Function):
    """lp_i = log softmax((h_i W^T + b)/τ)[y_i]; ∂lp/∂z = (onehot(y) − softmax)/τ, pushed through the matmul."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, temperature, with_entropy, shape):
        # outputs are allocated in their final shape (not returned as views: FSDP2 hooks outputs)
        n = hidden.shape[0]
        logprobs = hidden.new_empty(shape, dtype=torch.float32)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_empty(0)
        log_z = logprobs.new_empty(n)
        flat_logprobs, flat_entropy = logprobs.view(-1), entropy.view(-1)
        keep = any(ctx.needs_input_grad[:3]) and n * weight.shape[0] <= KEEP_LOGITS_MAX
        kept = []
        for span in _spans(n, chunk_size):
            z = _logits_fp32(hidden[span], weight, bias, temperature)
            chunk_log_z, chunk_logprobs, chunk_entropy = chunk_forward(z, labels[span], with_entropy)
            if keep:
                kept.append(z)
            del z
            log_z[span] = chunk_log_z
            flat_logprobs[span] = chunk_logprobs
            if with_entropy:
                flat_entropy[span] = chunk_entropy
        ctx.save_for_backward(hidden, weight, bias, labels, log_z)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        ctx.kept_logits = kept if keep else None
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, bias, labels, log_z = ctx.saved_tensors
        grad_logprobs = grad_logprobs.reshape(-1)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_bias = need_bias and bias is not None
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        for i, span in enumerate(_spans(hidden.shape[0], ctx.chunk_size)):
            h = hidden[span].to(weight.dtype)
            g = grad_logprobs[span, None].float()
            # softmax from the saved log Z, then ∂lp/∂z in place: (onehot − softmax)·g/τ
            if ctx.kept_logits is not None:  # out of place: the kept logits stay for a retained graph
                dz = ctx.kept_logits[i].sub(log_z[span, None]).exp_()
            else:
                dz = _logits_fp32(h, weight, bias, ctx.temperature).sub_(log_z[span, None]).exp_()
            dz.mul_(-g).scatter_add_(-1, labels[span, None], g)
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)
            if need_bias:
                grad_bias.add_(dz.sum(0))
            dz_w = dz.to(weight.dtype)
            if need_hidden:
                grad_hidden[span] = dz_w @ weight
            if need_weight:
                if dz_w.dtype == torch.float32:
                    grad_weight.addmm_(dz_w.t(), h)
                else:
                    grad_weight.add_(dz_w.t() @ h)
            del dz, dz_w
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _validate(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, chunk_size: int,
              temperature: float) -> None:
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a floating [V, H] tensor, got {getattr(weight, 'shape', type(weight))}")
    vocab, width = weight.shape
    if not isinstance(hidden, Tensor) or hidden.dim() < 1 or hidden.shape[-1] != width \
            or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating [..., {width}] tensor matching weight [V, H], "
                         f"got {getattr(hidden, 'shape', type(hidden))}")
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (vocab,)):
        raise ValueError(f"bias must be None or a [{vocab}] tensor, got {getattr(bias, 'shape', type(bias))}")
    if not isinstance(labels, Tensor) or labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels must be a tensor of shape {tuple(hidden.shape[:-1])} (hidden without its "
                         f"last dim), got {getattr(labels, 'shape', type(labels))}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"labels must hold integer token ids, got dtype {labels.dtype}")
    if labels.numel() and (labels.min() < 0 or labels.max() >= vocab):
        raise ValueError(f"labels must be token ids in [0, {vocab}) (the vocab size)")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def fused_linear_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None, *,
                          temperature: float = 1.0, chunk_size: int = 1024,
                          with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """``log softmax((hidden @ weight.T + bias)/τ)[label]`` per token, and the full-vocabulary
    entropy, both fp32 with ``labels``' shape, without ever holding more than ``chunk_size``
    tokens' logits.

    ``hidden`` ``[..., H]`` (any float dtype), ``weight`` ``[V, H]`` (the LM head; pass the tied
    embedding itself when tied, so its gradient lands on the shared tensor), ``bias`` ``[V]`` or
    None, ``labels`` ``[...]`` token ids. The log-probs are differentiable w.r.t. ``hidden``,
    ``weight`` and ``bias``; the entropy (None unless ``with_entropy``) is detached.
    """
    _validate(hidden, weight, bias, labels, chunk_size, temperature)
    logprobs, entropy = _FusedLinearLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels.reshape(-1), chunk_size, float(temperature),
        with_entropy, tuple(labels.shape))
    return logprobs, (entropy if with_entropy else None)
