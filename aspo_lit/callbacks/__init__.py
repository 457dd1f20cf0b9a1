"""Diagnostics callbacks: they read the `~aspo_lit.maths.step.StepOutput` ``ASPOModule.training_step``
returns (docs/design.md "Step diagnostics") and log what the IS ratio does to a run (paper Fig. 2-4,
App. D). Extend with :class:`Diagnostic`; ``examples.py`` holds worked examples, not part of the API.
"""

from aspo_lit.callbacks.base import (
    Diagnostic,
    global_cat,
    global_max,
    global_maxes,
    global_sum,
    reduce_stats,
    weighted_mean,
    weighted_means,
)
from aspo_lit.callbacks.checkpoint import RunCheckpoint
from aspo_lit.callbacks.counterfactual_weights import CounterfactualWeights
from aspo_lit.callbacks.entropy import EntropyMonitor
from aspo_lit.callbacks.entropy_mechanism import EntropyMechanism
from aspo_lit.callbacks.health import HealthMonitor, assess_health
from aspo_lit.callbacks.interrupt import GracefulInterrupt
from aspo_lit.callbacks.progress import DiagnosticsProgressBar, DiagnosticsTQDMProgressBar
from aspo_lit.callbacks.repetition import RepetitionDiagnostic, ngram_stats
from aspo_lit.callbacks.summary import RunSummary
from aspo_lit.callbacks.token_weights import TokenWeightSurface, bin_token_weights
from aspo_lit.callbacks.training_stats import TrainingStats
from aspo_lit.callbacks.val_before_train import ValBeforeTrain

__all__ = [
    "Diagnostic", "weighted_mean", "weighted_means", "global_cat", "global_max", "global_maxes", "global_sum", "reduce_stats",
    "EntropyMonitor", "EntropyMechanism", "CounterfactualWeights", "RepetitionDiagnostic", "TrainingStats", "HealthMonitor", "TokenWeightSurface",
    "DiagnosticsProgressBar", "DiagnosticsTQDMProgressBar",
    "GracefulInterrupt", "RunCheckpoint", "RunSummary", "ValBeforeTrain", "assess_health", "bin_token_weights", "ngram_stats",
]
