"""RunCheckpoint: Lightning's ModelCheckpoint, kept per experiment rather than per logger version.

By default ModelCheckpoint writes into `<save_dir>/<name>/version_N/checkpoints`, so a restarted
run (a new version) cannot find its predecessor's `last.ckpt`. Here the default folder is
`<save_dir>/<name>/checkpoints`, shared by every version of the experiment: `--ckpt_path last`
resumes the newest `last*.ckpt` of the experiment, whichever version wrote it.

Its saves are atomic on the run folder's own filesystem (`aspo_lit.training.checkpoint_io`): the strategy's
plain `TorchCheckpointIO` is replaced by `AtomicCheckpointIO` at setup (a user's own CheckpointIO
plugin is kept).

One run per folder: a fit holds the folder's lock (`aspo_lit.training.run_lock`) from setup to teardown, and
a fresh fit (no ``--ckpt_path``) into a folder that holds another run's ``last.ckpt`` is refused,
so ``--ckpt_path last`` always resumes the run that wrote the folder, never a ``last-v1.ckpt``.

A checkpoint saved at a batch after which a validation is due (it is saved before that validation
runs) says so, and a resume from it runs that validation first, at that step: a crash during the
validation loses no ``val/*`` point.

A resume checks what it resumes (`aspo_lit.training.resume`): a change to what defines the run, or to a
setting the restored optimizer would ignore, is refused naming each key old -> new.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from aspo_lit.callbacks.val_before_train import validate_now, validation_due
from aspo_lit.training.checkpoint_io import AtomicCheckpointIO
from aspo_lit.training.resume import ALLOW_CHANGES, apply_optimizer_settings, refusal, resume_changes
from aspo_lit.training.run_lock import RunFolderHeld, RunLock


class ResumeRefused(ValueError):
    """A resume that would change what its checkpoint's run is (`aspo_lit.training.resume`)."""


class RunCheckpoint(ModelCheckpoint):
    _lock: RunLock | None = None
    _new_optimizer_settings = False
    _due_now = False           # a validation follows the batch that just ended
    _validation_due = False    # restored: the checkpoint's validation may not have run

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._due_now = validation_due(trainer)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._due_now = False
        super().on_validation_end(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "validation_due": self._due_now}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._validation_due = bool(state_dict.get("validation_due", False))

    def _use_experiment_dir(self, trainer) -> None:
        if self.dirpath is None and trainer.loggers:
            logger = trainer.loggers[0]
            root = Path(logger.save_dir or trainer.default_root_dir)
            self.dirpath = str(root / str(logger.name or "") / "checkpoints")

    def _find_last_checkpoints(self, trainer) -> set[str]:
        self._use_experiment_dir(trainer)
        return super()._find_last_checkpoints(trainer)

    def last_checkpoints(self, trainer) -> list[str]:
        """The ``last*.ckpt`` of this run's folder (what ``--ckpt_path last`` resumes)."""
        return sorted(self._find_last_checkpoints(trainer))

    def setup(self, trainer, pl_module, stage: str) -> None:
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        self._use_experiment_dir(trainer)
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and self.dirpath is not None:
            self._stop_all_ranks(trainer, self._take_lock() if trainer.is_global_zero else None)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        data = trainer.datamodule.hparams if trainer.datamodule is not None else None
        found = resume_changes(checkpoint, pl_module.hparams, data)
        message = refusal(trainer.ckpt_path, found)
        if message:
            raise ResumeRefused(message)
        for change in found["defining"] + found["optimizer"]:
            rank_zero_warn(f"resumed with a change ({ALLOW_CHANGES}): {change}")
        for change in found["read_afresh"]:
            rank_zero_info(f"resumed: {change} takes effect")
        self._new_optimizer_settings = bool(found["optimizer"])

    def on_train_start(self, trainer, pl_module) -> None:
        if self._new_optimizer_settings:   # after the optimizers' state was restored
            apply_optimizer_settings(trainer.optimizers, [c.scheduler for c in trainer.lr_scheduler_configs],
                                     pl_module.hparams)
            self._new_optimizer_settings = False
        # a fresh fit refuses a folder with another run's checkpoint (whether a checkpoint was
        # resumed is known only now: FSDP2 restores after the fit starts), before any save
        super().on_train_start(trainer, pl_module)
        held = None
        if trainer.is_global_zero and self.dirpath is not None and trainer.ckpt_path is None:
            existing = [Path(p).name for p in self.last_checkpoints(trainer)]
            if existing:
                held = (f"{self.dirpath} holds another run's checkpoint ({', '.join(existing)}): resume it "
                        "with --ckpt_path last, or start this run under another name "
                        "(trainer.logger.init_args.name), or move that folder away first")
        self._stop_all_ranks(trainer, held)
        if self._validation_due and trainer.ckpt_path is not None:   # put off by the end of the last process
            self._validation_due = False
            validate_now(trainer)

    def _take_lock(self) -> str | None:
        self._lock = RunLock(Path(self.dirpath))
        try:
            self._lock.acquire()
        except RunFolderHeld as err:
            self._lock = None
            return str(err)
        return None

    @staticmethod
    def _stop_all_ranks(trainer, refusal: str | None) -> None:
        """Raise rank 0's `refusal` on every rank (none waits alone in the next collective)."""
        refusal = trainer.strategy.broadcast(refusal)
        if refusal:
            raise RunFolderHeld(refusal)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        if self._lock is not None:
            self._lock.release()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        if self._lock is not None:
            self._lock.release()
