"""Execution reward for code RL: run the response's program on the problem's tests, in a sandbox.

The outcome reward of the paper's code runs (§7, following DeepCoder): 1.0 when the last fenced
Python block of the response passes **every** test of the problem, else 0.0.

Test semantics are LiveCodeBench's (``lcb_runner/evaluation/testing_util.py``, Jain et al., 2025):

* ``stdin`` problems: the program reads the test input on stdin; its stdout and the expected
  output are each stripped as a whole, split on ``\\n`` and stripped line by line; the line counts
  must agree, and each line must be equal as a string or, failing that, as the list of its
  whitespace-separated tokens read as ``decimal.Decimal`` (no float tolerance).
* ``functional`` (LeetCode) problems: the test input is one JSON value per line, the positional
  arguments of ``Solution().<fn_name>(...)`` (or of a top-level ``<fn_name>`` when the program
  has no ``class Solution``); the result (a tuple turned into a list) must ``==`` the JSON-decoded
  expected output.
* The program runs after LiveCodeBench's import prelude (``from typing import *`` and friends,
  recursion limit 50,000). ``SystemExit`` in a stdin program ends it normally (its output so far
  is graded), as in LiveCodeBench; any other exception, a non-zero exit, a signal, a timeout or
  too much output fails the test. Tests run in order and grading stops at the first failure.

Differences from LiveCodeBench, all on the side of a real judge: the program runs as a real
process with real stdin/stdout (``sys.stdin.buffer`` works), the module is executed afresh for
every test, and the comparison happens *outside* the sandbox on plain decoded values (a returned
object whose ``__eq__`` always says True cannot pass).

Isolation (generated code is untrusted):

* ``sandbox="bwrap"`` (default): every program runs in a bubblewrap sandbox — new user, pid,
  network, IPC, UTS and cgroup namespaces (no network at all), all capabilities dropped, no
  further user namespaces, a fresh session, killed if the grader dies; the root file system holds
  only read-only ``/usr`` (+ ``/lib*``, ``/bin`` links) and the interpreter, a fresh ``/proc`` and
  minimal ``/dev``, and a private size-limited tmpfs ``/tmp`` as working directory: nothing of the
  repository, the home folder or checkpoints is visible; the environment is empty. When the
  grader runs as root, bubblewrap itself runs as ``nobody`` (``SandboxConfig.run_as_uid``) so that the
  process-count limit applies (Linux does not enforce ``RLIMIT_NPROC`` for uid 0), and counts per
  sandbox (the new user namespace's own count).
* rlimits on every test process: CPU seconds, address space, process count, file size (caps the
  output), no core files; a wall-clock limit per test (the in-sandbox harness kills every other
  process of the sandbox after each test) and per program (the grader kills the sandbox's whole
  process group; the pid namespace takes every remaining process with it).
* The test harness (feeding stdin, calling ``Solution().fn``) runs inside the sandbox and only
  ever receives test *inputs*; expected outputs stay in the grader process, which compares.
* ``sandbox="rlimit"`` opts into rlimit-only isolation (same limits and harness, a host temporary
  folder as working directory, as root an otherwise unused uid per concurrent sandbox, but no
  namespaces: the program can see the file system and the network). It is never chosen
  automatically: without ``bwrap`` grading stops with one line naming this setting.

Grading is parallel: ``CodeReward.batch`` runs up to ``num_workers`` sandboxes at once (threads
waiting on subprocesses); every program is bounded by its total timeout, and identical programs
for the same problem (common within a group) are run once.
"""

from __future__ import annotations

import functools
import json
import logging
import math
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Mapping, Sequence

log = logging.getLogger(__name__)

__all__ = [
    "CodeReward",
    "CodeSpec",
    "ProgramResult",
    "SandboxUnavailable",
    "code_gold",
    "extract_code",
    "functional_match",
    "parse_gold",
    "stdout_match",
]

SANDBOXES = ("bwrap", "rlimit")
HARNESS_SLACK = (1.0, 0.5)   # the harness answers within per-test limit * (1 + 0.5) + 1 s
OPT_IN_HINT = ("set sandbox='rlimit' to opt into rlimit-only isolation (no file-system or network "
               "isolation): CodeReward(sandbox='rlimit'), YAML data.init_args.sandbox: rlimit, "
               "or evaluate --sandbox rlimit")

# LiveCodeBench's prelude (lcb_runner/evaluation/testing_util.py ``import_string``).
LCB_PRELUDE = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
    "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\n"
    "from random import *\nfrom statistics import *\nfrom itertools import *\nfrom functools import *\n"
    "from operator import *\nfrom io import *\nfrom sys import *\nfrom json import *\n"
    "from builtins import *\nfrom typing import *\nimport string\nimport re\nimport datetime\n"
    "import collections\nimport heapq\nimport bisect\nimport copy\nimport math\nimport random\n"
    "import statistics\nimport itertools\nimport functools\nimport operator\nimport io\nimport sys\n"
    "import json\nsys.setrecursionlimit(50000)\n"
)


