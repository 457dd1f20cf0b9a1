"""fp16 compute: the one way it trains, and every other way refused, naming its key.

fp16 keeps 11 significant bits (bf16: 8), which narrows the sampler/trainer gap the importance
ratio sees, but only 5 exponent bits: its smallest subnormal is 2^-24 (6e-8) and its largest value
65504. A policy-gradient loss averaged over a mini-batch's tokens gives each logit a gradient of
order |A|/N, which flushes to zero in an fp16 backward, and the run trains on whatever survives.
Mixed-precision training with loss scaling (Micikevicius et al., 2018, "Mixed Precision Training")
fixes it: fp32 master weights, fp16 compute, the loss multiplied by a scale S before the backward,
the gradients divided by S before the step, and a step whose scaled gradients overflow skipped
while S halves (docs/gpu.md, "fp16 compute").

The one way: ``trainer.strategy: aspo_lit.training.strategy.FSDP2Strategy`` with ``param_dtype: float16``
(or ``reduce_dtype: float16``) and ``model.torch_dtype: float32``; `ASPOModule` then scales the
loss with torch's sharded grad scaler (`fsdp_needs_grad_scaler`). Every other way is refused:

* ``model.torch_dtype: float16``, or ``auto`` on a checkpoint stored in fp16: fp16 master weights
  and AdamW states, whose updates round away; a scaler does not bring them back;
* ``trainer.precision: 16-true``: Lightning casts the module to fp16, the same;
* ``trainer.precision: 16-mixed`` (``16``) and ``transformer-engine-float16``: a scaler inside
  Lightning's precision plugin, which the module's manual optimisation steps around (its gradient
  clip would see scaled gradients, and its non-finite skip would never lower the scale).
"""

from __future__ import annotations

import torch

#: `trainer.precision` values that compute in fp16 (Lightning's names; ``16`` is its alias of ``16-mixed``)
FP16_PRECISIONS = ("16-mixed", "16", "16-true", "transformer-engine-float16")

_THE_WAY = ("keep fp32 master weights (model.torch_dtype: float32, trainer.precision: 32-true) and compute in "
            "fp16 with trainer.strategy: aspo_lit.training.strategy.FSDP2Strategy (init_args: {param_dtype: float16}), "
            "which scales the loss with a sharded grad scaler")


def check_precision(precision: object) -> None:
    """Refuse a `trainer.precision` that computes in fp16 (any of `FP16_PRECISIONS`)."""
    if str(precision) in FP16_PRECISIONS:
        raise ValueError(f"trainer.precision={precision} trains in fp16 without a loss scale that the module's "
                         f"manual optimisation honours (small gradients underflow to zero): {_THE_WAY}")


def check_weights_dtype(dtype: object, setting: str | None = None) -> None:
    """Refuse fp16 master weights: ``dtype`` (a name or a `torch.dtype`) is what ``model.torch_dtype``
    loads, ``setting`` what it says when that differs (``auto``)."""
    if dtype in ("float16", torch.float16):
        setting = setting or str(dtype).removeprefix("torch.")
        raise ValueError(f"model.torch_dtype={setting} makes the master weights and AdamW states fp16: most "
                         f"updates round away and a loss scale does not bring them back; {_THE_WAY}")


def fsdp_needs_grad_scaler(mp_policy: object) -> bool:
    """Whether an FSDP2 `MixedPrecisionPolicy` puts fp16 on the gradient's path (its compute dtype or
    its reduce-scatter dtype): then the loss must be scaled."""
    return torch.float16 in (getattr(mp_policy, "param_dtype", None), getattr(mp_policy, "reduce_dtype", None))
