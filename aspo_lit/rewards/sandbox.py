"""Isolation for generated programs: bubblewrap namespaces, rlimits, one memory cgroup per run.

``Sandbox`` starts the test harness (``aspo_lit/rewards/harness.py``) for one program and ends it.
What a program can reach, with the default ``SandboxConfig`` (every switch exists so that a test
can turn one protection off and watch its attack succeed):

* **bubblewrap** (``kind="bwrap"``): new user, pid, network, IPC, UTS and cgroup namespaces (no
  network at all), every capability dropped, no further user namespaces, a fresh session, killed
  if the grader dies. The root file system holds only read-only ``/usr`` (+ ``/lib*``, ``/bin``
  links), the interpreter, a fresh ``/proc``, a minimal ``/dev``, the harness file (copied in,
  read-only) and a private size-limited tmpfs ``/tmp`` as the working folder: nothing of the
  repository, the home folder or checkpoints; the environment is empty. As root, bubblewrap runs
  as ``nobody`` (``run_as_uid``) so that ``RLIMIT_NPROC`` applies, counted per sandbox.
* **the harness is out of the program's reach** (``protect_harness``): it is the pid namespace's
  init (``--as-pid-1``: init gets no signal from inside its namespace that it has no handler for,
  SIGKILL and SIGSTOP included) and not dumpable (``PR_SET_DUMPABLE 0``: ptrace, ``pidfd_getfd``
  and ``/proc/<pid>/fd`` need ptrace access, which needs a capability the sandbox does not have).
  So the program cannot stop it, trace it, or open its reply pipe to forge a result.
* **rlimits** on every test process: CPU seconds, address space, process count, file size (caps
  the output and every memfd), open files, no core files.
* **one memory cgroup per run** (``memory_cgroup``, ``memory_bytes``): a shell moves itself into a
  fresh cgroup under the grader's own and then execs the sandbox, so every process of the run, its
  memfds and its tmpfs pages are charged to one limit (cgroup v1 ``memory.limit_in_bytes`` +
  ``memsw``, or v2 ``memory.max`` + ``memory.swap.max``); past it the kernel's OOM killer ends the
  run (score 0). Where no memory cgroup is writable (not root, or a v2 hierarchy without
  delegation) the run says so once and falls back to the rlimits above: ``FALLBACK_LIMITS``.
* **wall clocks** kept by the grader, outside the sandbox (``CodeReward``): per test and per
  program; ``stop`` kills the namespace's init, bwrap's process group and what is left in the
  cgroup.
* ``kind="rlimit"`` opts into rlimit-only isolation (same harness, limits and cgroup; a host
  temporary folder as working folder, as root an otherwise unused uid per concurrent sandbox, but
  no namespaces: the program sees the file system and the network). Never chosen automatically.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from aspo_lit.maths.settings import check_choice

log = logging.getLogger(__name__)

__all__ = ["FALLBACK_LIMITS", "MemoryCgroup", "OPT_IN_HINT", "SANDBOXES", "Sandbox", "SandboxConfig", "SandboxKind",
           "SandboxUnavailable", "find_cgroup_parent", "find_python"]

SandboxKind = Literal["bwrap", "rlimit"]
SANDBOXES: tuple[str, ...] = get_args(SandboxKind)
OPT_IN_HINT = ("set sandbox='rlimit' to opt into rlimit-only isolation (no file-system or network "
               "isolation): CodeReward(sandbox='rlimit'), YAML data.init_args.sandbox: rlimit, "
               "or evaluate --sandbox rlimit")
FALLBACK_LIMITS = ("memory is bounded per process only (address space x process count, plus memfd "
                   "files up to the file-size limit x open files each), not as one total per sandbox")
HARNESS = Path(__file__).with_name("harness.py")
HARNESS_SOURCE = HARNESS.read_bytes()
HARNESS_INSIDE = "/aspo-harness.py"


class SandboxUnavailable(RuntimeError):
    """The requested sandbox cannot run here; the message is one line and names the opt-in."""


# --------------------------------------------------------------------------- memory cgroups


def find_cgroup_parent() -> tuple[str | None, str]:
    """(a writable memory cgroup folder to make per-run cgroups in, or None; why not). The
    grader's own memory cgroup (v1 ``memory`` hierarchy, or v2 when it delegates ``memory`` to its
    children), so that the runs stay inside whatever limit the grader itself has."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError as err:
        return None, f"/proc/self/cgroup: {err}"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = f"/sys/fs/cgroup/memory{path}"
            if os.path.isfile(os.path.join(folder, "memory.limit_in_bytes")) and os.access(folder, os.W_OK):
                return folder, ""
            return None, f"cgroup v1 memory folder {folder} is not writable"
    for line in lines:
        if line.startswith("0::"):
            folder = "/sys/fs/cgroup" + line[3:]
            try:
                delegated = "memory" in open(os.path.join(folder, "cgroup.subtree_control")).read().split()
            except OSError as err:
                return None, f"cgroup v2 {folder}: {err}"
            if delegated and os.access(folder, os.W_OK):
                return folder, ""
            return None, f"cgroup v2 {folder} does not delegate the memory controller to this user"
    return None, "no memory cgroup hierarchy is mounted"