class SandboxUnavailable(RuntimeError):
    """The requested sandbox cannot run here; the message is one line and names the opt-in."""


# --------------------------------------------------------------------------- extraction

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3", "py3"}


def extract_code(text: str, think_end_token: str | None = "</think>") -> str | None:
    """The last closed fenced Python block of ``text`` (after the last ``think_end_token``).

    A block tagged ``python``/``py``/``python3`` or untagged counts (DeepCoder takes the last
    block, Archer the last ``python`` one); an unclosed final fence (a truncated response) does
    not. None when there is no such block.
    """
    if think_end_token and think_end_token in text:
        text = text.rsplit(think_end_token, 1)[1]
    blocks = [m.group(2) for m in _FENCE.finditer(text) if m.group(1).lower() in _PYTHON_TAGS]
    if not blocks:
        return None
    code = blocks[-1]
    return code if code.strip() else None


# --------------------------------------------------------------------------- gold (test spec)


@dataclass(frozen=True)
class CodeSpec:
    """A problem's tests: ``tests`` are ``(input, output)`` pairs; ``fn_name`` set = functional."""

    tests: tuple[tuple[str, str], ...]
    fn_name: str | None = None
    time_limit_s: float | None = None
    memory_limit_bytes: int | None = None

    @property
    def kind(self) -> str:
        return "functional" if self.fn_name else "stdin"


def code_gold(row: Mapping[str, Any]) -> str:
    """The gold string of a normalized code row (what ``CodeReward`` grades against): JSON of
    its tests, ``fn_name`` and, when present, the row's own time and memory limits."""
    spec = {"fn_name": row.get("fn_name") or None,
            "tests": [{"input": t["input"], "output": t["output"]} for t in row["tests"]]}
    for key in ("time_limit_s", "memory_limit_bytes"):
        if row.get(key):
            spec[key] = row[key]
    return json.dumps(spec, ensure_ascii=False, separators=(",", ":"))


@functools.lru_cache(maxsize=4096)
def _parse_gold_str(gold: str) -> CodeSpec:
    return _spec_from_mapping(json.loads(gold))


def _spec_from_mapping(obj: Mapping[str, Any]) -> CodeSpec:
    tests = obj.get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError("a code gold needs a non-empty 'tests' list")
    pairs = []
    for t in tests:
        if not isinstance(t, Mapping) or not isinstance(t.get("input"), str) \
                or not isinstance(t.get("output"), str):
            raise ValueError("every test needs string 'input' and 'output'")
        pairs.append((t["input"], t["output"]))
    fn_name = obj.get("fn_name") or None
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise ValueError(f"fn_name {fn_name!r} is not an identifier")
    time_limit = obj.get("time_limit_s")
    memory = obj.get("memory_limit_bytes")
    return CodeSpec(tuple(pairs), fn_name, float(time_limit) if time_limit else None,
                    int(memory) if memory else None)


def parse_gold(gold: str | Mapping[str, Any] | CodeSpec) -> CodeSpec:
    """A ``CodeSpec`` from the gold string of ``code_gold``, an equivalent dict, or a spec."""
    if isinstance(gold, CodeSpec):
        return gold
    if isinstance(gold, str):
        return _parse_gold_str(gold)
    return _spec_from_mapping(gold)


# --------------------------------------------------------------------------- comparison


def _stripped_lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(token) for token in line.split()]
    except (InvalidOperation, ValueError):
        return None


def stdout_match(prediction: str, expected: str) -> bool:
    """LiveCodeBench's stdin-problem check: line-wise after stripping, each line equal as a
    string or as a list of ``Decimal`` tokens."""
    got, want = _stripped_lines(prediction), _stripped_lines(expected)
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if a == b:
            continue
        da, db = _decimals(a), _decimals(b)
        if da is None or db is None:
            return False
        try:
            if da != db:
                return False
        except InvalidOperation:   # signalling NaN
            return False
    return True


class _Opaque:
    """A value the harness could not encode (a set, a custom object): equal to nothing."""

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __eq__(self, other):
        return False

    __hash__ = None

    def __repr__(self):
        return f"<unencodable {self.type_name}>"


