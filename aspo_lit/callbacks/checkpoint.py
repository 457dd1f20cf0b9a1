"""RunCheckpoint: Lightning's ModelCheckpoint, kept per experiment rather than per logger version.

By default ModelCheckpoint writes into `<save_dir>/<name>/version_N/checkpoints`, so a restarted
run (a new version) cannot find its predecessor's `last.ckpt`. Here the default folder is
`<save_dir>/<name>/checkpoints`, shared by every version of the experiment: `--ckpt_path last`
resumes the newest `last*.ckpt` of the experiment, whichever version wrote it.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint


class RunCheckpoint(ModelCheckpoint):
    def _use_experiment_dir(self, trainer) -> None:
        if self.dirpath is None and trainer.loggers:
            logger = trainer.loggers[0]
            root = Path(logger.save_dir or trainer.default_root_dir)
            self.dirpath = str(root / str(logger.name or "") / "checkpoints")

    def _find_last_checkpoints(self, trainer) -> set[str]:
        self._use_experiment_dir(trainer)
        return super()._find_last_checkpoints(trainer)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._use_experiment_dir(trainer)
        super().setup(trainer, pl_module, stage)
