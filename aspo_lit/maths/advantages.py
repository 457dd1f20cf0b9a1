"""Group-relative advantages (GRPO, eq. 1 of the paper; docs/design.md).

Rewards are laid out group-contiguously: rows ``g*G .. g*G+G-1`` are the G responses of prompt g.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ADVANTAGE_NORMS", "group_advantages"]

ADVANTAGE_NORMS = ("std", "none")


def group_advantages(rewards: Tensor, group_size: int, norm: str = "std", eps: float = 1e-6
                     ) -> tuple[Tensor, Tensor]:
    """``A_i = (R_i - mean_G R) / (std_G R + eps)`` per group of ``group_size`` responses.

    ``norm="std"`` is GRPO (eq. 1) with torch's *unbiased* standard deviation (``torch.std``,
    Bessel's correction, as verl's GRPO estimator); ``norm="none"`` is Dr.GRPO (mean-centred only).

    Returns ``(advantages [N] fp32, all_equal [N // G] bool)``. A group whose rewards are all
    equal carries no learning signal: its advantages are exactly 0 and it is flagged, so callers
    can count it (``batch/solve_all``, ``batch/solve_none``) or drop it (``filter_groups``).
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D [N] tensor, got {getattr(rewards, 'shape', type(rewards))}")
    if norm not in ADVANTAGE_NORMS:
        raise ValueError(f"unknown norm {norm!r}; valid choices: {', '.join(ADVANTAGE_NORMS)}")
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    rewards = rewards.detach().float()
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contains NaN or inf")

    grouped = rewards.view(-1, group_size)
    all_equal = (grouped == grouped[:, :1]).all(dim=-1)
    centred = grouped - grouped.mean(dim=-1, keepdim=True)
    if norm == "std":
        centred = centred / (grouped.std(dim=-1, keepdim=True) + eps)
    advantages = torch.where(all_equal.unsqueeze(-1), 0.0, centred)
    return advantages.reshape(-1), all_equal
