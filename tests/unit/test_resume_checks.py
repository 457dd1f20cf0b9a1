"""A resume checks what it resumes (`aspo_lit.training.resume`, `RunCheckpoint.on_load_checkpoint`): a change
to what defines the run, or to a setting the restored optimizer would ignore, is refused naming each
key; with the expert's opt-in every change is applied and logged."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from aspo_lit.callbacks import RunCheckpoint
from aspo_lit.callbacks.checkpoint import ResumeRefused
from aspo_lit.training.resume import ALLOW_CHANGES, resume_changes


class Model(BoringModel):
    """A BoringModel with the hyperparameters a resume compares, and ASPOModule's optimizer shape."""

    def __init__(self, loss_name: str = "aspo", lr: float = 0.1, warmup_steps: int = 2, betas=(0.9, 0.999),
                 weight_decay: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.seen_lr: list[float] = []

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, betas=tuple(self.hparams.betas),
                                      weight_decay=self.hparams.weight_decay)
        warmup = self.hparams.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_batch_start(self, batch, batch_idx):
        self.seen_lr.append(self.trainer.optimizers[0].param_groups[0]["lr"])


def _fit(folder, model: Model, max_steps: int, ckpt_path=None) -> Model:
    trainer = Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=folder,
                      callbacks=[RunCheckpoint(dirpath=folder / "checkpoints", save_last=True, save_top_k=0)])
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


def test_changes_are_sorted_by_what_they_do():
    checkpoint = {"hyper_parameters": {"loss_name": "aspo", "lr": 1e-6, "warmup_steps": 10,
                                       "loss_kwargs": {"eps_high": 0.2}},
                  "datamodule_hyper_parameters": {"group_size": 16, "val_k": 8,
                                                  "_class_path": "data_modules.testbed.ArithmeticRLDataModule"}}
    found = resume_changes(checkpoint, {"loss_name": "grpo", "lr": 1e-5, "warmup_steps": 5,
                                        "loss_kwargs": {"eps_high": 0.28}},
                           {"group_size": 8, "val_k": 4, "_class_path": "data_modules.testbed.ArithmeticRLDataModule"})
    assert found == {"defining": ["model.loss: 'aspo' -> 'grpo'",
                                  "model.loss_kwargs: {'eps_high': 0.2} -> {'eps_high': 0.28}",
                                  "data.group_size: 16 -> 8"],
                     "optimizer": ["model.lr: 1e-06 -> 1e-05"], "read_afresh": ["model.warmup_steps: 10 -> 5"]}
    assert resume_changes(checkpoint, checkpoint["hyper_parameters"], checkpoint["datamodule_hyper_parameters"]) == {
        "defining": [], "optimizer": [], "read_afresh": []}


def test_a_resume_that_changes_the_run_is_refused_naming_each_key(tmp_path, monkeypatch):
    monkeypatch.delenv(ALLOW_CHANGES, raising=False)
    _fit(tmp_path, Model(), 2)
    with pytest.raises(ResumeRefused, match=r"model.loss: 'aspo' -> 'grpo'\n"):
        _fit(tmp_path, Model(loss_name="grpo"), 4, ckpt_path="last")
    with pytest.raises(ResumeRefused, match=r"model.lr: 0.1 -> 0.5 \(the optimizer state restored from the "
                                            r"checkpoint keeps the old value\)"):
        _fit(tmp_path, Model(lr=0.5), 4, ckpt_path="last")
    resumed = _fit(tmp_path, Model(), 3, ckpt_path="last")            # the same run resumes
    assert resumed.seen_lr == [0.1]                                  # step 3 of a 2-step warmup: lr itself


def test_an_expert_resume_with_a_new_lr_trains_with_it(tmp_path, monkeypatch):
    _fit(tmp_path, Model(), 1)                                       # at step 1 of the 2-step warmup
    monkeypatch.setenv(ALLOW_CHANGES, "1")
    with pytest.warns(UserWarning, match=r"resumed with a change \(ASPO_LIT_RESUME_WITH_CHANGES\): model.lr: 0.1 -> 0.5"):
        resumed = _fit(tmp_path, Model(lr=0.5), 3, ckpt_path="last")
    # the restored schedule continues (warmup 2/2, then 1) from the new lr, never the old one
    assert resumed.seen_lr == [0.5, 0.5]


def test_ckpt_path_last_with_nothing_to_resume_stops_in_one_line(tmp_path, capsys):
    from aspo_lit.__main__ import main

    assert main(["fit", "--config", "conf/tiny/aspo.yaml", f"--trainer.logger.init_args.save_dir={tmp_path}",
                 "--ckpt_path=last"]) != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"aspo-lit: config error: --ckpt_path last: no last checkpoint in {tmp_path}/tiny_aspo/checkpoints: "
                   "nothing to resume; leave out --ckpt_path to start the run")
    assert not (tmp_path / "tiny_aspo" / "checkpoints").exists() or not any((tmp_path / "tiny_aspo" / "checkpoints").iterdir())


CRASHING_FIT = '''
import os, signal, sys
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from aspo_lit.callbacks import RunCheckpoint

class Model(BoringModel):
    def on_validation_start(self):
        with open(sys.argv[2], "a") as f:
            f.write(f"{self.global_step}\\n")
        if sys.argv[3] == "crash" and self.global_step == 2:   # kill -9 while validating after step 2
            os.kill(os.getpid(), signal.SIGKILL)

folder = sys.argv[1]
trainer = Trainer(accelerator="cpu", max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0, default_root_dir=folder,
                  callbacks=[RunCheckpoint(dirpath=folder + "/c", save_last=True, save_top_k=0, every_n_train_steps=1)])
trainer.fit(Model(), ckpt_path="last" if sys.argv[3] == "resume" else None)
'''


def test_a_validation_a_crash_cut_short_runs_on_resume(tmp_path):
    """The checkpoint of step 2 is saved before step 2's validation; a kill -9 during it, then a
    resume: the validation runs first, at step 2, and every validation of the uninterrupted run is
    there (Lightning's resume would skip it)."""
    import subprocess
    import sys

    script = tmp_path / "fit.py"
    script.write_text(CRASHING_FIT)

    def fit(folder, mode):
        log = tmp_path / f"{folder}.val"
        subprocess.run([sys.executable, str(script), str(tmp_path / folder), str(log), mode], capture_output=True)
        return [int(s) for s in log.read_text().split()]

    assert fit("whole", "run") == [2, 4, 6]
    assert fit("crashed", "crash") == [2]                # killed inside step 2's validation
    assert fit("crashed", "resume") == [2, 2, 4, 6]      # the cut validation first, then the rest
