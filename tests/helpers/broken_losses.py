"""ASPO broken on purpose, for the reference-band check (docs/compare.md, "Broken runs"): a run
trained with one of these must leave the bands of the config's reference. Named by import path,
as a user's loss is: ``--model.loss=tests.helpers.broken_losses:ASPOSignFlipped``.

The sign flip keeps ASPO's ratio and clip flags, so its break is in the update alone; the unit
ratio is the ratio itself gone wrong, so every statistic made from it shows it too."""

from aspo_lit.maths.losses import ASPOLoss


class ASPOSignFlipped(ASPOLoss):
    """ASPO's per-token loss negated: gradient ascent on ASPO's loss, i.e. descent on the reward."""

    def token_loss(self, logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
        per_token, flags = super().token_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
        return -per_token, flags


class ASPOUnitRatio(ASPOLoss):
    """ASPO whose importance ratio is 1: ``log r = lp - sg(lp)`` (value 0, gradient ``∇lp``) in
    place of ``lp - old`` (Sec. 2, eq. 1), as if ``old_logprobs`` were the current log-probs. Every
    step of ASPO then sees r = 1: nothing is hard-masked, the flipped weight is 1, and the ratio the
    step records (``PolicyLoss.ratio``) is 1 on every token, the bug an IS-ratio regression makes."""

    def log_ratio(self, logprobs, old_logprobs):
        return logprobs - logprobs.detach()