class MemoryCgroup:
    """A fresh memory cgroup under ``parent`` limited to ``limit_bytes`` (swap included), whose
    ``procs`` file ``uid`` (the sandbox's user) may write itself into."""

    def __init__(self, parent: str, limit_bytes: int, uid: int | None):
        self.path = os.path.join(parent, f"aspo-sandbox-{uuid.uuid4().hex[:16]}")
        os.mkdir(self.path)
        try:
            v1 = os.path.isfile(os.path.join(self.path, "memory.limit_in_bytes"))
            limits = ([("memory.limit_in_bytes", limit_bytes), ("memory.memsw.limit_in_bytes", limit_bytes)] if v1
                      else [("memory.max", limit_bytes), ("memory.swap.max", 0)])
            for name, value in limits:
                if os.path.exists(os.path.join(self.path, name)):
                    with open(os.path.join(self.path, name), "w") as f:
                        f.write(str(value))
            self.procs = os.path.join(self.path, "cgroup.procs")
            if uid is not None:
                os.chown(self.procs, uid, -1)
        except OSError:
            self.remove()
            raise

    def pids(self) -> list[int]:
        try:
            with open(self.procs) as f:
                return [int(p) for p in f.read().split()]
        except OSError:
            return []

    def remove(self) -> None:
        """Kill what is left in it, then remove it (it must be empty first)."""
        for _ in range(100):
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)
        log.warning("CodeReward: memory cgroup %s could not be removed", self.path)


# --------------------------------------------------------------------------- sandboxes


def find_python(python: str) -> tuple[str, list[str]]:
    """(interpreter path, extra read-only folders it needs inside the sandbox).

    ``auto``: a system Python under ``/usr`` (visible anyway), else this interpreter's base
    installation (its prefix is bound read-only; never a virtual environment's site-packages).
    """
    if python != "auto":
        path = os.path.realpath(shutil.which(python) or python)
        if not os.path.isfile(path):
            raise SandboxUnavailable(f"CodeReward: python {python!r} not found")
        prefix = os.path.dirname(os.path.dirname(path))
        return path, ([] if path.startswith("/usr/") else [prefix])
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate, []
    base = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return base, ([] if base.startswith("/usr/") else [os.path.realpath(sys.base_prefix)])


@functools.lru_cache(maxsize=4)
def bwrap_features(bwrap: str) -> frozenset[str]:
    try:
        text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(re.findall(r"--[a-z][a-z0-9-]*", text))


@dataclass
class SandboxConfig:
    """How programs are isolated. Every field defaults to the strongest setting; the others
    exist so that tests can show each protection is needed (weaken one, see an attack succeed)."""

    kind: SandboxKind = "bwrap"
    bwrap: str = "bwrap"
    python: str = "auto"
    run_as_uid: int | None = 65534         # when the grader is root (None: stay root)
    # rlimit-only mode as root: one otherwise unused uid per concurrent sandbox (no passwd entry
    # needed), so that process counts and signals never cross sandboxes
    rlimit_uid_base: int = 1_800_000_000
    unshare_net: bool = True
    unshare_pid: bool = True
    clear_env: bool = True
    extra_binds: tuple[tuple[str, str], ...] = ()   # (host path, sandbox path), read-write
    tmpfs_bytes: int = 256 * 2**20
    protect_harness: bool = True            # harness not dumpable, and the pid namespace's init
    memory_cgroup: bool = True              # one memory cgroup per sandbox, where one is writable
    memory_bytes: int = 2560 * 2**20        # that cgroup's limit: every process, memfd and tmpfs page

    def __post_init__(self) -> None:
        check_choice("sandbox (SandboxConfig.kind)", self.kind, SandboxKind)


