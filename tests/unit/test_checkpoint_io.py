"""Checkpoints written atomically on the run folder's own filesystem (`aspo_lit.training.checkpoint_io`):
a save that fails at any byte leaves the previous checkpoint whole and names the path and space."""

from __future__ import annotations

import errno
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Trainer

from aspo_lit.callbacks import RunCheckpoint
from aspo_lit.training.checkpoint_io import AtomicCheckpointIO, staging_path, swap_folder

MIB = 2**20


def _state(mib: float, value: float) -> dict:
    return {"w": torch.full((int(mib * MIB) // 4,), value)}


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MiB tmpfs as the run folder, on another filesystem than ``$TMPDIR`` (needs root)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_save_renames_a_new_file_over_the_old_one(small_disk):
    """Lightning's move from ``$TMPDIR`` across filesystems is a copy into the old inode (torn when
    it fails); the atomic save makes a new file beside it and renames it: a new inode every time."""
    path, io = small_disk / "checkpoints" / "last.ckpt", AtomicCheckpointIO()
    io.save_checkpoint(_state(1, 1.0), path)
    first = path.stat().st_ino
    io.save_checkpoint(_state(1, 2.0), path)
    assert path.stat().st_ino != first
    assert torch.equal(torch.load(path)["w"], _state(1, 2.0)["w"])
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]


def test_a_full_disk_leaves_the_last_checkpoint_whole_and_says_where(small_disk, monkeypatch):
    path, io = small_disk / "last.ckpt", AtomicCheckpointIO()
    io.save_checkpoint(_state(4, 1.0), path)                 # 4 MiB of 12
    (small_disk / "other_writer").write_bytes(b"\0" * (5 * MIB))
    with pytest.raises(OSError, match=r"no space to save the checkpoint .*last.ckpt: it needs 4.0 MiB, .* MiB are "
                                      r"free on .*; the previous checkpoint .* is intact") as caught:
        io.save_checkpoint(_state(4, 2.0), path)             # refused before writing: 3 MiB free
    assert caught.value.errno == errno.ENOSPC
    # the space checked, then taken by another writer mid-save: the write itself fails
    monkeypatch.setattr("aspo_lit.training.checkpoint_io.shutil.disk_usage", lambda p: SimpleNamespace(free=1 << 40))
    with pytest.raises(OSError, match="no space to save the checkpoint") as caught:
        io.save_checkpoint(_state(4, 3.0), path)
    assert caught.value.errno == errno.ENOSPC
    assert torch.equal(torch.load(path)["w"], _state(4, 1.0)["w"])     # whole, the first save's
    assert not staging_path(path).exists()


def test_lightning_checkpoint_io_tears_the_checkpoint_on_a_full_disk(small_disk):
    """Why the atomic save exists: the same fault with Lightning's own CheckpointIO (temporary file
    in ``$TMPDIR``, another filesystem) leaves ``last.ckpt`` torn."""
    path = small_disk / "last.ckpt"
    TorchCheckpointIO().save_checkpoint(_state(4, 1.0), path)
    (small_disk / "other_writer").write_bytes(b"\0" * (5 * MIB))
    with pytest.raises(OSError):     # the copy truncates the old 4 MiB, then runs out at 7 of 8
        TorchCheckpointIO().save_checkpoint(_state(8, 2.0), path)
    with pytest.raises(Exception):   # noqa: B017 - whatever torch.load makes of a torn file
        torch.load(path)


def test_a_sharded_folder_is_swapped_in_whole(tmp_path):
    path = tmp_path / "last.ckpt"
    path.mkdir()
    (path / "shard_0").write_text("old")
    staged = staging_path(path)
    staged.mkdir()
    (staged / "shard_0").write_text("new")
    (staged / "meta.pt").write_text("new")
    swap_folder(staged, path)
    assert sorted(p.name for p in path.iterdir()) == ["meta.pt", "shard_0"] and (path / "shard_0").read_text() == "new"
    assert not staged.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_run_checkpoint_makes_the_strategy_save_atomically(tmp_path):
    callback = RunCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = Trainer(accelerator="cpu", logger=False, callbacks=[callback], default_root_dir=tmp_path)
    callback.setup(trainer, None, "fit")
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO
