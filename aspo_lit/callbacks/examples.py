"""The README's example diagnostic: add a metric by writing one class and naming it in YAML."""

import torch

from aspo_lit.callbacks.base import Diagnostic, weighted_mean


class BoxedAnswerRate(Diagnostic):
    """``train/boxed_rate``: share of responses that give a ``\\boxed{}`` answer (all ranks)."""

    def compute(self, trainer, pl_module, diagnostics):
        boxed = torch.tensor([float("\\boxed" in text) for text in diagnostics["texts"]])
        return {"train/boxed_rate": weighted_mean(boxed, trainer=trainer)}
