"""The README's example diagnostics: add a metric by writing one class and appending it in YAML."""

import torch

from aspo_lit.callbacks.base import Diagnostic, weighted_mean


class BoxedAnswerRate(Diagnostic):
    """``train/boxed_rate``: share of responses that give a ``\\boxed{}`` answer (all ranks)."""

    def compute(self, trainer, pl_module, step):
        boxed = torch.tensor([float("\\boxed" in text) for text in step.texts])
        return {"train/boxed_rate": weighted_mean(boxed, trainer=trainer)}


class TokenMeanRatio(Diagnostic):
    """``ratio/token_mean``: the loss's IS ratio averaged over response tokens, each token weighing 1
    (a long response counts by its length; padding by nothing), over all ranks."""

    def compute(self, trainer, pl_module, step):
        return {"ratio/token_mean": weighted_mean(step.ratio, step.response_mask, trainer=trainer)}
