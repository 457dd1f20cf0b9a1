"""CodeReward: LiveCodeBench test semantics, the sandbox against adversarial programs, parallel
grading.

Every adversarial program is written so that it would *pass* (score 1) if the protection it
attacks were missing: e.g. the network attack prints what a local server sends it, and that is
the expected output. ``test_weakened_sandbox_lets_each_attack_through`` (slow) proves it: it
switches off one protection per attack and checks the attack then succeeds.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from aspo_lit.rewards.code import (
    CodeReward,
    SandboxUnavailable,
    code_gold,
    extract_code,
    functional_match,
    parse_gold,
    stdout_match,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(
    not HAVE_BWRAP and os.environ.get("CI") != "true",
    reason="bubblewrap (bwrap) is not installed; `make setup` installs it (required in CI)")


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{textwrap.dedent(code).strip()}\n```\n"


def stdin_gold(*pairs, **extra) -> str:
    return code_gold({"tests": [{"input": i, "output": o} for i, o in pairs], "fn_name": None, **extra})


def functional_gold(fn_name, *pairs) -> str:
    return code_gold({"tests": [{"input": i, "output": o} for i, o in pairs], "fn_name": fn_name})


def sandbox_pids() -> list[int]:
    """Live processes started by any CodeReward (their command line carries the run marker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if b"aspo-sandbox-" in cmdline and state != b"Z":
            found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def reward():
    if not HAVE_BWRAP:
        pytest.fail("bwrap is required in CI: run `make setup` (apt-get install bubblewrap)")
    r = CodeReward(timeout_s=1.5, memory_limit_mb=512, num_workers=2)
    yield r
    r.close()


# --------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize("pred, expected, ok", [
    ("3\n", "3", True),
    ("  3  \r\n\n", "3\r\n", True),                 # whole-output and per-line strip
    ("1.0", "1", True),                             # Decimal token compare
    ("0.10 0.20\n", "0.1 0.2", True),
    ("1e2", "100", True),
    ("1.000001", "1", False),                       # no float tolerance
    ("1 2", "1  2", True),                          # tokens, not spacing
    ("abc", "abd", False),
    ("Yes", "yes", False),
    ("1\n2", "1 2", False),                         # line counts must agree
    ("1\n\n2", "1\n2", False),
    ("", "0", False),
    ("nan", "nan", True),                           # equal as strings
    ("NaN 1", "nan 1", False),                      # Decimal NaN != NaN
    ("x 1", "x 1.0", False),                        # a non-numeric token: string compare only
])
def test_stdout_match_lcb_semantics(pred, expected, ok):
    assert stdout_match(pred, expected) is ok


@pytest.mark.parametrize("pred, expected, ok", [
    ([1, 2], "[1, 2]", True),
    ((1, 2), "[1, 2]", True),                       # a returned tuple counts as a list
    ([(1, 2)], "[[1, 2]]", False),                  # ... only at the top level (LCB)
    (1, "true", True),                              # Python's ==, as LCB
    (2.0, "2", True),
    ("a", "\"a\"", True),
    ({"a": 1}, "{\"a\": 1}", True),
    ([1, 2], "[2, 1]", False),
    (None, "null", True),
    ([1], "not json", False),
])
def test_functional_match(pred, expected, ok):
    assert functional_match(pred, expected) is ok


def test_extract_code():
    assert extract_code("```python\nprint(1)\n```") == "print(1)\n"
    two = "```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```"
    assert extract_code(two) == "print(2)\n"
    assert extract_code("```python\nprint(1)\n```\n```bash\nls\n```") == "print(1)\n"   # python only
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"                          # untagged
    assert extract_code("```python\nprint(1)\n```\n```python\nprint(2)") == "print(1)\n"  # unclosed
    assert extract_code("<think>```python\nprint(1)\n```</think> no code") is None
    assert extract_code("<think>draft</think>```python\nprint(5)\n```") == "print(5)\n"
    assert extract_code("no code at all") is None
    assert extract_code("```python\n\n```") is None


