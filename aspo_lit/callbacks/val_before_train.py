"""ValBeforeTrain: one held-out evaluation of the untrained policy at step 0 (verl's
``trainer.val_before_train``), so a run's ``val/avg@K`` curve starts where RL starts.

Without it the first ``val/avg@K`` point comes after ``val_check_interval`` rollout batches of
training, and "start -> end" compares two trained models. Lightning's sanity check
(``num_sanity_val_steps``) logs nothing, so this runs the fit's own validation loop once, as the
training epoch loop does at ``val_check_interval``. A resumed run (step > 0) is not re-evaluated.
Sampling in validation draws from its own seeded generator, so the training rollouts are the same
with or without it.
"""

from __future__ import annotations

from lightning.pytorch import Callback


def validate_now(trainer) -> None:
    """Run the fit's own validation loop once, now, as the training epoch loop does at
    ``val_check_interval`` (also `RunCheckpoint`'s, for a validation a crash put off)."""
    loop = trainer.fit_loop.epoch_loop
    first_loop_iter = trainer._logger_connector._first_loop_iter
    trainer.validating = True  # the active loop is the validation loop while it runs
    loop.val_loop.run()
    trainer.training = True
    trainer._logger_connector._first_loop_iter = first_loop_iter


def validation_due(trainer) -> bool:
    """Whether the training epoch loop validates after the batch in progress (batch-based
    ``val_check_interval``: Lightning's rule)."""
    every = trainer.val_check_batch
    if not trainer.training or not trainer.enable_validation or not every or every == float("inf"):
        return False
    loop = trainer.fit_loop.epoch_loop
    done = loop.total_batch_idx if trainer.check_val_every_n_epoch is None else loop.batch_idx
    return (done + 1) % every == 0


class ValBeforeTrain(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step > 0 or trainer.limit_val_batches == 0 or trainer.sanity_checking:
            return
        validate_now(trainer)
