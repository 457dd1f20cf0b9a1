"""Policy losses: GRPO (eq. 1), its IS ablations, and ASPO (Sec. 6) behind one registry.

Notation per response token (docs/design.md, "Losses"): ``lp = log π_θ``, ``old = log π_old``,
``r = exp(lp - old)`` (computed in log space and clamped, as the authors' code does), ``A`` the
response's advantage broadcast to its tokens, ``mask`` the response-token mask.

Every loss is a :class:`PolicyLoss` subclass registered under a name. A subclass implements only
``token_loss`` -- the per-token loss ``ℓ_t`` (the negated per-token objective) plus per-token clip
flags and any statistics of its own; the base class validates the input, broadcasts advantages,
applies the entropy-dependent ε option, aggregates with ``loss_agg`` and reduces the statistics to
:class:`~aspo_lit.maths.stats.Stat` values, each carrying its weight and reduction.

    loss_fn = get_policy_loss("aspo", eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    loss, stats = loss_fn(logprobs, old_logprobs, advantages, mask)

A loss is named by its registered name, by an entry point of the ``aspo_lit.maths.losses`` group (an
installed package's ``[project.entry-points."aspo_lit.maths.losses"]``), or by its import path
(``mypkg.losses:MyLoss``); :func:`get_policy_loss` resolves the three.

Gradient view (Prop. 4.1): every loss here has ``∂ℓ_t/∂lp_t = -w_t·A_t`` for a detached token
weight ``w_t``; :func:`effective_token_weight` recovers ``w`` by autograd.
"""

from __future__ import annotations

import importlib
import inspect
import math
from importlib.metadata import entry_points
from typing import Callable, Literal, NamedTuple

import torch
from torch import Tensor

from aspo_lit.maths.stats import Stat

__all__ = [
    "LOSS_AGG_MODES",
    "KL_KINDS",
    "CLIP_SIGNS",
    "STAT_KEYS",
    "ENTRY_POINT_GROUP",
    "POLICY_LOSSES",
    "PolicyLoss",
    "register_policy_loss",
    "get_policy_loss",
    "resolve_policy_loss",
    "agg_normalizer",
    "aggregate",
    "kl_penalty",
    "effective_token_weight",
    "GRPOLoss",
    "GRPONoISLoss",
    "GRPOPosMeanLoss",
    "CISPOLoss",
    "GSPOLoss",
    "ASPOLoss",
    "ASPONoDualClipLoss",
]

LOSS_AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
KL_KINDS = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
#: ``model.kl_kind``'s type: the names of KL_KINDS (LightningCLI rejects any other, naming the key).
KLKind = Literal[tuple(KL_KINDS)]
# The clip flags and the advantage sign whose response tokens each is a share of (Prop. 4.1).
CLIP_SIGNS = {"clip/pos_high": "positive", "clip/neg_low": "negative",
              "clip/pos_dual": "positive", "clip/neg_dual": "negative"}
STAT_KEYS = (*CLIP_SIGNS, "ratio/pos_mean", "ratio/neg_mean")
ENTRY_POINT_GROUP = "aspo_lit.maths.losses"

POLICY_LOSSES: dict[str, type["PolicyLoss"]] = {}


# ----------------------------------------------------------------------------------------------
# aggregation (docs/design.md, "Losses")

def _check_loss_agg(loss_agg: str) -> None:
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; valid choices: {', '.join(LOSS_AGG_MODES)}")


def agg_normalizer(mask: Tensor, loss_agg: str, norm_length: int | None = None) -> Tensor:
    """The denominator ``aggregate`` divides by, for the batch whose response mask is ``mask``.

    * ``token-mean`` (DAPO): the number of response tokens.
    * ``seq-mean-token-mean`` (eq. 1): the number of responses (rows with at least one token;
      an all-padding row carries no response).
    * ``seq-mean-token-sum-norm`` (Dr.GRPO): responses × ``norm_length`` (a constant; ``None``
      means the mask's T).

    Compute it once on the whole mini-batch and pass it as ``normalizer=`` to every micro-batch
    so accumulated micro-batch gradients equal the mini-batch gradient (verl #5625, #7200).
    """
    _check_loss_agg(loss_agg)
    mask = mask.bool()
    if loss_agg == "token-mean":
        return torch.count_nonzero(mask).float()
    num_responses = mask.any(dim=-1).sum().float()
    if loss_agg == "seq-mean-token-mean":
        return num_responses
    length = mask.shape[-1] if norm_length is None else norm_length
    return num_responses * float(length)


