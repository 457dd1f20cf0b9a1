"""The in-sandbox test harness of ``CodeReward`` (a standalone program: stdlib only).

Copied into every sandbox (bubblewrap ``--ro-bind-data``, or the private work folder without
bubblewrap) and run as ``python -I -S harness.py <marker>``. Protocol on its stdin/stdout:

* grader -> harness: one JSON line ``{code, fn_name, prelude, limits...}``; then one JSON line per
  test ``{"input": ...}``; EOF ends the run.
* harness -> grader: per message one JSON line ``{"status", "n", ...}`` followed by ``n`` raw bytes
  (the test's stdout, or the encoded return value of a functional test).

The harness never receives an expected output, and nothing it reports is trusted for grading
beyond the bytes to compare: the grader keeps its own clock for every limit and compares outside.
Each test runs in a forked child that redirects fds 0/1/2 to files in the working directory,
closes every other fd, lowers its rlimits, then executes the program; after each test every other
process of the sandbox is killed. The harness itself is made unreachable from the program
(``protect``): it cannot be traced, stopped, killed or have its reply pipe opened.
"""
import builtins
import io
import json
import os
import resource
import signal
import sys
import time

PROTO_IN = PROTO_OUT = None   # the grader's pipes (stdin/stdout), opened when run as a program

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

def protect():
    """Make this process unreachable from the programs it runs (same uid): not dumpable, so
    ptrace, pidfd_getfd and /proc/<pid>/fd are refused (they need ptrace access, which a
    non-dumpable process grants only to CAP_SYS_PTRACE, and every capability is dropped).
    Signals: under bubblewrap the harness is the pid namespace's init (``--as-pid-1``), and init
    receives no signal from inside its namespace that it has no handler for (SIGKILL and SIGSTOP
    included)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:   # PR_SET_DUMPABLE, 0
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")

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
    except BaseException:  # noqa: BLE001 - the harness reports any failure of untrusted code as a verdict
        ok = False
        try:
            import traceback
            traceback.print_exc()
        except BaseException:  # noqa: BLE001 - the harness reports any failure of untrusted code as a verdict
            pass
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 - the harness reports any failure of untrusted code as a verdict
        ok = False
    if ok and payload is not None:
        try:
            rfd = os.open(res_path, flags, 0o600)
            view = memoryview(payload)
            while view:
                view = view[os.write(rfd, view):]
            os.close(rfd)
        except BaseException:  # noqa: BLE001 - the harness reports any failure of untrusted code as a verdict
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
    except BaseException as err:  # noqa: BLE001 - the harness reports any failure of untrusted code as a verdict
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

if __name__ == "__main__":
    PROTO_IN = os.fdopen(0, "rb", buffering=0)
    PROTO_OUT = os.fdopen(1, "wb", buffering=0)
    if "--exposed" not in sys.argv[2:]:   # tests only: leave the harness reachable
        protect()
    try:
        main()
    except BrokenPipeError:
        pass