def _decode_value(obj):
    """Inverse of the harness's tagged encoding (tuples and non-string-keyed dicts kept)."""
    if isinstance(obj, list):
        return [_decode_value(v) for v in obj]
    if isinstance(obj, dict):
        if "t" in obj and len(obj) == 1:
            return tuple(_decode_value(v) for v in obj["t"])
        if "d" in obj and len(obj) == 1:
            return {_hashable(_decode_value(k)): _decode_value(v) for k, v in obj["d"]}
        if "o" in obj and len(obj) == 1:
            return _Opaque(str(obj["o"]))
        raise ValueError("bad encoded value")
    return obj


def _hashable(key):
    return _Opaque("unhashable key") if isinstance(key, (list, dict)) else key


def functional_match(prediction: Any, expected_json: str) -> bool:
    """LiveCodeBench's functional check: ``prediction == json.loads(expected)``, a returned tuple
    compared as a list."""
    if isinstance(prediction, tuple):
        prediction = list(prediction)
    try:
        expected = json.loads(expected_json)
    except (json.JSONDecodeError, ValueError):
        return False
    try:
        return bool(prediction == expected)
    except Exception:  # noqa: BLE001 - comparing exotic values must not crash grading
        return False


# --------------------------------------------------------------------------- the harness
#
# Runs inside the sandbox as `python -I -S -c HARNESS <marker>`. Protocol on its stdin/stdout:
#   grader -> harness: one JSON line {code, fn_name, limits...}; then one JSON line per test
#                      {"input": ...}; EOF ends the run.
#   harness -> grader: per message one JSON line {"status", "n", ...} followed by n raw bytes
#                      (the test's stdout, or the encoded return value of a functional test).
# The harness never receives an expected output. Each test runs in a forked child that redirects
# fds 0/1/2 to files in the working directory, closes every other fd, lowers its rlimits, then
# executes the program; after each test every other process of the sandbox is killed.

