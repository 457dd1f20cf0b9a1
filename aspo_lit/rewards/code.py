"""Execution reward for code RL: run the response's program on the problem's tests, in a sandbox.

The outcome reward of the paper's code runs (§7, following DeepCoder): 1.0 when the last fenced
Python block of the response passes **every** test of the problem, else 0.0. Test semantics are
LiveCodeBench's (``aspo_lit.rewards.livecodebench``); the program runs in a sandbox
(``aspo_lit.rewards.sandbox``) under the test harness (``aspo_lit.rewards.harness``), one forked
process per test; tests run in order and grading stops at the first failure.

Differences from LiveCodeBench, all on the side of a real judge: the program runs as a real
process with real stdin/stdout (``sys.stdin.buffer`` works), the module is executed afresh for
every test, and the comparison happens *outside* the sandbox on plain decoded values (a returned
object whose ``__eq__`` always says True cannot pass).

What the grader trusts of the sandbox: only the bytes to compare. Every time limit runs on the
grader's own clock (per test: the limit plus ``HARNESS_SLACK``; per program: ``total_timeout_s``),
a reply is size-bounded before it is read and checked for shape, a result is size-bounded before it
is decoded (``result_matches``), and any failure of the grader's own handling of one program
scores that program 0 (``CodeReward.failures`` counts them): nothing a program does can raise out
of ``batch``.

Grading is parallel: ``CodeReward.batch`` runs up to ``num_workers`` sandboxes at once (threads
waiting on subprocesses); every program is bounded by its total timeout, and identical programs
for the same problem (common within a group) are run once.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import select
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from aspo_lit.rewards.lifecycle import ProcessLocalWorkers
from aspo_lit.rewards.livecodebench import (
    LCB_PRELUDE,
    CodeSpec,
    code_gold,
    extract_code,
    functional_match,
    parse_gold,
    result_matches,
    stdout_match,
)
from aspo_lit.rewards.sandbox import Sandbox, SandboxConfig, SandboxKind, SandboxUnavailable, find_python

log = logging.getLogger(__name__)

__all__ = [
    "CodeReward",
    "CodeSpec",
    "ProgramResult",
    "SandboxConfig",
    "SandboxUnavailable",
    "code_gold",
    "extract_code",
    "find_python",
    "functional_match",
    "parse_gold",
    "stdout_match",
    "LCB_PRELUDE",
]

HARNESS_SLACK = (1.0, 0.5)   # the harness answers within per-test limit * (1 + 0.5) + 1 s


# --------------------------------------------------------------------------- running one program


@dataclass
class ProgramResult:
    """The outcome of one program on one problem."""

    passed: bool
    status: str                 # passed | no_code | bad_gold | compile_error | wrong_answer |
                                # runtime_error | timeout | output_limit | crashed | sandbox_error |
                                # batch_timeout | bad_input | grader_error
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
        if not isinstance(head, dict) or not isinstance(head.get("n", 0), int):
            raise ValueError("malformed reply")
        n = head.get("n", 0)
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


class CodeReward(ProcessLocalWorkers):
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
        sandbox_memory_mb: the memory cgroup limit of one run, all its processes, memfds and tmpfs
            pages together (default: ``memory_limit_mb`` + the 256 MB tmpfs + 256 MB for the
            harness); where no memory cgroup is writable, memory is bounded per process only.
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
        sandbox: SandboxKind = "bwrap",
        timeout_s: float = 6.0,
        total_timeout_s: float | None = None,
        max_total_timeout_s: float = 120.0,
        memory_limit_mb: int = 2048,
        min_memory_mb: int = 256,
        max_output_mb: float = 16.0,
        sandbox_memory_mb: int | None = None,
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
        if timeout_s <= 0 or memory_limit_mb <= 0 or max_output_mb <= 0 or max_processes < 1:
            raise ValueError("timeout_s, memory_limit_mb, max_output_mb and max_processes must be positive")
        if timeout_s > max_total_timeout_s or (total_timeout_s is not None and timeout_s > total_timeout_s):
            # one test's limit above the whole program's bound would be cut silently
            bound = "total_timeout_s" if total_timeout_s is not None and timeout_s > total_timeout_s else "max_total_timeout_s"
            raise ValueError(f"timeout_s={timeout_s} (per test) exceeds {bound}="
                             f"{total_timeout_s if bound == 'total_timeout_s' else max_total_timeout_s} "
                             "(per program, over all its tests): raise the latter too")
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
        total_mb = sandbox_memory_mb or self.memory_limit_mb + self.sandbox_config.tmpfs_bytes // 2**20 + 256
        self.sandbox_config.memory_bytes = int(total_mb) * 2**20
        self.failures: collections.Counter[str] = collections.Counter()  # grader-side failures, by kind
        self._sandbox: Sandbox | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- lifecycle: pickled without its sandbox and threads (``ProcessLocalWorkers``)
    _process_local = ("_sandbox", "_pool")

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "failures": collections.Counter()}  # a copy counts its own

    def close(self, wait: bool = True) -> None:
        """Stop the grading threads (a later call starts them again)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)

    def _stop_without_waiting(self) -> None:
        self.close(wait=False)

    def __repr__(self) -> str:
        return (f"CodeReward(sandbox={self.sandbox!r}, timeout_s={self.timeout_s}, "
                f"memory_limit_mb={self.memory_limit_mb}, num_workers={self.num_workers})")

    def sandbox_ready(self) -> Sandbox:
        """The sandbox, checked once (raises ``SandboxUnavailable`` with the opt-in hint)."""
        with self._lock:
            if self._sandbox is None:
                self._sandbox = Sandbox(self.sandbox_config)
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
        """Score ``texts[i]`` against ``golds[i]`` (the test spec) for all i, in parallel. Whatever
        a program does or returns, its score is 0 or 1: a failure of the grader's own handling
        of one program (a result it cannot decode or compare, a malformed reply) scores that
        program 0, is counted in ``failures`` and logged, and never raises."""
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
                outcomes = {(code, key): self._run_guarded(sandbox, code, specs[key], deadline)}
            else:
                pool = self._executor()
                futures = {job: pool.submit(self._run_guarded, sandbox, job[0], specs[job[1]], deadline)
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

    def _run_guarded(self, sandbox: Sandbox, code: str, spec: CodeSpec,
                     batch_deadline: float | None) -> ProgramResult:
        """``_run_program``, with any exception of the grader's own turned into a 0."""
        try:
            result = self._run_program(sandbox, code, spec, batch_deadline)
        except Exception as err:  # noqa: BLE001 - one program must never stop a run
            log.warning("CodeReward: grading one program failed (%s: %s); it scores 0",
                        type(err).__name__, str(err)[:200])
            result = ProgramResult(False, "grader_error", num_tests=len(spec.tests),
                                   detail=f"{type(err).__name__}: {str(err)[:200]}")
        if result.status in ("grader_error", "bad_reply"):
            self.failures[result.status] += 1
        return result

    def _run_program(self, sandbox: Sandbox, code: str, spec: CodeSpec,
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
        workdir = sandbox.host_workdir(uid)
        proc = cgroup = None
        info_r = info_w = None
        result = ProgramResult(False, "sandbox_error", num_tests=len(tests))
        try:
            if sandbox.mode == "pidns":
                info_r, info_w = os.pipe()
            proc, cgroup = sandbox.start(marker, workdir, uid, info_w, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
            if info_w is not None:
                os.close(info_w)
                info_w = None
            result = self._talk(_Channel(proc), sandbox, code, spec, tests, limits, deadline, workdir, uid)
        except OSError as err:
            result = ProgramResult(False, "sandbox_error", num_tests=len(tests), detail=str(err)[:200])
        finally:
            if info_w is not None:
                os.close(info_w)
            if proc is not None:   # start() removes the cgroup itself when it raises
                sandbox.stop(proc, marker, info_r, uid, cgroup)
            if info_r is not None:
                os.close(info_r)
            sandbox.cleanup_workdir(workdir)
            sandbox.release_uid(uid)
        result.elapsed_s = time.monotonic() - start
        return result

    def _talk(self, chan: _Channel, sandbox: Sandbox, code: str, spec: CodeSpec, tests, limits: _Limits,
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
                if not result_matches(spec.fn_name, payload, test_out):
                    return ProgramResult(False, "wrong_answer", index + 1, n, index, output=output)
            return ProgramResult(True, "passed", n, n, output=output if n else "")
        except _Timeout:
            return ProgramResult(False, "timeout", max(index, 0), n, max(index, 0), detail="wall clock")
        except (EOFError, BrokenPipeError, ConnectionError):
            return ProgramResult(False, "sandbox_error", max(index, 0), n, max(index, 0),
                                 detail="the sandbox ended early (killed?)")
        except (ValueError, json.JSONDecodeError) as err:   # an oversized or malformed reply
            status = "output_limit" if "oversized" in str(err) else "bad_reply"
            return ProgramResult(False, status, max(index, 0), n, max(index, 0), detail=str(err)[:200])