def test_gold_round_trip():
    row = {"tests": [{"input": "1\n", "output": "2\n", "type": "stdin"}], "fn_name": None,
           "time_limit_s": 2.0, "memory_limit_bytes": 256000000}
    spec = parse_gold(code_gold(row))
    assert spec.tests == (("1\n", "2\n"),) and spec.kind == "stdin"
    assert spec.time_limit_s == 2.0 and spec.memory_limit_bytes == 256000000
    assert parse_gold(json.loads(code_gold(row))) == spec
    with pytest.raises(ValueError):
        parse_gold({"tests": []})
    with pytest.raises(ValueError):
        parse_gold({"tests": [{"input": "1", "output": "1"}], "fn_name": "not an id"})


# --------------------------------------------------------------------------- positive grading

SUM = stdin_gold(("1 2\n", "3\n"), ("10 -4\n", "6\n"))


@needs_bwrap
def test_correct_and_wrong_stdin_solutions(reward):
    good = fenced("a, b = map(int, input().split())\nprint(a + b)")
    reads_buffer = fenced("import sys\na, b = map(int, sys.stdin.buffer.read().split())\nprint(a + b)")
    main_guard = fenced("""
        def main():
            a, b = map(int, input().split())
            print(a + b)
        if __name__ == "__main__":
            main()
    """)
    wrong = fenced("a, b = map(int, input().split())\nprint(a - b)")
    first_only = fenced("print(3)")
    crash_after_output = fenced("a, b = map(int, input().split())\nprint(a + b)\nraise ValueError")
    exit_after_output = fenced("import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit(0)")
    texts = [good, reads_buffer, main_guard, wrong, first_only, crash_after_output, exit_after_output]
    results = reward.run_batch(texts, [SUM] * len(texts))
    assert [r.status for r in results] == ["passed", "passed", "passed", "wrong_answer", "wrong_answer",
                                           "runtime_error", "passed"]
    assert results[4].failed_test == 1 and results[4].tests_run == 2   # stops at the first failure
    assert reward.batch(texts, [SUM] * len(texts)) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


@needs_bwrap
def test_functional_solutions(reward):
    gold = functional_gold("twoLargest", ("[3, 1, 2]\n2", "[3, 2]"), ("[5, 5]\n1", "[5]"))
    good = fenced("""
        class Solution:
            def twoLargest(self, nums: List[int], k: int) -> List[int]:
                return tuple(sorted(nums, reverse=True)[:k])
    """)
    top_level = fenced("""
        def twoLargest(nums, k):
            return sorted(nums)[::-1][:k]
    """)
    wrong = fenced("""
        class Solution:
            def twoLargest(self, nums, k):
                return sorted(nums)[:k]
    """)
    cheat_eq = fenced("""
        class Anything(list):
            def __eq__(self, other):
                return True
        class Solution:
            def twoLargest(self, nums, k):
                return Anything()
    """)
    exits = fenced("""
        import sys
        class Solution:
            def twoLargest(self, nums, k):
                sys.exit(0)
    """)
    results = reward.run_batch([good, top_level, wrong, cheat_eq, exits], [gold] * 5)
    assert [r.status for r in results] == ["passed", "passed", "wrong_answer", "wrong_answer",
                                           "runtime_error"]


@needs_bwrap
def test_compile_error_and_no_code(reward):
    assert reward.run(fenced("def f(:\n  pass"), SUM).status == "compile_error"
    assert reward.run("I cannot solve this.", SUM).status == "no_code"
    assert reward.run(fenced("print(3)"), "{not json").status == "bad_gold"


@needs_bwrap
def test_row_time_and_memory_limits(reward):
    sleepy = fenced("import time\ntime.sleep(1.2)\nprint(1)")
    tight = stdin_gold(("", "1"), time_limit_s=0.5)
    loose = stdin_gold(("", "1"), time_limit_s=3.0)
    assert [r.status for r in reward.run_batch([sleepy, sleepy], [tight, loose])] == ["timeout", "passed"]
    hungry = fenced("x = bytearray(400 * 2**20)\nprint(1)")
    small = stdin_gold(("", "1"), memory_limit_bytes=300 * 2**20)
    big = stdin_gold(("", "1"), memory_limit_bytes=1024 * 2**20)
    assert [r.status for r in reward.run_batch([hungry, hungry], [small, big])] == ["runtime_error", "passed"]