_HARNESS = r'''
import os, sys, json, time, signal, resource, builtins, io

PROTO_IN = os.fdopen(0, "rb", buffering=0)
PROTO_OUT = os.fdopen(1, "wb", buffering=0)

def send(status, payload=b"", **extra):
    extra["status"] = status
    extra["n"] = len(payload)
    PROTO_OUT.write(json.dumps(extra).encode() + b"\n" + payload)

def readline():
    chunks = []
    while True:
        b = PROTO_IN.readline()
        if not b:
            return None
        chunks.append(b)
        if b.endswith(b"\n"):
            return b"".join(chunks)

def set_limit(name, value):
    res = getattr(resource, name, None)
    if res is None or value is None:
        return
    hard = resource.getrlimit(res)[1]
    if hard != resource.RLIM_INFINITY and value > hard:
        value = hard   # limits only ever go down
    resource.setrlimit(res, (value, value))

def encode(v, depth=0):
    if depth > 200:
        raise ValueError("value nested too deeply")
    t = type(v)
    if v is None or t is bool or t is int or t is float or t is str:
        return v
    if t is list:
        return [encode(x, depth + 1) for x in v]
    if t is tuple:
        return {"t": [encode(x, depth + 1) for x in v]}
    if t is dict:
        return {"d": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]}
    return {"o": t.__name__}

def kill_others(child, mode):
    if mode == "pidns":
        # every other process of this pid namespace (never pid 1, never ourselves)
        for _ in range(50):
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid())]
            reap()
            if not others:
                break
            time.sleep(0.002)
    else:
        try:
            os.killpg(child, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        reap()

def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return

def wait_child(pid, timeout):
    """(wait status or None on timeout, seconds)."""
    start = time.monotonic()
    deadline = start + timeout
    pidfd = None
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pass
    try:
        if pidfd is not None:
            import select
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or poller.poll(max(1, int(left * 1000))):
                    break
        delay = 0.0005
        while True:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got == pid:
                return status, time.monotonic() - start
            if time.monotonic() >= deadline:
                return None, time.monotonic() - start
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
    finally:
        if pidfd is not None:
            os.close(pidfd)

def run_child(cfg, compiled, base, args, paths):
    in_path, out_path, err_path, res_path = paths
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    cpu = int(cfg["timeout"]) + 1
    set_limit("RLIMIT_CPU", cpu)
    set_limit("RLIMIT_FSIZE", cfg["max_output_bytes"])
    set_limit("RLIMIT_CORE", 0)
    set_limit("RLIMIT_NPROC", cfg["nproc"])
    set_limit("RLIMIT_NOFILE", 256)
    set_limit("RLIMIT_AS", cfg["memory_bytes"])
    fd = os.open(in_path, os.O_RDONLY)
    os.dup2(fd, 0)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    os.dup2(os.open(out_path, flags, 0o600), 1)
    os.dup2(os.open(err_path, flags, 0o600), 2)
    os.closerange(3, 1 << 16)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding="utf-8", errors="surrogateescape")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False), 1 << 16),
                                                   encoding="utf-8", errors="strict")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                                   errors="backslashreplace", write_through=True)
    g = dict(base)
    g["__name__"] = "__main__"
    g["__builtins__"] = builtins
    for name in ("stdin", "stdout", "stderr"):   # bound by the prelude's `from sys import *`
        if name in g:
            g[name] = getattr(sys, name)
    ok = True
    payload = None
    fn = cfg["fn_name"]
    try:
        exec(compiled, g)
        if fn:
            if "class Solution" in cfg["code"]:
                method = getattr(g["Solution"](), fn)
            else:
                method = g[fn]
            result = method(*args)
            if type(result) is tuple:
                result = list(result)
            payload = json.dumps(encode(result)).encode()
    except SystemExit:
        ok = not fn
    except BaseException:
        ok = False
        try:
            import traceback
            traceback.print_exc()
        except BaseException:
            pass
    try:
        sys.stdout.flush()
    except BaseException:
        ok = False
    if ok and payload is not None:
        try:
            rfd = os.open(res_path, flags, 0o600)
            view = memoryview(payload)
            while view:
                view = view[os.write(rfd, view):]
            os.close(rfd)
        except BaseException:
            ok = False
    os._exit(0 if ok else 1)

def read_file(path, limit):
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return b""

def main():
    try:
        sys.set_int_max_str_digits(0)
    except AttributeError:
        pass
    line = readline()
    if not line:
        return
    cfg = json.loads(line)
    set_limit("RLIMIT_CORE", 0)
    set_limit("RLIMIT_NPROC", cfg["nproc"])
    work = cfg["workdir"]
    os.chdir(work)
    try:
        compiled = compile(cfg["code"], "<solution>", "exec")
    except BaseException as err:
        send("compile_error", detail=repr(err)[:500])
        return
    base = {}
    exec(cfg["prelude"], base)
    send("ready")
    index = 0
    while True:
        line = readline()
        if not line:
            return
        test = json.loads(line)
        args = None
        if cfg["fn_name"]:
            try:
                args = [json.loads(a) for a in test["input"].split("\n")]
            except ValueError:
                send("bad_input")
                continue
        stem = os.path.join(work, "t%d" % index)
        paths = (stem + ".in", stem + ".out", stem + ".err", stem + ".res")
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
            except OSError:
                pass
        fd = os.open(paths[0], os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        data = b"" if cfg["fn_name"] else test["input"].encode("utf-8", "surrogateescape")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.close(fd)
        index += 1
        pid = os.fork()
        if pid == 0:
            try:
                run_child(cfg, compiled, base, args, paths)
            finally:
                os._exit(1)
        status, elapsed = wait_child(pid, cfg["timeout"])
        kill_others(pid, cfg["mode"])
        err = read_file(paths[2], 2000)
        extra = {"time": round(elapsed, 4), "stderr": err.decode("utf-8", "replace")[-1000:]}
        out_size = os.path.getsize(paths[1]) if os.path.exists(paths[1]) else 0
        if status is None:
            send("timeout", **extra)
            continue
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig in (signal.SIGXCPU, signal.SIGKILL):
                send("timeout", signal=sig, **extra)
            elif sig == signal.SIGXFSZ:
                send("output_limit", signal=sig, **extra)
            else:
                send("crashed", signal=sig, **extra)
            continue
        if out_size >= cfg["max_output_bytes"]:
            send("output_limit", **extra)
            continue
        code = os.WEXITSTATUS(status)
        if code != 0:
            send("runtime_error", exit_code=code, **extra)
            continue
        if cfg["fn_name"]:
            payload = read_file(paths[3], cfg["max_output_bytes"])
            if not payload:
                send("runtime_error", detail="no return value", **extra)
                continue
        else:
            payload = read_file(paths[1], cfg["max_output_bytes"])
        for p in paths:
            try:
                os.unlink(p)
            except OSError:
                pass
        send("ok", payload, **extra)

try:
    main()
except BrokenPipeError:
    pass
'''


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
def _bwrap_features(bwrap: str) -> frozenset[str]:
    try:
        text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(re.findall(r"--[a-z][a-z0-9-]*", text))


@dataclass
class SandboxConfig:
    """How programs are isolated. Every field defaults to the strongest setting; the others
    exist so that tests can show each protection is needed (weaken one, see an attack succeed)."""

    kind: str = "bwrap"
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


