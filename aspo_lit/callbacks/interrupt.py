"""GracefulInterrupt: Ctrl-C / SIGTERM finish the current step, save `last.ckpt`, then stop; a
failed rollout engine process (`aspo_lit.rollout.process.EngineProcessError`) saves it too.

The first Ctrl-C or SIGTERM sets a flag (a second Ctrl-C aborts at once); at the end of the
current rollout batch the ranks agree (any rank interrupted stops them all, one collective per
batch, so no rank waits alone in the next step), save the checkpoint together (sharded under
FSDP2) and exit (Lightning's `SIGTERMException`, exit status 0). The handler replaces Lightning's SIGTERM handler, which broadcasts from inside
the signal handler and so could pair with a collective of the step in flight. An interruption
between periodic checkpoints loses nothing. The checkpoint holds the state after a
*completed* step (weights, optimizer, scheduler, step counters, dataloader position), which is
what makes `--ckpt_path last` continue exactly like an uninterrupted run.
"""

from __future__ import annotations

import signal
from pathlib import Path

from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info


class GracefulInterrupt(Checkpoint):
    """A `Checkpoint` so that Lightning runs its hooks after every other callback's: the saved state
    includes what the diagnostics recorded for the step that just ended."""

    def __init__(self) -> None:
        self._previous = None
        self._previous_term = None
        self._interrupted = False

    def _on_sigint(self, signum, frame) -> None:
        if self._interrupted:
            raise KeyboardInterrupt
        self._interrupted = True
        rank_zero_info("aspo-lit: interrupted; finishing the current step and saving last.ckpt (Ctrl-C again aborts)")

    def _on_sigterm(self, signum, frame) -> None:
        if not self._interrupted:
            rank_zero_info("aspo-lit: SIGTERM; finishing the current step and saving last.ckpt")
        self._interrupted = True

    def on_fit_start(self, trainer, pl_module) -> None:
        try:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        except ValueError:  # not the main thread: leave the signals alone
            self._previous = None

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning installs its SIGTERM handler after on_fit_start; replace it here
        try:
            self._previous_term = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:
            self._previous_term = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stopping = self._interrupted
        if trainer.world_size > 1:
            stopping = trainer.strategy.reduce_boolean_decision(stopping, all=False)
        if not stopping:
            return
        self._save_last(trainer)
        # Stop as Lightning does on SIGTERM: it raises `SIGTERMException` once this batch's metrics are
        # logged. (`should_stop` would end the epoch first, and the end-of-epoch `last.ckpt` would
        # then say the epoch was finished: a resume would skip the rest of it.)
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and hasattr(connector, "received_sigterm"):
            connector.received_sigterm = True
        else:  # pragma: no cover - other Lightning versions
            trainer.should_stop = True

    @staticmethod
    def _save_last(trainer) -> None:
        checkpoint = next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)), None)
        folder = Path(checkpoint.dirpath) if checkpoint is not None and checkpoint.dirpath else Path(trainer.log_dir or ".") / "checkpoints"
        path = folder / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"
        trainer.save_checkpoint(path)
        if checkpoint is not None:
            checkpoint.last_model_path = str(path)
        rank_zero_info(f"aspo-lit: saved {path}; resume with --ckpt_path last")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()
        from aspo_lit.rollout.process import EngineProcessError

        # the rollout engine's process failed between two rollout batches (every rank raised it
        # together, before the batch was counted): the state is the last completed step's
        if isinstance(exception, EngineProcessError) and trainer.training:
            self._save_last(trainer)

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if self._previous_term is not None:
            signal.signal(signal.SIGTERM, self._previous_term)
            self._previous_term = None