class Sandbox:
    """Builds the command that starts the harness, puts it in its memory cgroup, and ends it."""

    def __init__(self, config: SandboxConfig):
        self.config = config
        self.python, self.python_binds = find_python(config.python)
        self.uid = config.run_as_uid if os.geteuid() == 0 and config.run_as_uid is not None else None
        self.bwrap = None
        if config.kind == "bwrap":
            self.bwrap = shutil.which(config.bwrap) if not os.path.isabs(config.bwrap) else \
                (config.bwrap if os.access(config.bwrap, os.X_OK) else None)
            if self.bwrap is None:
                raise SandboxUnavailable(
                    f"CodeReward: bubblewrap ({config.bwrap}) is not installed, so generated code cannot be "
                    f"sandboxed; install it (apt-get install bubblewrap, or make setup) or {OPT_IN_HINT}")
        self._checked = False
        self.cgroup_parent: str | None = None
        self._check_lock = threading.Lock()
        self._uid_lock = threading.Lock()
        self._free_uids: list[int] = []
        self._next_uid = config.rlimit_uid_base

    def lease_uid(self) -> int | None:
        """The uid one run executes as: ``run_as_uid`` (bwrap, as root), a uid of its own
        (rlimit mode, as root), or None (not root: the grader's own)."""
        if self.uid is None or self.config.kind == "bwrap":
            return self.uid
        with self._uid_lock:
            if self._free_uids:
                return self._free_uids.pop()
            self._next_uid += 1
            return self._next_uid - 1

    def release_uid(self, uid: int | None) -> None:
        if uid is not None and self.config.kind == "rlimit" and self.uid is not None:
            with self._uid_lock:
                self._free_uids.append(uid)

    @property
    def mode(self) -> str:
        return "pidns" if self.config.kind == "bwrap" and self.config.unshare_pid else "pgrp"

    @property
    def workdir_inside(self) -> str | None:
        return "/tmp" if self.config.kind == "bwrap" else None

    def command(self, marker: str, host_workdir: str | None, info_fd: int | None = None,
                harness_fd: int | None = None, snippet: str | None = None) -> list[str]:
        """The command that runs the harness (or, for the start-up check, a ``snippet``). With
        bubblewrap the harness file is copied into the sandbox from ``harness_fd``
        (``--ro-bind-data``); without, it is copied into the private work folder."""
        cfg = self.config
        exposed = [] if cfg.protect_harness else ["--exposed"]
        if cfg.kind == "rlimit":
            if snippet is not None:
                return [self.python, "-I", "-S", "-c", snippet]
            script = os.path.join(host_workdir, "harness.py")
            shutil.copyfile(HARNESS, script)
            return [self.python, "-I", "-S", script, marker, *exposed]
        features = bwrap_features(self.bwrap)
        cmd = [self.bwrap] + (["--info-fd", str(info_fd)] if info_fd is not None else [])
        cmd += ["--unshare-user", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if cfg.unshare_pid:
            cmd.append("--unshare-pid")
            if cfg.protect_harness:   # the harness is init: no signal from inside reaches it
                cmd.append("--as-pid-1")
        if cfg.unshare_net:
            cmd.append("--unshare-net")
        if "--disable-userns" in features:
            cmd.append("--disable-userns")
        cmd += ["--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
        if cfg.clear_env:
            cmd += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8"]
        cmd += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                cmd += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                cmd += ["--ro-bind", top, top]
        for path in self.python_binds:
            cmd += ["--ro-bind", path, path]
        cmd += ["--proc", "/proc", "--dev", "/dev"]
        if "--size" in features:
            cmd += ["--size", str(cfg.tmpfs_bytes)]
        cmd += ["--tmpfs", "/tmp"]
        for host, inside in cfg.extra_binds:
            cmd += ["--bind", host, inside]
        if harness_fd is not None:
            cmd += ["--ro-bind-data", str(harness_fd), HARNESS_INSIDE]
        cmd += ["--chdir", "/tmp", "--remount-ro", "/dev", "--remount-ro", "/", "--"]
        if snippet is not None:
            return cmd + [self.python, "-I", "-S", "-c", snippet]
        return cmd + [self.python, "-I", "-S", HARNESS_INSIDE, marker, *exposed]

    def start(self, marker: str, host_workdir: str | None, uid: int | None, info_fd: int | None = None,
              snippet: str | None = None, **popen) -> tuple[subprocess.Popen, MemoryCgroup | None]:
        """Start the harness (or a ``snippet``) in its own memory cgroup when one can be made:
        a shell moves itself into the cgroup, then execs the sandbox, so every process the
        program ever starts is inside. Returns the process and the cgroup (None: per-process
        limits only)."""
        harness_r = None
        cgroup = self.new_cgroup(uid)
        try:
            if self.config.kind == "bwrap" and snippet is None:
                harness_r, harness_w = os.pipe()   # the harness file, copied in by bwrap
                with os.fdopen(harness_w, "wb") as f:
                    f.write(HARNESS_SOURCE)
            cmd = self.command(marker, host_workdir, info_fd, harness_r, snippet)
            if cgroup is not None:
                cmd = ["/bin/sh", "-c", 'echo $$ > "$0" || exit 97; exec "$@"', cgroup.procs, *cmd]
            fds = tuple(fd for fd in (info_fd, harness_r) if fd is not None)
            proc = subprocess.Popen(cmd, env=self.env(marker), cwd=host_workdir or "/", close_fds=True,
                                    pass_fds=fds, **self.popen_kwargs(uid), **popen)
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            raise
        finally:
            if harness_r is not None:
                os.close(harness_r)
        return proc, cgroup

    def new_cgroup(self, uid: int | None) -> MemoryCgroup | None:
        if not self.config.memory_cgroup or self.cgroup_parent is None:
            return None
        try:
            return MemoryCgroup(self.cgroup_parent, self.config.memory_bytes, uid)
        except OSError as err:
            log.warning("CodeReward: could not make a memory cgroup under %s (%s): %s", self.cgroup_parent, err,
                        FALLBACK_LIMITS)
            return None

    def env(self, marker: str) -> dict[str, str]:
        if not self.config.clear_env:
            return dict(os.environ, ASPO_SANDBOX_RUN=marker)
        return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "ASPO_SANDBOX_RUN": marker}

    def nproc_limit(self, max_processes: int, uid: int | None) -> int:
        """``RLIMIT_NPROC`` for the sandbox. With bwrap the count is the new user namespace's own
        (its init and the harness included); without, it is the whole uid's, so the tasks that
        uid already runs are added (none for a leased uid; the grader's own otherwise, shared
        with concurrent sandboxes: rlimit mode as non-root is the weakest setting)."""
        if self.config.kind == "bwrap":
            return max_processes + 2
        return max_processes + 1 + uid_task_count(uid if uid is not None else os.getuid())

    def popen_kwargs(self, uid: int | None) -> dict:
        kwargs: dict[str, Any] = {}
        if uid is not None:
            kwargs.update(user=uid, group=uid, extra_groups=[])
        return kwargs

    def check(self) -> None:
        """Run a trivial program once, in a memory cgroup when one can be made (else say, once,
        that memory is bounded per process only); a sandbox that cannot start raises
        ``SandboxUnavailable``."""
        with self._check_lock:
            if self._checked:
                return
            if self.config.memory_cgroup:
                self.cgroup_parent, why = find_cgroup_parent()
                if self.cgroup_parent is None:
                    log.warning("CodeReward: no writable memory cgroup (%s): %s", why, FALLBACK_LIMITS)
            proc = self._run_snippet()
            if proc.returncode == 97 and self.cgroup_parent is not None:
                log.warning("CodeReward: the sandbox cannot join a memory cgroup under %s: %s",
                            self.cgroup_parent, FALLBACK_LIMITS)
                self.cgroup_parent = None
                proc = self._run_snippet()
            if proc.returncode != 0 or proc.stdout != b"ok":
                why = (proc.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
                raise SandboxUnavailable(f"CodeReward: the {self.config.kind} sandbox does not start "
                                         f"here ({why[:200]}); {OPT_IN_HINT}")
            self._checked = True

    def _run_snippet(self) -> subprocess.CompletedProcess:
        marker = f"aspo-sandbox-check-{uuid.uuid4().hex}"
        uid = self.lease_uid()
        workdir = self.host_workdir(uid)
        cgroup = None
        try:
            proc, cgroup = self.start(marker, workdir, uid, snippet="import sys; sys.stdout.write('ok')",
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = proc.communicate(timeout=60)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        except (OSError, subprocess.SubprocessError) as err:
            raise SandboxUnavailable(f"CodeReward: the {self.config.kind} sandbox does not start "
                                     f"({err}); {OPT_IN_HINT}") from None
        finally:
            if cgroup is not None:
                cgroup.remove()
            self.cleanup_workdir(workdir)
            self.release_uid(uid)

    def host_workdir(self, uid: int | None) -> str | None:
        if self.config.kind == "bwrap":
            return None
        path = tempfile.mkdtemp(prefix="aspo-code-")
        if uid is not None:
            os.chown(path, uid, uid)
        return path

    def cleanup_workdir(self, path: str | None) -> None:
        if path:
            shutil.rmtree(path, ignore_errors=True)

    def stop(self, proc: subprocess.Popen, marker: str, info_fd: int | None = None, uid: int | None = None,
             cgroup: MemoryCgroup | None = None) -> None:
        """End the sandbox: EOF to the harness; SIGKILL to the pid namespace's init (the kernel
        then kills every process of the namespace, and bwrap exits only once they are gone), to
        bwrap's whole process group, and to whatever is left in its memory cgroup, which is then
        removed."""
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        init_pid = read_child_pid(info_fd) if info_fd is not None else None
        if init_pid is not None and proc.poll() is None:
            try:
                os.kill(init_pid, signal.SIGKILL)
                proc.wait(timeout=5)   # bwrap exits once its namespace is empty
            except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("sandbox %s did not exit after SIGKILL", proc.pid)
        if self.mode != "pidns":
            # without a pid namespace, processes that left the group are found by their marker,
            # and, when the run had a uid of its own, by that uid
            own_uid = uid if self.config.kind == "rlimit" and self.uid is not None else None
            give_up, delay = time.monotonic() + 5.0, 0.005
            while time.monotonic() < give_up:
                pids = marked_pids(marker, own_uid)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
        if cgroup is not None:
            cgroup.remove()


def read_child_pid(fd: int) -> int | None:
    """The host pid of the sandbox's pid-namespace init, from bwrap's ``--info-fd`` JSON."""
    data = b""
    os.set_blocking(fd, False)
    deadline = time.monotonic() + 1.0
    while b"}" not in data and time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            select.select([fd], [], [], 0.01) if fd < 1024 else time.sleep(0.01)
            continue
        if not chunk:
            break
        data += chunk
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def uid_task_count(uid: int) -> int:
    """Tasks (threads included) currently run by ``uid``: what ``RLIMIT_NPROC`` counts."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid == uid:
                count += len(os.listdir(f"/proc/{entry}/task"))
        except OSError:
            continue
    return count


def marked_pids(marker: str, uid: int | None = None) -> list[int]:
    """Processes whose command line or environment holds ``marker``, or that run as ``uid`` (a
    uid leased to one sandbox only): that sandbox's processes, nobody else's."""
    found, needle = [], marker.encode()
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        if uid is not None:
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        if f.read().rsplit(b")", 1)[1].split()[0] != b"Z":   # zombies are harmless
                            found.append(int(entry))
                    continue
            except (OSError, IndexError):
                continue
        for name in ("cmdline", "environ"):
            try:
                with open(f"/proc/{entry}/{name}", "rb") as f:
                    if needle in f.read():
                        found.append(int(entry))
                        break
            except OSError:
                continue
    return found
