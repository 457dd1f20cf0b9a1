"""One run per folder (`aspo_lit.training.run_lock`, `RunCheckpoint`): a held folder is refused naming its
holder, a dead holder's lock is taken over, and a fresh fit never writes beside another run's
checkpoint (the ``last-v1.ckpt`` that ``--ckpt_path last`` would then resume)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from aspo_lit.callbacks import RunCheckpoint
from aspo_lit.training.run_lock import LOCK_NAME, RunFolderHeld, RunLock


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_held_folder_is_refused_naming_the_holder(tmp_path):
    lock = RunLock(tmp_path).acquire()
    held = json.loads((tmp_path / LOCK_NAME).read_text())
    assert held["host"] == socket.gethostname() and held["pid"] > 0
    with pytest.raises(RunFolderHeld, match=rf"held by process {held['pid']} on {socket.gethostname()}"):
        RunLock(tmp_path).acquire()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    RunLock(tmp_path).acquire().release()


def test_a_dead_holders_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = _dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "since": "then"}))
    with caplog.at_level(logging.WARNING, logger="aspo_lit.training.run_lock"):
        lock = RunLock(tmp_path).acquire()
    assert f"taking over the lock of process {dead}" in caplog.text
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] != dead
    lock.release()


def test_another_hosts_lock_is_not_guessed_dead(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": _dead_pid(), "host": "another-node", "since": "then"}))
    with pytest.raises(RunFolderHeld, match=rf"on another-node .* remove {tmp_path / LOCK_NAME}"):
        RunLock(tmp_path).acquire()


def _fit(folder, max_steps: int, ckpt_path=None) -> None:
    trainer = Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=folder,
                      callbacks=[RunCheckpoint(dirpath=folder / "checkpoints", save_last=True, save_top_k=0)])
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)


def test_a_fresh_fit_never_writes_beside_another_runs_checkpoint(tmp_path):
    _fit(tmp_path, 2)
    with pytest.raises(RunFolderHeld, match=r"holds another run's checkpoint \(last.ckpt\): resume it with "
                                            r"--ckpt_path last"):
        _fit(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt"]   # no last-v1, no lock
    _fit(tmp_path, 3, ckpt_path="last")                                                    # its own resume runs


def test_a_fit_on_a_folder_a_live_process_holds_is_refused(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "checkpoints" / LOCK_NAME).write_text(
            json.dumps({"pid": holder.pid, "host": socket.gethostname(), "since": "now"}))
        with pytest.raises(RunFolderHeld, match=rf"held by process {holder.pid}"):
            _fit(tmp_path, 1)
    finally:
        holder.kill()
        holder.wait()
