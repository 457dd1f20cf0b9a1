"""One run per folder: a lock file naming the process (PID and host) that holds a run's checkpoint
folder (docs/running.md, "One run per folder")."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"


class RunFolderHeld(RuntimeError):
    """Another live process holds the run folder."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # alive, another user's
        return True
    return True


class RunLock:
    """The lock of `folder`, held by this process from `acquire` until `release`.

    A lock left by a dead process of this host is taken over with a warning; one held by a live
    process, or by a process of another host (whose liveness this host cannot see), is refused,
    naming the holder and the lock file to remove once that run is gone."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK_NAME
        self.held = False

    def holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"pid": None, "host": None, "unreadable": True}

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._clear_if_stale(self.holder())
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise RunFolderHeld(f"{self.path.parent}: could not take the run lock {self.path}")

    def _clear_if_stale(self, holder: dict | None) -> None:
        if holder is None:
            return
        pid, host = holder.get("pid"), holder.get("host")
        if holder.get("unreadable") or (host == socket.gethostname() and isinstance(pid, int) and not _alive(pid)):
            log.warning("run folder %s: taking over the lock of process %s on %s, which is gone",
                        self.path.parent, pid, host)
            self.path.unlink(missing_ok=True)
            return
        raise RunFolderHeld(
            f"run folder {self.path.parent} is held by process {pid} on {host} (since {holder.get('since')}): "
            "one run per folder. Wait for it, give this run another name (trainer.logger.init_args.name), or, "
            f"if that process is gone, remove {self.path}")

    def release(self) -> None:
        if self.held and (self.holder() or {}).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False
