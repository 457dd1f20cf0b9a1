"""A user's loss as the README describes one: ASPO plus a statistic of its own, named by import
path (``model.loss: tests.helpers.user_loss:ASPOWithPositionStat``). The statistic's name holds "pos" but it
is a mean over *all* response tokens: its weight, not its name, says how to combine it."""

import torch

from aspo_lit.maths.losses import ASPOLoss


class ASPOWithPositionStat(ASPOLoss):
    """``train/position_mean``: the mean position (0-based) of the response tokens."""

    def token_loss(self, logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
        per_token, stats = super().token_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
        stats["position_mean"] = torch.arange(mask.shape[1], device=mask.device).float().expand_as(mask)
        return per_token, stats