@needs_bwrap
def test_batch_is_parallel_and_bounded():
    r = CodeReward(timeout_s=1.0, num_workers=2, batch_timeout_s=2.5)
    try:
        loops = [fenced(f"# variant {i}\nwhile True: pass") for i in range(8)]
        start = time.monotonic()
        scores = r.batch(loops + [fenced("print(3)")], [stdin_gold(("", "3"))] * 9)
        elapsed = time.monotonic() - start
        assert scores[:8] == [0.0] * 8
        assert elapsed < 5.0, f"batch took {elapsed:.1f}s despite batch_timeout_s=2.5"
    finally:
        r.close()
    assert not sandbox_pids()


@needs_bwrap
def test_identical_programs_run_once(reward, monkeypatch):
    calls = []
    real = CodeReward._run_program

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CodeReward, "_run_program", counting)
    good = fenced("a, b = map(int, input().split())\nprint(a + b)")
    assert reward.batch([good] * 6, [SUM] * 6) == [1.0] * 6
    assert len(calls) == 1


def test_missing_bwrap_is_one_clear_line():
    r = CodeReward(bwrap="/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable) as err:
        r.batch([fenced("print(1)")], [stdin_gold(("", "1"))])
    message = str(err.value)
    assert "\n" not in message and "sandbox='rlimit'" in message and "bubblewrap" in message
    assert r("no code here", stdin_gold(("", "1"))) == 0.0     # nothing to run: no sandbox needed


def test_per_test_limit_above_the_program_bound_is_an_error():
    """A 150 s per-test limit (the authors' Table 2) under the default 120 s per-program bound would
    be cut to 120 s without a word: it is refused, naming both keys."""
    with pytest.raises(ValueError, match="timeout_s=150.0 .*max_total_timeout_s=120.0"):
        CodeReward(timeout_s=150.0)
    with pytest.raises(ValueError, match="total_timeout_s=10"):
        CodeReward(timeout_s=20.0, total_timeout_s=10)
    assert CodeReward(timeout_s=150.0, max_total_timeout_s=float("inf")).timeout_s == 150.0


def test_picklable():
    r = CodeReward(timeout_s=2.0, sandbox="rlimit")
    clone = pickle.loads(pickle.dumps(r))
    assert clone.timeout_s == 2.0 and clone.sandbox == "rlimit" and clone._pool is None


# --------------------------------------------------------------------------- adversarial programs


def _attack(name: str, tmp_path: Path, secret_port: int | None = None):
    """(program, gold, per-attack note) for one adversarial case. Each program would pass if the
    protection it attacks were missing."""
    marker = f"pwned-{uuid.uuid4().hex[:8]}"
    if name == "infinite_loop":
        return fenced("print(3, flush=True)\nwhile True:\n    pass"), stdin_gold(("", "3")), {}
    if name == "fork_bomb":
        return fenced("""
            import os
            print(3, flush=True)
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
        """), stdin_gold(("", "3")), {}
    if name == "fork_count":   # a bounded bomb: passes only if 200 processes could be made
        return fenced("""
            import os, time
            n = 0
            for _ in range(200):
                try:
                    pid = os.fork()
                except OSError:
                    break
                if pid == 0:
                    time.sleep(1000)
                    os._exit(0)
                n += 1
            print(n)
        """), stdin_gold(("", "200")), {}
    if name == "alloc_10gb":
        return fenced("x = bytes(10 * 2**30)\nprint(len(x))"), \
            stdin_gold(("", str(10 * 2**30))), {}
    if name == "write_outside":
        targets = [str(tmp_path / marker), str(REPO_ROOT / marker), str(Path.home() / marker),
                   f"/var/tmp/{marker}", f"/dev/shm/{marker}", f"/{marker}", f"/usr/{marker}"]
        code = f"""
            written = []
            for path in {targets!r}:
                try:
                    with open(path, "w") as f:
                        f.write("x")
                    written.append(path)
                except OSError:
                    pass
            print("written" if written else "blocked")
        """
        return fenced(code), stdin_gold(("", "written")), {"targets": targets}
    if name == "read_repo":
        first_line = (REPO_ROOT / "README.md").read_text().splitlines()[0]
        return fenced(f"print(open({str(REPO_ROOT / 'README.md')!r}).readline().strip())"), \
            stdin_gold(("", first_line)), {}
    if name == "read_home":   # ~/.ssh when there is one, else the home folder's listing
        home = Path.home()
        target = home / ".ssh" if (home / ".ssh").is_dir() else home
        listing = json.dumps(sorted(os.listdir(target)))
        return fenced(f"import os, json\nprint(json.dumps(sorted(os.listdir({str(target)!r}))))"), \
            stdin_gold(("", listing)), {}
    if name == "network":
        return fenced(f"""
            import socket
            s = socket.create_connection(("127.0.0.1", {secret_port}), timeout=1)
            print(s.recv(100).decode())
        """), stdin_gold(("", "token-from-the-host")), {}
    if name == "kill_parent":   # kill every ancestor it can see; the right answer if one died
        return fenced("""
            import os, signal, time
            pid, ancestors, killed = os.getpid(), [], []
            for _ in range(3):   # all ancestors first: a killed one's /proc entry goes away
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
                if pid < 1:
                    break
                ancestors.append(pid)
            for pid in ancestors:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except OSError:
                    pass
            time.sleep(0.2)
            print(3 if any(not os.path.exists(f"/proc/{p}") for p in killed) else "all alive", flush=True)
        """), stdin_gold(("", "3")), {}
    if name == "print_100mb":   # LCB strips the output: the trailing blanks would not matter
        return fenced("import sys\nprint(3)\nsys.stdout.write(' ' * 100_000_000)"), stdin_gold(("", "3")), {}
    if name == "exit_before_output":
        return fenced("import sys\nsys.exit(0)\nprint(3)"), stdin_gold(("", "3")), {}
    if name == "read_expected":
        token = f"EXPECTED-{uuid.uuid4().hex}"
        (tmp_path / "expected.txt").write_text(token)
        code = f"""
            import os, re
            pat = re.compile(r"EXPECTED-[0-9a-f]{{32}}")
            found = []
            def look(text):
                found.extend(pat.findall(text))
            look(" ".join(os.environ.values()))
            for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
                for part in ("cmdline", "environ"):
                    try:
                        look(open(f"/proc/{{pid}}/{{part}}", "rb").read().decode("latin-1"))
                    except OSError:
                        pass
            for root in ("/tmp", {str(tmp_path)!r}, {str(REPO_ROOT)!r}):
                for folder, _, files in os.walk(root):
                    for name in files[:200]:
                        try:
                            look(open(os.path.join(folder, name), "rb").read(1 << 16).decode("latin-1"))
                        except OSError:
                            pass
            print(found[0] if found else "none")
        """
        return fenced(code), stdin_gold(("", token)), {"token": token}
    if name == "forge_reply":   # stop the harness, write its "ok" reply with the right answer, sleep
        return fenced("""
            import ctypes, os, signal, time
            harness = os.getppid()
            try:
                os.kill(harness, signal.SIGSTOP)
            except OSError:
                pass
            fd = -1
            try:
                fd = os.open(f"/proc/{harness}/fd/1", os.O_WRONLY)
            except OSError:   # else a copy of its reply pipe through pidfd_getfd
                try:
                    fd = ctypes.CDLL(None).syscall(438, os.pidfd_open(harness), 1, 0)
                except OSError:
                    pass
            if fd >= 0:
                os.write(fd, b'{"status": "ok", "n": 1}\\n7')
            time.sleep(60)
        """), stdin_gold(("", "7")), {}
    if name == "memfd_fanout":   # 4 processes x 300 MB of memfds, under a 512 MB address-space limit
        return fenced("""
            import os, time
            r, w = os.pipe()
            pids = []
            for _ in range(4):
                pid = os.fork()
                if pid == 0:
                    chunk, fds = b"x" * (15 << 20), []
                    for _ in range(20):   # 20 x 15 MB: each file stays under the file-size limit
                        fd = os.memfd_create("hold")
                        os.write(fd, chunk)
                        fds.append(fd)
                    os.write(w, b"1")
                    time.sleep(60)
                    os._exit(0)
                pids.append(pid)
            held, deadline = 0, time.time() + 6
            while held < 4 and time.time() < deadline:
                held += len(os.read(r, 4))
            # held at once: a holder killed to make room for the next one (the OOM killer's pick)
            # had reported before it died. The kill is sent before the next holder's write returns,
            # but a killed holder takes a moment to exit and free its memfds, and until then waitpid
            # reports it running: one flaky 1200 in CI. A second's wait lets it finish dying.
            time.sleep(1.0)
            alive = sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in pids)
            print(min(held, alive) * 300)
        """), stdin_gold(("", "1200")), {}
    raise KeyError(name)


ATTACKS = ["infinite_loop", "fork_bomb", "fork_count", "alloc_10gb", "write_outside", "read_repo",
           "read_home", "network", "kill_parent", "print_100mb", "exit_before_output", "read_expected",
           "forge_reply"]


@pytest.fixture
def host_server():
    """A TCP server on the host's loopback that greets every client with a token."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"token-from-the-host")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    server.close()


def _leftover_files(details) -> list[str]:
    return [p for p in details.get("targets", []) if os.path.exists(p) and not p.startswith("/tmp/")]


@needs_bwrap
@pytest.mark.parametrize("name", ATTACKS)
def test_adversarial_program_scores_zero_and_leaves_nothing(name, reward, tmp_path, host_server,
                                                           monkeypatch):
    program, gold, details = _attack(name, tmp_path, host_server)
    if "token" in details:   # the grader's own environment holds the expected output
        monkeypatch.setenv("ASPO_TEST_EXPECTED", details["token"])
    before = set(os.listdir(tempfile_dir()))
    start = time.monotonic()
    result = reward.run(program, gold)
    elapsed = time.monotonic() - start
    limits = reward.limits_for(parse_gold(gold), 1)
    assert result.score == 0.0, f"{name}: {result}"
    assert elapsed <= limits.per_test_s + 3.0, f"{name} took {elapsed:.1f}s"
    assert not sandbox_pids(), f"{name} left processes behind"
    assert not _leftover_files(details), f"{name} wrote {_leftover_files(details)}"
    assert not [p for p in os.listdir(tmp_path) if p.startswith("pwned-")]
    assert not {p for p in set(os.listdir(tempfile_dir())) - before if p.startswith(("aspo-code-", "pwned-"))}
    # the grader is intact: the next program is graded normally
    assert reward(fenced("print(3)"), stdin_gold(("", "3"))) == 1.0


def tempfile_dir() -> str:
    import tempfile

    return tempfile.gettempdir()


# Each attack with the one protection it defeats switched off: the attack must then succeed,
# which shows that the protection (not luck) is what stops it above.
WEAKENINGS = {
    "infinite_loop": ("no per-test time limit", dict(timeout_s=60, batch_timeout_s=6.0), {}),
    "fork_count": ("no process limit", dict(max_processes=100_000), {}),
    "alloc_10gb": ("no address-space limit", dict(memory_limit_mb=64 * 1024), {}),
    "write_outside": ("the host temp folder bound writable", {}, "bind_tmp"),
    "read_repo": ("the repository bound", {}, "bind_repo"),
    "read_home": ("the home folder bound, uid 0 kept", {}, "bind_home"),
    "network": ("no network namespace", {}, dict(unshare_net=False)),
    "print_100mb": ("no output limit", dict(max_output_mb=256), {}),
    "read_expected": ("the grader's environment passed in", {}, dict(clear_env=False)),
    "forge_reply": ("the harness dumpable and not the namespace's init", {}, dict(protect_harness=False)),
    "memfd_fanout": ("no memory cgroup (rlimits only)", dict(timeout_s=10.0), dict(memory_cgroup=False)),
}


def _mem_total_gb() -> float:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) / 2**20


@needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WEAKENINGS))
def test_weakened_sandbox_lets_each_attack_through(name, tmp_path, host_server, monkeypatch):
    what, reward_kwargs, sandbox_change = WEAKENINGS[name]
    if name == "alloc_10gb" and _mem_total_gb() < 12:
        pytest.skip("a 10 GB allocation fails here even without an address-space limit (overcommit)")
    program, gold, details = _attack(name, tmp_path, host_server)
    if "token" in details:
        monkeypatch.setenv("ASPO_TEST_EXPECTED", details["token"])
    r = CodeReward(**{"timeout_s": 2.0, "memory_limit_mb": 512, **reward_kwargs})
    if sandbox_change == "bind_tmp":
        r.sandbox_config = replace(r.sandbox_config, extra_binds=((str(tmp_path), str(tmp_path)),),
                                   run_as_uid=None)
    elif sandbox_change == "bind_repo":
        r.sandbox_config = replace(r.sandbox_config, extra_binds=((str(REPO_ROOT), str(REPO_ROOT)),))
    elif sandbox_change == "bind_home":
        home = str(Path.home())
        r.sandbox_config = replace(r.sandbox_config, extra_binds=((home, home),), run_as_uid=None)
    elif sandbox_change:
        r.sandbox_config = replace(r.sandbox_config, **sandbox_change)
    try:
        start = time.monotonic()
        result = r.run(program, gold)
        elapsed = time.monotonic() - start
    finally:
        r.close()
        for pid in sandbox_pids():   # the weakened fork bomb's sleepers, if any survived
            os.kill(pid, 9)
    if name == "infinite_loop":   # without the per-test limit only the batch bound ends it
        assert result.status == "timeout" and elapsed >= 5.5, (elapsed, result)
    else:
        assert result.score == 1.0, f"{name} with {what}: {result}"
    if name == "write_outside":
        assert [p for p in os.listdir(tmp_path) if p.startswith("pwned-")]


@needs_bwrap
@pytest.mark.slow
def test_weakened_pid_namespace_lets_kill_parent_kill_the_grader(tmp_path):
    """Without the pid namespace (and as uid 0), the kill-your-ancestors program kills the grader
    itself; run in a separate grader process so that this test survives."""
    program, gold, _ = _attack("kill_parent", tmp_path)
    script = textwrap.dedent(f"""
        import sys
        from dataclasses import replace
        from aspo_lit.rewards.code import CodeReward
        r = CodeReward(timeout_s=2.0)
        r.sandbox_config = replace(r.sandbox_config, unshare_pid={{weak}}, run_as_uid=None)
        print("score", r({program!r}, {gold!r}), flush=True)
    """)
    strong = subprocess.run([sys.executable, "-c", script.replace("{weak}", "True")], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert strong.returncode == 0 and "score 0.0" in strong.stdout, strong.stderr[-2000:]
    weak = subprocess.run([sys.executable, "-c", script.replace("{weak}", "False")], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert weak.returncode == -9, (weak.returncode, weak.stdout, weak.stderr[-2000:])


REACH_HARNESS = """
    import ctypes, errno, json, os, signal, time
    libc = ctypes.CDLL(None, use_errno=True)
    harness, report = os.getppid(), {}
    def outcome(ok):
        return "reached" if ok else errno.errorcode.get(ctypes.get_errno(), "refused")
    report["ptrace"] = outcome(libc.ptrace(0x4206, harness, None, None) == 0)   # PTRACE_SEIZE
    try:
        pidfd = os.pidfd_open(harness)
        report["pidfd_getfd"] = outcome(libc.syscall(438, pidfd, 1, 0) >= 0)     # SYS_pidfd_getfd
    except OSError as err:
        report["pidfd_getfd"] = errno.errorcode[err.errno]
    try:
        os.close(os.open(f"/proc/{harness}/fd/1", os.O_WRONLY))
        report["proc_fd"] = "reached"
    except OSError as err:
        report["proc_fd"] = errno.errorcode[err.errno]
    os.kill(harness, signal.SIGSTOP)
    time.sleep(0.2)
    state = open(f"/proc/{harness}/stat").read().rsplit(")", 1)[1].split()[0]
    report["stop"] = "reached" if state in ("T", "t") else "ignored"
    os.kill(harness, signal.SIGCONT)
    print(json.dumps(report, sort_keys=True))
"""


@needs_bwrap
@pytest.mark.parametrize("protect", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_program_cannot_trace_signal_or_read_the_harness(protect):
    """The program runs as the harness's uid, as its child: ptrace, pidfd_getfd, its
    /proc/<pid>/fd and SIGSTOP are all refused (and, with the protection off, all reach it)."""
    r = CodeReward(timeout_s=3.0, memory_limit_mb=512)
    r.sandbox_config = replace(r.sandbox_config, protect_harness=protect)
    try:
        result = r.run(fenced(REACH_HARNESS), stdin_gold(("", "unused")))
    finally:
        r.close()
    report = json.loads(result.output)
    if protect:
        assert report == {"pidfd_getfd": "EPERM", "proc_fd": "EACCES", "ptrace": "EPERM", "stop": "ignored"}, report
    else:   # (its /proc/<pid>/fd is refused for another reason: bwrap's /proc mount)
        assert report["ptrace"] == report["pidfd_getfd"] == report["stop"] == "reached", report


@needs_bwrap
def test_sandbox_memory_is_bounded_in_total(tmp_path):
    """4 forked processes holding 300 MB of memfds each, every process within its 512 MB
    address-space limit: the run's memory cgroup (1 GB here) ends it. Without the cgroup the
    attack succeeds (test_weakened_sandbox_lets_each_attack_through[memfd_fanout])."""
    r = CodeReward(timeout_s=10.0, memory_limit_mb=512)
    try:
        result = r.run(*_attack("memfd_fanout", tmp_path)[:2])
        if getattr(r.sandbox_ready(), "cgroup_parent", "") is None:
            pytest.skip("no writable memory cgroup here: memory is bounded per process only")
    finally:
        r.close()
    assert result.score == 0.0 and not sandbox_pids(), result
    assert r.sandbox_config.memory_bytes == 1024 * 2**20


def test_results_that_cannot_match_are_never_decoded():
    """The grader's own memory: a result is bounded by the expected output's size before it is
    decoded or split (a list of 4 M empty lists, 16 MB encoded, is ~800 MB of Python lists)."""
    import tracemalloc

    from aspo_lit.rewards.livecodebench import result_matches

    cases = [("fn", b"[" + b"[], " * (4 << 20) + b"[]]", "[]"),        # functional: 16 MB of empty lists
             (None, b"1\n" * (8 << 20), "1"),                         # stdin: 8 M lines
             (None, b"\n".join([b"1 2"] * (4 << 20)), "1 2\n" * 3)]   # stdin: 4 M lines against 3
    for fn_name, payload, expected in cases:
        tracemalloc.start()
        start = time.perf_counter()
        ok = result_matches(fn_name, payload, expected)
        elapsed, peak = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert ok is False
        assert elapsed < 1.0 and peak < 3 * len(payload) + (8 << 20), (fn_name, elapsed, peak)


GARBAGE_RESULTS = {   # functional programs whose result the grader cannot decode or compare
    "frozenset_keys": "class Solution:\n    def f(self, x):\n        return {frozenset([1]): 2}",
    "namedtuple_keys": ("from collections import namedtuple\nP = namedtuple('P', 'a b')\n"
                        "class Solution:\n    def f(self, x):\n        return {P(1, 2): 3}"),
    "dataclass_keys": ("from dataclasses import dataclass\n@dataclass(frozen=True)\nclass K:\n    a: int\n"
                       "class Solution:\n    def f(self, x):\n        return {K(1): [K(2)]}"),
    "tuple_with_list_key": "class Solution:\n    def f(self, x):\n        return {(1, (2,)): 1, 3: {4: 5}}",
}
FORGED_RESULT_FILES = ['{"d": 5}', '{"t": 7}', '{"d": [[[1], 2, 3]]}', '{"d": [[{"d": []}, 1]]}', '[' * 100000,
                       '{"o": [1]}', '{"x": 1, "y": 2}', 'not json', '\udcff']


@needs_bwrap
def test_garbage_results_score_zero_and_never_raise(reward):
    """Results of unusual shapes, and result files the program forged itself, score 0 in one
    batch; nothing escapes `batch`, and the next program is graded normally."""
    gold = functional_gold("f", ("1", "[1]"))
    programs = [fenced(code) for code in GARBAGE_RESULTS.values()]
    for content in FORGED_RESULT_FILES:   # written where the harness reads the result, then exit 0
        programs.append(fenced(f"import os\nopen('t0.res', 'w').write({content!r})\nos._exit(0)"))
    programs += [None, 123, b"```python\nprint(1)\n```"]   # not even text
    scores = reward.batch(programs, [gold] * len(programs))
    assert scores == [0.0] * len(programs)
    assert reward(fenced("class Solution:\n    def f(self, x):\n        return [x]"), gold) == 1.0


def test_grader_failure_scores_zero_counted(reward, monkeypatch):
    """A failure in the grader's own handling of one program (here: comparing its result raises)
    scores that program 0 and is counted; the other programs of the batch are graded."""
    import aspo_lit.rewards.code as code_module

    calls = {"n": 0}

    def flaky(fn_name, payload, expected):
        calls["n"] += 1
        if payload.strip() == b"2":
            raise RuntimeError("comparison blew up")
        return payload.strip() == expected.encode()

    monkeypatch.setattr(code_module, "result_matches", flaky)
    before = reward.failures["grader_error"]
    scores = reward.batch([fenced("print(1)"), fenced("print(2)")], [stdin_gold(("", "1"))] * 2)
    assert scores == [1.0, 0.0] and reward.failures["grader_error"] == before + 1


# --------------------------------------------------------------------------- rlimit-only mode


def test_rlimit_mode_grades_and_contains_loops_and_bombs():
    r = CodeReward(sandbox="rlimit", timeout_s=1.0, memory_limit_mb=512, num_workers=2)
    try:
        good = fenced("a, b = map(int, input().split())\nprint(a + b)")
        bomb, gold, _ = _attack("fork_bomb", Path("/nonexistent"))
        loop, _, _ = _attack("infinite_loop", Path("/nonexistent"))
        start = time.monotonic()
        assert r.batch([good, bomb, loop], [SUM, gold, gold]) == [1.0, 0.0, 0.0]
        assert time.monotonic() - start < 10
    finally:
        r.close()
    assert not sandbox_pids()


# --------------------------------------------------------------------------- staged LiveCodeBench rows


@needs_bwrap
def test_real_lcb_rows(reward, shared_data_dir):
    path = shared_data_dir / "code" / "lcb_v5.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not staged")
    rows = {json.loads(line)["id"]: json.loads(line) for line in path.open()}
    for row in rows.values():   # every staged row parses into a spec
        assert parse_gold(code_gold(row)).kind == ("functional" if row["fn_name"] else "stdin")
    stdin_row = rows["lcb-abc365_b"]        # index of the second largest element
    solution = fenced("""
        n = int(input())
        a = list(map(int, input().split()))
        print(sorted(range(n), key=lambda i: a[i])[-2] + 1)
    """)
    assert reward(solution, code_gold(stdin_row)) == 1.0
    assert reward(fenced("print(1)"), code_gold(stdin_row)) == 0.0
    functional = next(r for r in rows.values() if r["fn_name"] == "shortestDistanceAfterQueries")
    bfs = fenced("""
        from collections import deque
        class Solution:
            def shortestDistanceAfterQueries(self, n: int, queries: List[List[int]]) -> List[int]:
                adj = [[i + 1] for i in range(n - 1)] + [[]]
                out = []
                for u, v in queries:
                    adj[u].append(v)
                    dist = [-1] * n
                    dist[0] = 0
                    q = deque([0])
                    while q:
                        x = q.popleft()
                        for y in adj[x]:
                            if dist[y] < 0:
                                dist[y] = dist[x] + 1
                                q.append(y)
                    out.append(dist[n - 1])
                return out
    """)
    assert reward(bfs, code_gold(functional)) == 1.0