class _Sandbox:
    """Builds the command that starts the harness, and cleans up after it."""

    def __init__(self, config: SandboxConfig):
        if config.kind not in SANDBOXES:
            raise ValueError(f"sandbox must be one of {SANDBOXES}, got {config.kind!r}")
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

    def command(self, marker: str, host_workdir: str | None, info_fd: int | None = None) -> list[str]:
        harness = [self.python, "-I", "-S", "-c", _HARNESS, marker]
        if self.config.kind == "rlimit":
            return harness
        cfg, features = self.config, _bwrap_features(self.bwrap)
        cmd = [self.bwrap] + (["--info-fd", str(info_fd)] if info_fd is not None else [])
        cmd += ["--unshare-user", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if cfg.unshare_pid:
            cmd.append("--unshare-pid")
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
        cmd += ["--chdir", "/tmp", "--remount-ro", "/dev", "--remount-ro", "/", "--"]
        return cmd + harness

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
        return max_processes + 1 + _uid_task_count(uid if uid is not None else os.getuid())

    def popen_kwargs(self, uid: int | None) -> dict:
        kwargs: dict[str, Any] = {}
        if uid is not None:
            kwargs.update(user=uid, group=uid, extra_groups=[])
        return kwargs

    def check(self) -> None:
        """Run a trivial program once; a sandbox that cannot start raises ``SandboxUnavailable``."""
        with self._check_lock:
            if self._checked:
                return
            marker = f"aspo-sandbox-check-{uuid.uuid4().hex}"
            uid = self.lease_uid()
            workdir = self._host_workdir(uid)
            try:
                cmd = self.command(marker, workdir)
                cmd[cmd.index(_HARNESS)] = "import sys; sys.stdout.write('ok')"
                proc = subprocess.run(cmd, capture_output=True, timeout=60, env=self.env(marker),
                                      cwd=workdir or "/", stdin=subprocess.DEVNULL, **self.popen_kwargs(uid))
            except (OSError, subprocess.SubprocessError) as err:
                raise SandboxUnavailable(f"CodeReward: the {self.config.kind} sandbox does not start "
                                         f"({err}); {OPT_IN_HINT}") from None
            finally:
                self.cleanup_workdir(workdir)
                self.release_uid(uid)
            if proc.returncode != 0 or proc.stdout != b"ok":
                why = (proc.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
                raise SandboxUnavailable(f"CodeReward: the {self.config.kind} sandbox does not start "
                                         f"here ({why[:200]}); {OPT_IN_HINT}")
            self._checked = True

    def _host_workdir(self, uid: int | None) -> str | None:
        if self.config.kind == "bwrap":
            return None
        path = tempfile.mkdtemp(prefix="aspo-code-")
        if uid is not None:
            os.chown(path, uid, uid)
        return path

    def cleanup_workdir(self, path: str | None) -> None:
        if path:
            shutil.rmtree(path, ignore_errors=True)


def _read_child_pid(fd: int) -> int | None:
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


def _uid_task_count(uid: int) -> int:
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


def _marked_pids(marker: str, uid: int | None = None) -> list[int]:
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


# --------------------------------------------------------------------------- running one program


@dataclass
class ProgramResult:
    """The outcome of one program on one problem."""

    passed: bool
    status: str                 # passed | no_code | bad_gold | compile_error | wrong_answer |
                                # runtime_error | timeout | output_limit | crashed | sandbox_error |
                                # batch_timeout | bad_input
    tests_run: int = 0
    num_tests: int = 0
    failed_test: int | None = None
    elapsed_s: float = 0.0
    detail: str = ""
    output: str = ""            # the last test's output (stdout or encoded value), truncated

    @property
    def score(self) -> float:
        return 1.0 if self.passed else 0.0


class _Timeout(Exception):
    pass


class _Channel:
    """Non-blocking, deadline-bounded framing over the harness's stdin/stdout pipes."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.wfd, self.rfd = proc.stdin.fileno(), proc.stdout.fileno()
        os.set_blocking(self.wfd, False)
        os.set_blocking(self.rfd, False)
        self.buf = bytearray()

    def _poll(self, fd: int, events: int, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Timeout()
        poller = select.poll()
        poller.register(fd, events)
        if not poller.poll(max(1, int(math.ceil(left * 1000)))):
            raise _Timeout()

    def send(self, obj: dict, deadline: float) -> None:
        view = memoryview(json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
        while view:
            self._poll(self.wfd, select.POLLOUT, deadline)
            try:
                view = view[os.write(self.wfd, view):]
            except BlockingIOError:
                continue

    def _fill(self, deadline: float) -> None:
        self._poll(self.rfd, select.POLLIN, deadline)
        try:
            chunk = os.read(self.rfd, 1 << 20)
        except BlockingIOError:
            return
        if not chunk:
            raise EOFError()
        self.buf += chunk

    def recv(self, deadline: float, max_payload: int) -> tuple[dict, bytes]:
        while b"\n" not in self.buf:
            if len(self.buf) > 1 << 16:
                raise ValueError("oversized header")
            self._fill(deadline)
        cut = self.buf.index(b"\n")
        head = json.loads(bytes(self.buf[:cut]))
        del self.buf[:cut + 1]
        n = int(head.get("n", 0))
        if n > max_payload:
            raise ValueError("oversized payload")
        while len(self.buf) < n:
            self._fill(deadline)
        payload = bytes(self.buf[:n])
        del self.buf[:n]
        return head, payload


@dataclass
class _Limits:
    per_test_s: float
    total_s: float
    memory_bytes: int
    max_output_bytes: int
    nproc: int


# --------------------------------------------------------------------------- the reward


class CodeReward:
    """Binary execution reward for code RL: 1.0 iff the response's program passes every test.

    Args:
        sandbox: ``bwrap`` (bubblewrap namespaces + rlimits; the default and the only safe choice
            for untrusted code) or ``rlimit`` (rlimits only; explicit opt-in).
        timeout_s: wall-clock limit per test (LiveCodeBench and DeepCoder: 6 s). A row's own
            ``time_limit_s`` (CodeContests) replaces it, times ``time_limit_factor``.
        total_timeout_s: wall-clock limit per program over all its tests; default
            ``(per-test + 1) * n_tests + 5`` (DeepCoder's bound), capped at ``max_total_timeout_s``.
        memory_limit_mb: address-space limit per test process; a row's ``memory_limit_bytes``
            replaces it (never below ``min_memory_mb``, which the interpreter itself needs).
        max_output_mb: stdout (and return value) size limit per test; more fails the test.
        max_processes: process/thread limit inside one sandbox (``RLIMIT_NPROC``).
        max_tests: run only the ``max_tests`` tests with the longest inputs (DeepCoder's choice for
            large CodeContests sets); None runs all.
        num_workers: programs graded at once (default: CPU count).
        batch_timeout_s: optional bound on one ``batch`` call; programs not finished by then score 0.
        think_end_token: code is extracted after its last occurrence.
        python: interpreter inside the sandbox (``auto``: a system Python under /usr, else this
            interpreter's base installation).
        use_row_limits: honour a row's own time/memory limits.
        time_limit_factor: multiplies a row's own ``time_limit_s``.
        bwrap: the bubblewrap executable.

    ``sandbox_config`` (a ``SandboxConfig``, set before the first grading) exposes every
    isolation switch; the defaults are the strongest, the others exist for tests.
    """

    def __init__(
        self,
        sandbox: str = "bwrap",
        timeout_s: float = 6.0,
        total_timeout_s: float | None = None,
        max_total_timeout_s: float = 120.0,
        memory_limit_mb: int = 2048,
        min_memory_mb: int = 256,
        max_output_mb: float = 16.0,
        max_processes: int = 32,
        max_tests: int | None = None,
        num_workers: int | None = None,
        batch_timeout_s: float | None = None,
        think_end_token: str | None = "</think>",
        python: str = "auto",
        use_row_limits: bool = True,
        time_limit_factor: float = 1.0,
        bwrap: str = "bwrap",
    ) -> None:
        if sandbox not in SANDBOXES:
            raise ValueError(f"sandbox must be one of {SANDBOXES}, got {sandbox!r}")
        if timeout_s <= 0 or memory_limit_mb <= 0 or max_output_mb <= 0 or max_processes < 1:
            raise ValueError("timeout_s, memory_limit_mb, max_output_mb and max_processes must be positive")
        self.sandbox = sandbox
        self.timeout_s = float(timeout_s)
        self.total_timeout_s = total_timeout_s
        self.max_total_timeout_s = float(max_total_timeout_s)
        self.memory_limit_mb = int(memory_limit_mb)
        self.min_memory_mb = int(min_memory_mb)
        self.max_output_mb = float(max_output_mb)
        self.max_processes = int(max_processes)
        self.max_tests = max_tests
        self.num_workers = int(num_workers or os.cpu_count() or 1)
        self.batch_timeout_s = batch_timeout_s
        self.think_end_token = think_end_token
        self.python = python
        self.use_row_limits = use_row_limits
        self.time_limit_factor = float(time_limit_factor)
        self.sandbox_config = SandboxConfig(kind=sandbox, python=python, bwrap=bwrap)
        self._sandbox: _Sandbox | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- lifecycle
    def __getstate__(self):
        state = self.__dict__.copy()
        state.update(_sandbox=None, _pool=None, _lock=None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __del__(self):
        try:
            self.close(wait=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def close(self, wait: bool = True) -> None:
        """Stop the grading threads (a later call starts them again)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)

    def __repr__(self) -> str:
        return (f"CodeReward(sandbox={self.sandbox!r}, timeout_s={self.timeout_s}, "
                f"memory_limit_mb={self.memory_limit_mb}, num_workers={self.num_workers})")

    def sandbox_ready(self) -> _Sandbox:
        """The sandbox, checked once (raises ``SandboxUnavailable`` with the opt-in hint)."""
        with self._lock:
            if self._sandbox is None:
                self._sandbox = _Sandbox(self.sandbox_config)
        self._sandbox.check()
        return self._sandbox

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix="code-reward")
            return self._pool

    # -- scoring
    def __call__(self, response_text: str, gold) -> float:
        return self.batch([response_text], [gold])[0]

    def batch(self, texts: Sequence[str], golds: Sequence) -> list[float]:
        """Score ``texts[i]`` against ``golds[i]`` (the test spec) for all i, in parallel."""
        return [r.score for r in self.run_batch(texts, golds)]

    def run(self, text: str, gold, extract: bool = True) -> ProgramResult:
        """Grade one response (or, with ``extract=False``, one program) with full details."""
        return self.run_batch([text], [gold], extract=extract)[0]

    def run_batch(self, texts: Sequence[str], golds: Sequence, extract: bool = True) -> list[ProgramResult]:
        if len(texts) != len(golds):
            raise ValueError(f"{len(texts)} texts but {len(golds)} golds")
        results: list[ProgramResult | None] = [None] * len(texts)
        jobs: dict[tuple[str, str], list[int]] = {}
        specs: dict[str, CodeSpec] = {}
        for i, (text, gold) in enumerate(zip(texts, golds)):
            code = extract_code(text, self.think_end_token) if extract else text
            if code is None:
                results[i] = ProgramResult(False, "no_code")
                continue
            key_gold = gold if isinstance(gold, str) else json.dumps(gold, sort_keys=True, default=str)
            try:
                specs.setdefault(key_gold, parse_gold(gold))
            except (ValueError, TypeError, json.JSONDecodeError) as err:
                results[i] = ProgramResult(False, "bad_gold", detail=str(err)[:200])
                continue
            jobs.setdefault((code, key_gold), []).append(i)
        if jobs:
            sandbox = self.sandbox_ready()
            deadline = time.monotonic() + self.batch_timeout_s if self.batch_timeout_s else None
            if len(jobs) == 1:
                (code, key), = jobs
                outcomes = {(code, key): self._run_program(sandbox, code, specs[key], deadline)}
            else:
                pool = self._executor()
                futures = {job: pool.submit(self._run_program, sandbox, job[0], specs[job[1]], deadline)
                           for job in jobs}
                outcomes = {job: future.result() for job, future in futures.items()}
            for job, indices in jobs.items():
                for i in indices:
                    results[i] = outcomes[job]
        return results  # type: ignore[return-value]

    # -- one program
    def limits_for(self, spec: CodeSpec, n_tests: int) -> _Limits:
        per_test = self.timeout_s
        memory = self.memory_limit_mb * 2**20
        if self.use_row_limits and spec.time_limit_s:
            per_test = spec.time_limit_s * self.time_limit_factor
        if self.use_row_limits and spec.memory_limit_bytes:
            memory = max(spec.memory_limit_bytes, self.min_memory_mb * 2**20)
        total = self.total_timeout_s or min((per_test + 1) * n_tests + 5, self.max_total_timeout_s)
        return _Limits(per_test, float(total), int(memory), int(self.max_output_mb * 2**20),
                       self.max_processes)

    def _select_tests(self, spec: CodeSpec) -> list[tuple[str, str]]:
        tests = list(spec.tests)
        if self.max_tests and len(tests) > self.max_tests:
            longest = sorted(range(len(tests)), key=lambda i: -len(tests[i][0]))[: self.max_tests]
            tests = [tests[i] for i in sorted(longest)]
        return tests

    def _run_program(self, sandbox: _Sandbox, code: str, spec: CodeSpec,
                     batch_deadline: float | None) -> ProgramResult:
        tests = self._select_tests(spec)
        limits = self.limits_for(spec, len(tests))
        start = time.monotonic()
        deadline = start + limits.total_s
        if batch_deadline is not None:
            if start >= batch_deadline:
                return ProgramResult(False, "batch_timeout", num_tests=len(tests))
            deadline = min(deadline, batch_deadline)
        marker = f"aspo-sandbox-{uuid.uuid4().hex}"
        uid = sandbox.lease_uid()
        workdir = sandbox._host_workdir(uid)
        proc = None
        info_r = info_w = None
        result = ProgramResult(False, "sandbox_error", num_tests=len(tests))
        try:
            if sandbox.mode == "pidns":
                info_r, info_w = os.pipe()
            proc = subprocess.Popen(
                sandbox.command(marker, workdir, info_w), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, env=sandbox.env(marker), cwd=workdir or "/",
                start_new_session=True, close_fds=True, pass_fds=(info_w,) if info_w is not None else (),
                **sandbox.popen_kwargs(uid))
            if info_w is not None:
                os.close(info_w)
                info_w = None
            result = self._talk(_Channel(proc), sandbox, code, spec, tests, limits, deadline, workdir, uid)
        except OSError as err:
            result = ProgramResult(False, "sandbox_error", num_tests=len(tests), detail=str(err)[:200])
        finally:
            for fd in (info_w,):
                if fd is not None:
                    os.close(fd)
            if proc is not None:
                self._stop(proc, marker, sandbox, info_r, uid)
            if info_r is not None:
                os.close(info_r)
            sandbox.cleanup_workdir(workdir)
            sandbox.release_uid(uid)
        result.elapsed_s = time.monotonic() - start
        return result

    def _talk(self, chan: _Channel, sandbox: _Sandbox, code: str, spec: CodeSpec, tests, limits: _Limits,
              deadline: float, workdir: str | None, uid: int | None = None) -> ProgramResult:
        n = len(tests)
        max_payload = limits.max_output_bytes
        header = {"code": code, "fn_name": spec.fn_name, "prelude": LCB_PRELUDE,
                  "timeout": limits.per_test_s, "memory_bytes": limits.memory_bytes,
                  "max_output_bytes": limits.max_output_bytes, "nproc": sandbox.nproc_limit(limits.nproc, uid),
                  "mode": sandbox.mode, "workdir": sandbox.workdir_inside or workdir}
        index = -1
        try:
            chan.send(header, deadline)
            head, _ = chan.recv(deadline, max_payload)
            if head.get("status") != "ready":
                return ProgramResult(False, str(head.get("status", "sandbox_error")), 0, n,
                                     detail=str(head.get("detail", ""))[:500])
            for index, (test_in, test_out) in enumerate(tests):
                chan.send({"input": test_in}, deadline)
                # the harness answers within the per-test limit; a little slack for its own work
                # (a harness starved of CPU, e.g. by a fork bomb, is not waited for)
                slack = HARNESS_SLACK[0] + HARNESS_SLACK[1] * limits.per_test_s
                head, payload = chan.recv(min(deadline, time.monotonic() + limits.per_test_s + slack),
                                          max_payload)
                status = str(head.get("status"))
                output = payload[:1000].decode("utf-8", "replace")
                if status != "ok":
                    return ProgramResult(False, status, index + 1, n, index,
                                         detail=str(head.get("stderr") or head.get("detail") or "")[-500:],
                                         output=output)
                if not self._matches(spec, payload, test_out):
                    return ProgramResult(False, "wrong_answer", index + 1, n, index, output=output)
            return ProgramResult(True, "passed", n, n, output=output if n else "")
        except _Timeout:
            return ProgramResult(False, "timeout", max(index, 0), n, max(index, 0), detail="wall clock")
        except (EOFError, BrokenPipeError, ConnectionError):
            return ProgramResult(False, "sandbox_error", max(index, 0), n, max(index, 0),
                                 detail="the sandbox ended early (killed?)")
        except (ValueError, json.JSONDecodeError) as err:
            return ProgramResult(False, "output_limit" if "oversized" in str(err) else "sandbox_error",
                                 max(index, 0), n, max(index, 0), detail=str(err)[:200])

    @staticmethod
    def _matches(spec: CodeSpec, payload: bytes, expected: str) -> bool:
        if spec.fn_name:
            try:
                value = _decode_value(json.loads(payload))
            except (ValueError, RecursionError):
                return False
            return functional_match(value, expected)
        return stdout_match(payload.decode("utf-8", "replace"), expected)

    @staticmethod
    def _stop(proc: subprocess.Popen, marker: str, sandbox: _Sandbox, info_fd: int | None = None,
              uid: int | None = None) -> None:
        """End the sandbox: EOF to the harness; SIGKILL to the pid namespace's init (the kernel
        then kills every process of the namespace, and bwrap exits only once they are gone) and to
        bwrap's whole process group."""
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        init_pid = _read_child_pid(info_fd) if info_fd is not None else None
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
        if sandbox.mode != "pidns":
            # without a pid namespace, processes that left the group are found by their marker,
            # and, when the run had a uid of its own, by that uid
            own_uid = uid if sandbox.config.kind == "rlimit" and sandbox.uid is not None else None
            give_up, delay = time.monotonic() + 5.0, 0.005
            while time.monotonic() < give_up:
                pids = _marked_pids(marker, own_uid)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
