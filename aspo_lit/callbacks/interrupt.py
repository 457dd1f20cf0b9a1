"""GracefulInterrupt: Ctrl-C / SIGTERM finish the current step, save `last.ckpt`, then stop.

Lightning already turns SIGTERM into a stop after the current batch; this callback routes the
first Ctrl-C the same way (a second Ctrl-C aborts at once) and saves the checkpoint itself, so an
interruption between periodic checkpoints loses nothing. The checkpoint holds the state after a
*completed* step (weights, optimizer, scheduler, step counters, dataloader position), which is
what makes `--ckpt_path last` continue exactly like an uninterrupted run.
"""

from __future__ import annotations

import signal
from pathlib import Path

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info


class GracefulInterrupt(Callback):
    def __init__(self) -> None:
        self._previous = None
        self._interrupted = False

    def _on_sigint(self, signum, frame) -> None:
        if self._interrupted:
            raise KeyboardInterrupt
        self._interrupted = True
        rank_zero_info("aspo-lit: interrupted; finishing the current step and saving last.ckpt (Ctrl-C again aborts)")

    def on_fit_start(self, trainer, pl_module) -> None:
        try:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        except ValueError:  # not the main thread: leave Ctrl-C alone
            self._previous = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stopping = self._interrupted or trainer.received_sigterm
        if not stopping:
            return
        checkpoint = next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)), None)
        folder = Path(checkpoint.dirpath) if checkpoint is not None and checkpoint.dirpath else Path(trainer.log_dir or ".") / "checkpoints"
        path = folder / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"
        trainer.save_checkpoint(path)
        if checkpoint is not None:
            checkpoint.last_model_path = str(path)
        rank_zero_info(f"aspo-lit: saved {path}; resume with --ckpt_path last")
        trainer.should_stop = True

    def on_fit_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