def aggregate(per_token: Tensor, mask: Tensor, loss_agg: str, normalizer: Tensor | float | None = None,
              norm_length: int | None = None) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar: sum of (per-response) terms / normaliser.

    ``seq-mean-token-mean`` first averages each response over its own tokens (eq. 1's 1/|o_i|);
    the other modes sum tokens. The numerator is a plain sum over this batch, so splitting rows
    into micro-batches with the mini-batch's ``normalizer`` reproduces the mini-batch loss exactly.
    """
    _check_loss_agg(loss_agg)
    mask = mask.bool()
    masked = torch.where(mask, per_token, 0.0)
    if loss_agg == "seq-mean-token-mean":
        lengths = torch.count_nonzero(mask, dim=-1).clamp_min(1)
        total = (masked.sum(dim=-1) / lengths).sum()
    else:
        total = masked.sum()
    if normalizer is None:
        normalizer = agg_normalizer(mask, loss_agg, norm_length)
    normalizer = _as_normalizer(normalizer, total)
    return total / torch.where(normalizer > 0, normalizer, torch.ones_like(normalizer))


def _as_normalizer(normalizer: Tensor | float, like: Tensor) -> Tensor:
    normalizer = torch.as_tensor(normalizer, dtype=torch.float32, device=like.device)
    if normalizer.numel() != 1 or not torch.isfinite(normalizer).all() or normalizer < 0:
        raise ValueError(f"normalizer must be one finite number >= 0 (see agg_normalizer), got {normalizer}")
    return normalizer.reshape(())


# ----------------------------------------------------------------------------------------------
# KL to the reference policy

def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate ``[B, T]`` from sampled-token log-probs (Schulman 2020).

    ``k1`` ("kl"): ``lp - ref``; ``k2`` ("mse"): ``½(lp - ref)²``; ``k3`` ("low_var_kl", verl's name):
    ``exp(ref - lp) - (ref - lp) - 1``, its value clamped to [-10, 10]. The exponent is clamped to
    ±20 first so a huge gap never gives inf (whose clamp would back-propagate NaN).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid choices: {', '.join(KL_KINDS)}")
    _check_tensor("logprobs", logprobs)
    _check_same_shape("ref_logprobs", ref_logprobs, "logprobs", logprobs)
    log_ref_ratio = ref_logprobs.detach().float() - logprobs.float()   # log(π_ref / π_θ)
    kind = KL_KINDS[kind]
    if kind == "k1":
        return -log_ref_ratio
    if kind == "k2":
        return 0.5 * log_ref_ratio.square()
    log_ref_ratio = log_ref_ratio.clamp(-20.0, 20.0)
    return (log_ref_ratio.exp() - log_ref_ratio - 1.0).clamp(-10.0, 10.0)


# ----------------------------------------------------------------------------------------------
# input validation

def _check_tensor(name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _check_same_shape(name: str, x, ref_name: str, ref: Tensor) -> None:
    _check_tensor(name, x)
    if x.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
                         f"they must match")


def _check_finite(name: str, x: Tensor) -> None:
    # NaN/inf propagate into the sum: one reduction, no [B, T] temporary; exact re-check if it trips
    if not torch.isfinite(x.sum()) and not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or inf")


def _broadcast_advantages(advantages: Tensor, logprobs: Tensor) -> Tensor:
    """``[B]`` (one advantage per response, eq. 1's broadcast) or ``[B, T]`` → ``[B, T]``."""
    batch, length = logprobs.shape
    if advantages.shape == (batch,):
        return advantages.unsqueeze(-1).expand(batch, length)
    if advantages.shape == (batch, length):
        return advantages
    raise ValueError(f"advantages has shape {tuple(advantages.shape)}; valid shapes: "
                     f"[B]={[batch]} or [B, T]={[batch, length]}")


def _as_bool_mask(mask: Tensor) -> Tensor:
    if mask.dtype == torch.bool:
        return mask
    # values in [0, 1] whose sum equals the count of non-zeros are all 0 or 1 (reductions only)
    in_range = mask.numel() == 0 or (mask.min() >= 0 and mask.max() <= 1)
    if not in_range or mask.sum(dtype=torch.float64) != torch.count_nonzero(mask):
        raise ValueError("mask must be bool or hold only 0/1 values")
    return mask.bool()


# ----------------------------------------------------------------------------------------------
# shared pieces of the clipped objectives

class ClipRegions(NamedTuple):
    """Where PPO-clip acts on a token (Prop. 4.1: ``m = 0`` exactly on ``pos_high | neg_low``)."""
    is_positive: Tensor   # A > 0
    is_negative: Tensor   # A < 0
    pos_high: Tensor      # A > 0 and r > 1 + ε_high
    neg_low: Tensor       # A < 0 and r < 1 - ε_low


def clip_regions(log_ratio: Tensor, advantages: Tensor, eps_low: Tensor, eps_high: Tensor) -> ClipRegions:
    """The clip regions of eq. 1, tested on ``log r`` (no ``exp`` needed)."""
    is_positive = advantages > 0
    is_negative = advantages < 0
    pos_high = is_positive & (log_ratio > torch.log1p(eps_high))
    neg_low = is_negative & (log_ratio < torch.log1p(-eps_low))
    return ClipRegions(is_positive, is_negative, pos_high, neg_low)


def masked_row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over each row's masked tokens, ``[B, 1]`` (0 for an empty row)."""
    total = torch.where(mask, x, 0.0).sum(dim=-1, keepdim=True)
    return total / torch.count_nonzero(mask, dim=-1).unsqueeze(-1).clamp_min(1)


def high_entropy_tokens(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """Tokens above their response's ``quantile`` of token entropy (the authors' code)."""
    masked_entropy = entropy.masked_fill(~mask, float("nan"))
    threshold = torch.nanquantile(masked_entropy, quantile, dim=-1, keepdim=True)
    return mask & (entropy > threshold)


# ----------------------------------------------------------------------------------------------
# the base class

class PolicyLoss:
    """A policy loss: ``loss, stats = loss_fn(logprobs, old_logprobs, advantages, mask)``.

    ``logprobs``/``old_logprobs``/``mask`` are ``[B, T]`` (mask bool or 0/1), ``advantages`` ``[B]``
    or ``[B, T]``; all must be finite everywhere, padding included. Maths is fp32 (bf16 inputs
    are upcast); the loss has a gradient through ``logprobs`` only.

    Args:
        eps_low, eps_high: PPO clip range ``[1-ε_low, 1+ε_high]`` (eq. 1; DAPO clip-higher is
            ``eps_high=0.28``).
        dual_clip: the dual-clip constant ``c`` (Ye et al. 2020; ASPO Sec. 6 step 3), > 1.
        loss_agg: one of :data:`LOSS_AGG_MODES`.
        eps_high_entropy: authors'-code option -- tokens above the ``entropy_quantile`` of their
            response's token entropy use ``ε_low = ε_high = eps_high_entropy`` (needs ``entropy=``).
        entropy_quantile: see ``eps_high_entropy``.
        clamp_log_ratio: ``r = exp(clamp(lp - old, ±clamp_log_ratio))`` (authors' code: 20).
        norm_length: the Dr.GRPO constant for ``seq-mean-token-sum-norm`` (None → the mask's T).
    """

    name: str = ""

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float = 3.0,
                 loss_agg: str = "seq-mean-token-mean", eps_high_entropy: float | None = None,
                 entropy_quantile: float = 0.8, clamp_log_ratio: float = 20.0,
                 norm_length: int | None = None):
        _check_loss_agg(loss_agg)
        if not 0 <= eps_low < 1:
            raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
        if not eps_high >= 0:
            raise ValueError(f"eps_high must be >= 0, got {eps_high}")
        if not dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        if eps_high_entropy is not None and not 0 <= eps_high_entropy < 1:
            raise ValueError(f"eps_high_entropy must be None or in [0, 1), got {eps_high_entropy}")
        if not 0 < entropy_quantile < 1:
            raise ValueError(f"entropy_quantile must be in (0, 1), got {entropy_quantile}")
        if not clamp_log_ratio > 0:
            raise ValueError(f"clamp_log_ratio must be > 0, got {clamp_log_ratio}")
        if norm_length is not None and not norm_length > 0:
            raise ValueError(f"norm_length must be None or > 0, got {norm_length}")
        self.eps_low = float(eps_low)
        self.eps_high = float(eps_high)
        self.dual_clip = float(dual_clip)
        self.loss_agg = loss_agg
        self.eps_high_entropy = eps_high_entropy
        self.entropy_quantile = float(entropy_quantile)
        self.clamp_log_ratio = float(clamp_log_ratio)
        self.norm_length = norm_length

    def __repr__(self) -> str:
        hparams = ", ".join(f"{k}={v!r}" for k, v in self.hparams().items())
        return f"{type(self).__name__}({hparams})"

    def hparams(self) -> dict:
        names = inspect.signature(PolicyLoss.__init__).parameters
        return {k: getattr(self, k) for k in names if k != "self"}

    # -- what a subclass implements ------------------------------------------------------------

    def token_loss(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                   eps_low: Tensor, eps_high: Tensor) -> tuple[Tensor, dict[str, Tensor | Stat]]:
        """Per-token loss ``[B, T]`` (fp32) and the token statistics, by name.

        Tensors are ``[B, T]`` fp32 (``mask`` bool; ``eps_low``/``eps_high`` broadcastable to
        ``[B, T]``); ``old_logprobs`` and ``advantages`` are detached. The statistics:

        * a clip flag of :data:`CLIP_SIGNS` (bool ``[B, T]``): reduced to its share of the response
          tokens of its advantage sign. Flags may be omitted (they reduce to 0) and need not be
          restricted to the sign or the mask: the base class does that;
        * any other name with a ``[B, T]`` tensor: its mean over the response tokens (weight: their
          count), e.g. ``{"my_flag": flags}`` logs the share of response tokens flagged;
        * any name with a :class:`~aspo_lit.maths.stats.Stat`: kept as it is -- the loss declares its
          own weight and reduction.

        A loss must return the same names for every input. A name without ``/`` is logged under
        ``train/``.
        """
        raise NotImplementedError

    # -- the call --------------------------------------------------------------------------------

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                 entropy: Tensor | None = None, normalizer: Tensor | float | None = None
                 ) -> tuple[Tensor, dict[str, Tensor]]:
        """Scalar loss (gradient through ``logprobs`` only) and detached scalar stats.

        ``normalizer``: the mini-batch's :func:`agg_normalizer`, when this call sees one
        micro-batch of it; ``None`` normalises over exactly these tensors.
        """
        logprobs, old_logprobs, advantages, mask = self.prepare_inputs(logprobs, old_logprobs, advantages, mask)
        eps_low, eps_high = self.token_eps(mask, entropy)
        per_token, token_stats = self.token_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
        loss = aggregate(per_token, mask, self.loss_agg, normalizer, self.norm_length)
        stats = self.reduce_stats(logprobs, old_logprobs, advantages, mask, token_stats)
        return loss, stats

    def stat_reductions(self) -> dict[str, str]:
        """``{name: reduction}`` of the statistics this loss returns, from one call on a one-token
        batch (every call returns the same names): what a training step declares up front."""
        one = torch.zeros(1, 1)
        _, stats = self(one, one, torch.ones(1), torch.ones(1, 1, dtype=torch.bool), entropy=one)
        return {name: stat.reduce for name, stat in stats.items()}

    def prepare_inputs(self, logprobs, old_logprobs, advantages, mask) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Validate, upcast to fp32, detach everything but ``logprobs``, broadcast advantages."""
        _check_tensor("logprobs", logprobs)
        if logprobs.dim() != 2:
            raise ValueError(f"logprobs must be a [B, T] tensor, got shape {tuple(logprobs.shape)}")
        _check_same_shape("old_logprobs", old_logprobs, "logprobs", logprobs)
        _check_same_shape("mask", mask, "logprobs", logprobs)
        _check_tensor("advantages", advantages)
        advantages = _broadcast_advantages(advantages, logprobs)
        logprobs = logprobs.float()
        old_logprobs = old_logprobs.detach().float()
        advantages = advantages.detach().float()
        for name, x in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
            _check_finite(name, x.detach())
        return logprobs, old_logprobs, advantages, _as_bool_mask(mask)

    def token_eps(self, mask: Tensor, entropy: Tensor | None) -> tuple[Tensor, Tensor]:
        """``(ε_low, ε_high)`` broadcastable to ``[B, T]``: 0-dim tensors, or ``[B, T]`` when the
        entropy-dependent option widens them on high-entropy tokens."""
        eps_low = torch.tensor(self.eps_low, device=mask.device)
        eps_high = torch.tensor(self.eps_high, device=mask.device)
        if self.eps_high_entropy is None:
            return eps_low, eps_high
        if entropy is None:
            raise ValueError("entropy= ([B, T] token entropy) is required when eps_high_entropy is set")
        _check_same_shape("entropy", entropy, "mask", mask)
        entropy = entropy.detach().float()
        _check_finite("entropy", entropy)
        high_entropy = high_entropy_tokens(entropy, mask, self.entropy_quantile)
        wide = torch.tensor(float(self.eps_high_entropy), device=mask.device)
        return torch.where(high_entropy, wide, eps_low), torch.where(high_entropy, wide, eps_high)

    def log_ratio(self, logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
        """``log r = lp - old``, clamped (authors' code) so that ``exp`` can never overflow."""
        return torch.clamp(logprobs - old_logprobs, -self.clamp_log_ratio, self.clamp_log_ratio)

    def ratio(self, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
        """The importance ratio ``[B, T]`` this loss weighs and clips tokens by, detached and clamped
        as the loss clamps it: ``exp(log_ratio)`` (GSPO: its sequence ratio, per token)."""
        return self.log_ratio(logprobs.detach().float(), old_logprobs.detach().float()).exp()

    @torch.no_grad()
    def reduce_stats(self, logprobs, old_logprobs, advantages, mask, token_stats) -> dict[str, Stat]:
        """The token statistics of :meth:`token_loss` as :class:`~aspo_lit.maths.stats.Stat` values: clip
        shares and ratio means over the response tokens of their sign, the loss's own statistics."""
        token_stats = dict(token_stats)
        ratio = self.ratio(logprobs, old_logprobs, mask)
        tokens_of = {"positive": mask & (advantages > 0), "negative": mask & (advantages < 0)}
        stats = {}
        for key, sign in CLIP_SIGNS.items():
            flags = token_stats.pop(key, None)
            flags = torch.zeros_like(mask) if flags is None else flags.bool()
            stats[key] = Stat.mean_over(flags, where=tokens_of[sign])
        stats["ratio/pos_mean"] = Stat.mean_over(ratio, where=tokens_of["positive"])
        stats["ratio/neg_mean"] = Stat.mean_over(ratio, where=tokens_of["negative"])
        for key, value in token_stats.items():
            if isinstance(value, Stat):
                stats[key] = value
            elif isinstance(value, Tensor) and value.shape == mask.shape:
                stats[key] = Stat.mean_over(value, where=mask)
            else:
                raise ValueError(f"{type(self).__name__}.token_loss: statistic {key!r} must be a [B, T] tensor "
                                 f"{tuple(mask.shape)} or a Stat, got {getattr(value, 'shape', type(value).__name__)}")
        return stats


# ----------------------------------------------------------------------------------------------
# the registry

def register_policy_loss(name: str) -> Callable:
    """Register a :class:`PolicyLoss` subclass -- or a plain ``token_loss``-shaped function -- as ``name``.

    A function ``fn(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, **extra)``
    returning the per-token loss (or ``(per_token_loss, flags)``) is wrapped into a
    :class:`PolicyLoss` subclass; its keyword parameters become extra hparams of
    ``get_policy_loss``. The decorator returns its argument unchanged (a function gets the
    generated class as ``fn.loss_class``).
    """
    def decorator(obj):
        if inspect.isclass(obj):
            if not issubclass(obj, PolicyLoss):
                raise TypeError(f"register_policy_loss({name!r}) needs a PolicyLoss subclass or a function")
            obj.name = name
            POLICY_LOSSES[name] = obj
            return obj
        if not callable(obj):
            raise TypeError(f"register_policy_loss({name!r}) needs a PolicyLoss subclass or a function")
        obj.loss_class = _loss_class_from_function(name, obj)
        POLICY_LOSSES[name] = obj.loss_class
        return obj
    return decorator


def _loss_class_from_function(name: str, fn: Callable) -> type[PolicyLoss]:
    params = list(inspect.signature(fn).parameters.values())[6:]
    extra_defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    class FunctionPolicyLoss(PolicyLoss):
        __doc__ = fn.__doc__

        def __init__(self, **hparams):
            base_names = set(inspect.signature(PolicyLoss.__init__).parameters) - {"self"}
            super().__init__(**{k: v for k, v in hparams.items() if k in base_names})
            self.extra_hparams = {**extra_defaults, **{k: v for k, v in hparams.items() if k not in base_names}}

        def token_loss(self, logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
            out = fn(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, **self.extra_hparams)
            return out if isinstance(out, tuple) else (out, {})

    FunctionPolicyLoss.__name__ = FunctionPolicyLoss.__qualname__ = f"{fn.__name__}_loss"
    FunctionPolicyLoss.__module__ = fn.__module__
    FunctionPolicyLoss.extra_hparam_names = tuple(p.name for p in params)
    FunctionPolicyLoss.accepts_any_hparam = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return FunctionPolicyLoss


def _valid_hparams(cls: type[PolicyLoss]) -> tuple[list[str], bool]:
    """(names the class accepts, whether it accepts any name)."""
    base = [k for k in inspect.signature(PolicyLoss.__init__).parameters if k != "self"]
    if hasattr(cls, "extra_hparam_names"):
        extra = [k for k in cls.extra_hparam_names if k not in base]
        return base + extra, cls.accepts_any_hparam
    params = inspect.signature(cls.__init__).parameters.values()
    names = [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def _as_loss_class(obj, where: str) -> type[PolicyLoss]:
    """A `PolicyLoss` subclass, or a function registered with :func:`register_policy_loss`."""
    cls = getattr(obj, "loss_class", obj)
    if not (inspect.isclass(cls) and issubclass(cls, PolicyLoss)):
        raise ValueError(f"policy loss {where} is {obj!r}, not a PolicyLoss subclass "
                         "(or a function decorated with @register_policy_loss)")
    return cls


def resolve_policy_loss(name: str) -> type[PolicyLoss]:
    """The loss class ``name`` names: a registered name, else an entry point of the
    :data:`ENTRY_POINT_GROUP` group, else an import path ``package.module:Class`` (or
    ``package.module.Class``)."""
    if name in POLICY_LOSSES:
        return POLICY_LOSSES[name]
    found = entry_points(group=ENTRY_POINT_GROUP, name=name)
    if found:
        return _as_loss_class(next(iter(found)).load(), f"entry point {name!r} ({ENTRY_POINT_GROUP})")
    module_name, _, attribute = name.partition(":") if ":" in name else name.rpartition(".")
    if module_name and attribute:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"policy loss {name!r}: cannot import {module_name!r} ({err})") from err
        if not hasattr(module, attribute):
            raise ValueError(f"policy loss {name!r}: module {module_name!r} has no {attribute!r}")
        return _as_loss_class(getattr(module, attribute), repr(name))
    installed = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    raise ValueError(f"unknown policy loss {name!r}; valid choices: {', '.join(sorted(POLICY_LOSSES))}"
                     + (f"; installed entry points: {', '.join(installed)}" if installed else "")
                     + "; or an import path such as mypkg.losses:MyLoss")


def get_policy_loss(name: str, **hparams) -> PolicyLoss:
    """Build the loss ``name`` names (:func:`resolve_policy_loss`) with ``hparams`` (see :class:`PolicyLoss`)."""
    cls = resolve_policy_loss(name)
    valid, any_name = _valid_hparams(cls)
    unknown = sorted(set(hparams) - set(valid))
    if unknown and not any_name:
        raise ValueError(f"unknown hparam(s) {unknown} for policy loss {name!r}; valid choices: {', '.join(valid)}")
    return cls(**hparams)


# ----------------------------------------------------------------------------------------------
# GRPO and its ablations

@register_policy_loss("grpo")
class GRPOLoss(PolicyLoss):
    """GRPO / PPO-clip, eq. 1: ``ℓ = -min(r·A, clip(r, 1-ε_low, 1+ε_high)·A)``, plus the standard
    dual clip for A<0 (``ℓ = min(ℓ, -c·A)``: a constant, so zero gradient, as verl's "vanilla").

    Prop. 4.1: its gradient is that of ``Σ sg(m·r)·A·lp``, m = 0 on the hard-clipped and
    dual-clipped tokens, 1 elsewhere.
    """

    def token_loss(self, logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
        objective, flags = self.clipped_objective(self.log_ratio(logprobs, old_logprobs), advantages, eps_low, eps_high)
        return -objective, flags

    def clipped_objective(self, log_ratio, advantages, eps_low, eps_high) -> tuple[Tensor, dict[str, Tensor]]:
        """The per-token PPO-clip objective with the dual clip, and its clip flags."""
        ratio = log_ratio.exp()
        regions = clip_regions(log_ratio.detach(), advantages, eps_low, eps_high)
        surrogate = ratio * advantages
        clipped_surrogate = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages
        ppo_objective = torch.minimum(surrogate, clipped_surrogate)
        dual_clipped = regions.is_negative & (ratio.detach() > self.dual_clip)
        objective = torch.where(dual_clipped, self.dual_clip * advantages, ppo_objective)
        flags = {"clip/pos_high": regions.pos_high, "clip/neg_low": regions.neg_low, "clip/neg_dual": dual_clipped}
        return objective, flags


@register_policy_loss("grpo_no_is")
class GRPONoISLoss(GRPOLoss):
    """"GRPO w/o IS" (Sec. 4.2): GRPO's gradient mask with every IS weight fixed to 1,
    ``ℓ = -m·A·lp`` (m as in :class:`GRPOLoss`, the dual-clipped tokens included in m = 0)."""

    def token_loss(self, logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
        log_ratio = self.log_ratio(logprobs, old_logprobs).detach()
        regions = clip_regions(log_ratio, advantages, eps_low, eps_high)
        dual_clipped = regions.is_negative & (log_ratio > math.log(self.dual_clip))
        active = ~(regions.pos_high | regions.neg_low | dual_clipped)
        objective = active * advantages * logprobs
        flags = {"clip/pos_high": regions.pos_high, "clip/neg_low": regions.neg_low, "clip/neg_dual": dual_clipped}
        return -objective, flags


@register_policy_loss("grpo_pos_mean")
class GRPOPosMeanLoss(GRPOLoss):
    """"GRPO w/ Pos. Resp. IS Mean" (Sec. 5.3): for A>0 each token's IS weight is replaced by its
    response's mean ratio (detached; gradient through lp), keeping GRPO's clip mask on the token's
    own r: ``ℓ = -sg(m·r̄_i)·A·lp``. A<0 tokens are exactly GRPO.
    """

    def token_loss(self, logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
        log_ratio = self.log_ratio(logprobs, old_logprobs)
        grpo_objective, flags = self.clipped_objective(log_ratio, advantages, eps_low, eps_high)
        response_mean_ratio = masked_row_mean(log_ratio.detach().exp(), mask)
        mean_weight = torch.where(flags["clip/pos_high"], 0.0, response_mean_ratio)
        positive_objective = mean_weight * advantages * logprobs
        objective = torch.where(advantages > 0, positive_objective, grpo_objective)
        return -objective, flags


@register_policy_loss("cispo")
class CISPOLoss(PolicyLoss):
    """CISPO (MiniMax-M1): ``ℓ = -sg(clip(r, 1-ε_low, 1+ε_high))·A·lp`` -- the IS weight is clipped,
    no token loses its gradient."""

    def token_loss(self, logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
        log_ratio = self.log_ratio(logprobs, old_logprobs).detach()
        regions = clip_regions(log_ratio, advantages, eps_low, eps_high)
        clipped_weight = torch.clamp(log_ratio.exp(), 1 - eps_low, 1 + eps_high)
        objective = clipped_weight * advantages * logprobs
        return -objective, {"clip/pos_high": regions.pos_high, "clip/neg_low": regions.neg_low}


@register_policy_loss("gspo")
class GSPOLoss(PolicyLoss):
    """GSPO (Zheng et al. 2025), token form: the sequence ratio ``s_i = exp(mean_t log r_t)``
    enters PPO-clip in place of ``r_t`` with value ``s_i`` and gradient ``s_i·∇lp_t``; with
    ``seq-mean-token-mean`` this is exactly GSPO's sequence-level gradient. No dual clip.
    """

    def log_sequence_ratio(self, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
        """``log s_i`` ``[B, 1]``: the mean token log-ratio of each response, clamped, detached."""
        log_token_ratio = torch.where(mask.bool(), logprobs.detach() - old_logprobs.detach(), 0.0)
        return masked_row_mean(log_token_ratio, mask.bool()).clamp(-self.clamp_log_ratio, self.clamp_log_ratio)

    def ratio(self, logprobs, old_logprobs, mask):
        return self.log_sequence_ratio(logprobs.float(), old_logprobs.float(), mask).exp().expand(mask.shape)

    def token_loss(self, logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
        log_seq_ratio = self.log_sequence_ratio(logprobs, old_logprobs, mask)
        seq_ratio = torch.exp(log_seq_ratio + logprobs - logprobs.detach())
        regions = clip_regions(log_seq_ratio, advantages, eps_low, eps_high)
        surrogate = seq_ratio * advantages
        clipped_surrogate = torch.clamp(seq_ratio, 1 - eps_low, 1 + eps_high) * advantages
        objective = torch.minimum(surrogate, clipped_surrogate)
        return -objective, {"clip/pos_high": regions.pos_high, "clip/neg_low": regions.neg_low}


# ----------------------------------------------------------------------------------------------
# ASPO (Sec. 6)

@register_policy_loss("aspo")
class ASPOLoss(PolicyLoss):
    """ASPO, Sec. 6 -- three steps on top of GRPO's ratio:

    1. token masking: GRPO's hard clip on the original r (A>0 and r > 1+ε_high, or A<0 and
       r < 1-ε_low): log r is replaced by the clip bound -- value at the bound, no gradient;
    2. weight flipping (eq. 3): for A>0, ``r̂ = π_old·π / sg(π²)`` -- value ``1/r``, gradient
       ``(π_old/π)·∇lp`` (App. A.2) -- computed in log space as ``exp(log r - 2·sg(log r))``,
       never as a quotient of probabilities; A<0 keeps ``r̂ = r``;
    3. soft dual clip (CISPO-style: value clipped, gradient kept): where ``r̂ > c`` (i.e. 1/r > c
       for A>0, r > c for A<0) the term is ``-c·A·lp``. Hard-masked tokens have r̂ ≤ 1 < c.

    So ``ℓ = -r̂·A`` on active tokens, ``-c·A·lp`` on soft dual-clipped ones, and the constant
    ``-A/(1+ε_high)`` or ``-(1-ε_low)·A`` on hard-masked ones.
    """

    soft_dual_clip = True

    def token_loss(self, logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
        log_ratio = self.log_ratio(logprobs, old_logprobs)
        regions = clip_regions(log_ratio.detach(), advantages, eps_low, eps_high)

        hard_mask = regions.pos_high | regions.neg_low                                       # step 1
        clip_bound = torch.where(regions.is_positive, torch.log1p(eps_high), torch.log1p(-eps_low))
        clipped_log_ratio = torch.where(hard_mask, clip_bound, log_ratio)

        log_flipped_weight = clipped_log_ratio - 2 * clipped_log_ratio.detach()             # step 2
        aspo_ratio = torch.exp(torch.where(regions.is_positive, log_flipped_weight, clipped_log_ratio))

        flags = {"clip/pos_high": regions.pos_high, "clip/neg_low": regions.neg_low}
        if not self.soft_dual_clip:
            return -aspo_ratio * advantages, flags
        dual_clipped = aspo_ratio.detach() > self.dual_clip                                   # step 3
        objective = torch.where(dual_clipped, self.dual_clip * logprobs, aspo_ratio) * advantages
        flags["clip/pos_dual"] = dual_clipped & regions.is_positive
        flags["clip/neg_dual"] = dual_clipped & regions.is_negative
        return -objective, flags


@register_policy_loss("aspo_no_dual_clip")
class ASPONoDualClipLoss(ASPOLoss):
    """ASPO steps 1-2 only (the Fig. 8 ablation): flipped weights are not capped (``dual_clip``
    is accepted and ignored)."""

    soft_dual_clip = False


# ----------------------------------------------------------------------------------------------
# diagnostics

def effective_token_weight(loss_fn: PolicyLoss, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                           mask: Tensor, *, entropy: Tensor | None = None) -> Tensor:
    """Per-token weight ``w`` ``[B, T]`` with ``∂ℓ_t/∂lp_t = -w_t·A_t`` (Prop. 4.1 / Fig. 4).

    By autograd on ``loss_fn.token_loss`` (no aggregation, no model forward). 0 where A = 0 or
    the token is masked. GRPO: ``m·r``; ASPO: ``1/r`` on active positive tokens, ``c`` on soft
    dual-clipped ones.
    """
    logprobs, old_logprobs, advantages, mask = loss_fn.prepare_inputs(logprobs, old_logprobs, advantages, mask)
    eps_low, eps_high = loss_fn.token_eps(mask, entropy)
    logprobs = logprobs.detach().requires_grad_(True)
    with torch.enable_grad():
        per_token, _ = loss_fn.token_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
        if not per_token.requires_grad:
            return torch.zeros_like(logprobs).detach()
        (grad,) = torch.autograd.grad(per_token.sum(), logprobs, allow_unused=True)
    if grad is None:
        return torch.zeros_like(logprobs).detach()
    defined = mask & (advantages != 0)
    safe_advantages = torch.where(defined, advantages, 1.0)
    return torch.where(defined, -grad / safe_advantages, 0.0).detach()
