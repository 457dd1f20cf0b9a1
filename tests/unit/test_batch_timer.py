"""The whole batch accounted for: `BatchTimer` keeps each Lightning profiler action's own seconds,
`batch_accounting` groups them into ``timing/*`` keys that sum to the window, and `TrainingStats`
logs them from a real fit, with a user's own profiler still receiving every action."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.profilers import SimpleProfiler

from aspo_lit.callbacks import TrainingStats
from aspo_lit.callbacks.batch_timer import STAGES, BatchTimer, batch_accounting, callback_key
from tests.helpers.tolerance import rounding_tol
from tests.unit.test_callbacks import fit, last_logged


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_own_seconds_partition_nested_actions_and_take_cuts_open_ones():
    clock = Clock()
    timer = BatchTimer(clock=clock)
    timer.start("run_training_epoch")
    clock.now = 1.0
    timer.start("run_training_batch")
    clock.now = 3.0
    timer.start("[Callback]A.on_before_backward")   # a callback hook inside the step
    clock.now = 3.5
    timer.stop("[Callback]A.on_before_backward")
    clock.now = 4.0
    timer.stop("run_training_batch")
    timer.start("[Callback]B.on_train_batch_end")
    clock.now = 6.0
    window, own = timer.take()                      # inside B's hook, as TrainingStats' compute is
    assert window == 6.0
    assert own == {"run_training_epoch": 1.0, "run_training_batch": 2.5, "[Callback]A.on_before_backward": 0.5,
                   "[Callback]B.on_train_batch_end": 2.0}
    clock.now = 7.0
    timer.stop("[Callback]B.on_train_batch_end")    # its last second belongs to the next window
    clock.now = 10.0
    window, own = timer.take()
    assert window == 4.0
    assert own == {"[Callback]B.on_train_batch_end": 1.0, "run_training_epoch": 3.0}
    assert sum(own.values()) == window


def test_phase_names_validation_actions_and_a_hook_that_changes_it_still_closes():
    clock = Clock()
    timer = BatchTimer(clock=clock)
    timer.start("[Callback]TrainingStats.on_validation_start")
    timer.phase = "validation:"                      # set inside the hook, as TrainingStats does
    clock.now = 1.0
    timer.stop("[Callback]TrainingStats.on_validation_start")
    timer.start("[LightningDataModule]RLDataModule.on_after_batch_transfer")
    clock.now = 3.0
    timer.stop("[LightningDataModule]RLDataModule.on_after_batch_transfer")
    window, own = timer.take()
    assert own == {"[Callback]TrainingStats.on_validation_start": 1.0,
                   "validation:[LightningDataModule]RLDataModule.on_after_batch_transfer": 2.0}
    parts = batch_accounting(window, own, ["TrainingStats"])
    assert parts["timing/validation_s"] == 2.0 and parts[callback_key("TrainingStats")] == 1.0
    assert parts["timing/data_s"] == 0.0           # the evaluation's generation is not the rollout's


def test_accounting_groups_every_action_and_sums_to_the_window():
    own = {
        "[_TrainingEpochLoop].train_dataloader_next": 0.01,
        "[LightningDataModule]RLDataModule.on_after_batch_transfer": 0.4,
        "[Strategy]SingleDeviceStrategy.batch_to_device": 0.001,
        "run_training_batch": 0.05, "[LightningModule]ASPOModule.training_step": 1.1,
        "[Strategy]SingleDeviceStrategy.training_step": 0.002,
        "[Callback]EntropyMonitor.on_train_batch_end": 0.03,
        "[Callback]RunCheckpoint{'monitor': None, 'mode': 'min'}.on_train_batch_end": 0.2,
        "[Callback]Unknown.on_train_batch_end": 0.004,
        "[LightningModule]ASPOModule.on_train_batch_end": 0.003,
        "run_training_epoch": 0.07, "save_checkpoint": 0.3,
    }
    parts = batch_accounting(2.0, own, ["EntropyMonitor", "RunCheckpoint", "TrainingStats"])
    assert set(parts) == {*STAGES, "timing/unprofiled_s", "timing/batch_s",
                          *(callback_key(n) for n in ("EntropyMonitor", "RunCheckpoint", "TrainingStats"))}
    assert parts["timing/fetch_s"] == 0.01 and parts["timing/data_s"] == 0.4
    assert parts["timing/train_step_s"] == pytest.approx(1.152, rel=rounding_tol(torch.float64, 3))
    assert parts[callback_key("RunCheckpoint")] == 0.2 and parts[callback_key("TrainingStats")] == 0.0
    assert parts["timing/hooks_s"] == pytest.approx(0.008, rel=rounding_tol(torch.float64, 3))
    assert parts["timing/loop_s"] == 0.07 and parts["timing/checkpoint_s"] == 0.3
    # the parts and the remainder add up to the window: 12 additions of doubles, then one subtraction
    total = sum(v for k, v in parts.items() if k != "timing/batch_s")
    assert total == pytest.approx(2.0, rel=rounding_tol(torch.float64, 14))
    assert parts["timing/unprofiled_s"] == pytest.approx(2.0 - sum(own.values()), rel=rounding_tol(torch.float64, 14))


class Sleepy(Callback):
    """A diagnostic that costs ``seconds`` (50 ms) a batch."""

    def __init__(self, seconds: float = 0.05) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.seconds)


def test_fit_logs_the_whole_batch_and_the_users_profiler_still_profiles(tmp_path):
    profiler = SimpleProfiler()
    trainer = fit(tmp_path, [TrainingStats(), Sleepy()], max_steps=4, profiler=profiler)
    assert isinstance(trainer.profiler, BatchTimer) and trainer.profiler.inner is profiler
    logged = last_logged(trainer.log_dir)
    # Sleepy runs after TrainingStats: its 50 ms of batch k are in batch k+1's window, whole
    assert 0.05 <= logged[callback_key("Sleepy")] < logged["timing/batch_s"]
    parts = [v for k, v in logged.items() if k.startswith("timing/") and k not in
             ("timing/batch_s", "timing/step_s", "timing/rollout_s", "timing/old_logprob_s", "timing/update_s",
              "timing/reward_s", "timing/weight_sync_s")]
    # logged in fp32: each part rounded once, ~14 of them added
    assert math.fsum(parts) == pytest.approx(logged["timing/batch_s"], rel=rounding_tol(torch.float32, 16))
    assert logged["timing/unprofiled_s"] < 0.1 * logged["timing/batch_s"]
    assert "[Callback]Sleepy.on_train_batch_end" in profiler.recorded_durations
    assert len(profiler.recorded_durations["[Callback]Sleepy.on_train_batch_end"]) == 4


def test_accounting_table_reads_a_runs_metrics(tmp_path, capsys):
    """tools/perf/batch_accounting.py --metrics: the batch, then its parts largest first, each with its share."""
    from tools.perf import batch_accounting as module

    # 0.5 s a batch: the largest part on any machine (a tiny train step takes 20-100 ms, more under load)
    trainer = fit(tmp_path, [TrainingStats(), Sleepy(0.5)], max_steps=3)
    assert module.main(["--metrics", str(next(Path(trainer.log_dir).rglob("metrics.csv")))]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1].strip() for line in out.splitlines()[2:] if line.startswith("|")]
    assert rows[0] == "`timing/batch_s`" and rows[1] == f"`{callback_key('Sleepy')}`"  # the largest part
    assert "`timing/unprofiled_s`" in rows
    assert "engine_wake_s" not in out and "nan" not in out      # the parts this run's engine does not log
