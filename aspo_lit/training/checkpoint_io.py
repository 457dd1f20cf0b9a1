"""Checkpoints written atomically on any local filesystem (docs/running.md, "Checkpoints").

Lightning's `TorchCheckpointIO` writes through an fsspec transaction whose temporary file lies in
``$TMPDIR``; when the run folder is on another filesystem (runs on NFS or Lustre, ``/tmp`` local)
the final move is a copy that truncates ``last.ckpt`` in place, so a failed save (a full disk, a
kill) leaves it torn and the run has nothing to resume from. Here the new checkpoint is written
*beside* its target, fsync'd, and renamed over it: until the rename the previous checkpoint is
whole; after it, the new one. A sharded (FSDP2) checkpoint folder is written beside its target and
swapped in with one atomic exchange (`swap_folder`).
"""

from __future__ import annotations

import ctypes
import errno
import io
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem


def staging_path(path: Path) -> Path:
    """Where the checkpoint `path` is written before it takes its name: beside it, hidden."""
    return path.with_name(f".{path.name}.partial")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointSpaceError(OSError):
    """A checkpoint save without the space it needs (ENOSPC): the path, the space, what is kept."""


def no_space(path: Path, needed: int, err: OSError | None = None) -> OSError:
    """The ENOSPC error of a save: the path, the bytes it needed, the space there, and what is kept."""
    free = shutil.disk_usage(path.parent).free
    kept = f"the previous checkpoint {path} is intact" if path.exists() else "no earlier checkpoint was there"
    return CheckpointSpaceError(errno.ENOSPC, f"no space to save the checkpoint {path}: it needs {needed / 2**20:.1f} MiB, "
                                 f"{free / 2**20:.1f} MiB are free on {path.parent}; {kept}. Free space there, or "
                                 "set the checkpoint callback's dirpath to a larger disk, and resume with "
                                 "--ckpt_path last", str(path))


def write_atomic(path: Path, data: memoryview | bytes) -> None:
    """Write `data` to `path` so that `path` is at every moment either its old content or all of
    `data`: a file beside it, fsync'd, renamed over it, then the folder fsync'd."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_path(path)
    if shutil.disk_usage(path.parent).free < len(data):
        raise no_space(path, len(data))
    try:
        with open(staged, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, path)
    except OSError as err:
        staged.unlink(missing_ok=True)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise no_space(path, len(data), err) from err
        raise
    _fsync_dir(path.parent)


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    platform or filesystem lacks it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(ctypes.get_errno(), f"cannot swap {a} and {b}: {os.strerror(ctypes.get_errno())}")


def swap_folder(staged: Path, path: Path) -> None:
    """Make the complete folder `staged` the checkpoint `path` (a sharded checkpoint): one atomic
    exchange where the filesystem has it (the old folder then lies at `staged`, removed), else a
    rename of the old one aside and the new one in, the old removed only after."""
    if not path.exists():
        os.replace(staged, path)
    elif not _exchange(staged, path):
        aside = path.with_name(f".{path.name}.previous")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        os.replace(staged, path)
        staged = aside
    shutil.rmtree(staged, ignore_errors=True)
    _fsync_dir(path.parent)


class CheckpointUnreadable(ValueError):
    """A checkpoint file that cannot be loaded: the file, what is wrong, and what to use instead."""


def unreadable(path: Path, err: BaseException) -> CheckpointUnreadable:
    """The error for a checkpoint `path` that failed to load with `err`: empty, not a checkpoint, or
    torn; and the other checkpoints of its folder, newest first, to resume from instead."""
    path = Path(path)
    size = path.stat().st_size if path.is_file() else None
    head = b""
    if size:
        with open(path, "rb") as f:
            head = f.read(4)
    if size == 0:
        what = "empty (0 bytes: a save that never wrote)"
    elif size is not None and head != b"PK\x03\x04":
        what = f"not a PyTorch checkpoint ({size} bytes starting {head!r})"
    else:
        what = f"torn or corrupt ({type(err).__name__}; {size if size is not None else 'a folder'}"
        what += " bytes)" if size is not None else ")"
    others = sorted((p for p in path.parent.glob("*.ckpt") if p != path), key=lambda p: p.stat().st_mtime,
                    reverse=True)
    instead = (f"resume from {others[0]} (--ckpt_path {others[0]}), the newest other checkpoint there" if others
               else f"no other checkpoint in {path.parent}: start the run again")
    return CheckpointUnreadable(f"checkpoint {path} cannot be loaded: {what}; {instead}")


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local saves are atomic on the checkpoint's own filesystem
    (`write_atomic`); a save that fails for lack of space names the path and the space it needed
    and leaves the previous checkpoint whole. Remote paths (``s3://`` ...) go through Lightning's."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        write_atomic(Path(path), buffer.getbuffer())

    def load_checkpoint(self, path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's load; a file that does not load is named with what is wrong with it
        (`unreadable`), never with torch's advice to unpickle it unsafely."""
        try:
            return super().load_checkpoint(path, *args, **kwargs)
        except FileNotFoundError:
            raise
        except Exception as err:   # every way a file fails to load gets its own message
            if not isinstance(get_filesystem(path), LocalFileSystem):
                raise
            raise unreadable(Path(path), err) from None
