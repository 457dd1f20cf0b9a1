"""Rule-based math reward: the last ``\\boxed{}`` after ``</think>``, graded with math-verify.

Every call is bounded in time (``timeout_s``), two ways:

* **Main-thread path** (``MathVerifyReward.__call__`` from the main thread, and every grading
  inside a pool worker): one ``SIGALRM`` interval timer (``signal.setitimer``, sub-second) covers
  the whole call (gold parse, answer parse, comparison). math-verify's own signal timeouts are
  switched off (``parsing_timeout=None`` / ``timeout_seconds=None``) because its
  ``signal.alarm(0)`` would cancel ours; our exception derives from ``BaseException`` so neither
  math-verify nor sympy swallow it.
* **Process path** (``MathVerifyReward.batch`` and any call from a non-main thread, where signals
  are unavailable): a small pool of long-lived worker subprocesses, each grading with the
  main-thread path above. Each item is sent to one idle worker with a hard deadline; a worker
  past it (e.g. stuck inside C code where a signal cannot land) is SIGKILLed and replaced, and
  its item scores 0.

Pure-Python guards run first: an exact match after light normalisation scores 1 without
math-verify (``fast_path``), and answers that are too long or too deeply nested score 0 without
being parsed. A pathological answer therefore scores 0; it never hangs or crashes the run.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

logger = logging.getLogger(__name__)

__all__ = [
    "GradingTimeout",
    "MathVerifyReward",
    "OverlongBuffer",
    "RewardFn",
    "compute_score",
    "extract_answer",
    "gold_answer",
    "last_boxed_only_string",
    "normalize_answer",
    "overlong_penalty",
    "remove_boxed",
]

MAX_ANSWER_CHARS = 1000  # a boxed answer longer than this scores 0 unparsed
MAX_BRACE_DEPTH = 32  # deeper {..} nesting scores 0 unparsed (the LaTeX parser recurses)


# --------------------------------------------------------------------------- protocol


@runtime_checkable
class RewardFn(Protocol):
    """What the rollout DataModule and the evaluator need from a reward."""

    def __call__(self, response_text: str, gold: str) -> float:
        """Score one response against the gold answer."""
        ...

    def batch(self, texts: Sequence[str], golds: Sequence[str]) -> list[float]:
        """Score ``texts[i]`` against ``golds[i]`` for all i."""
        ...


# --------------------------------------------------------------------------- overlong penalty


@dataclass(frozen=True)
class OverlongBuffer:
    """DAPO soft overlong punishment settings (lengths in tokens)."""

    max_response_length: int
    buffer_length: int
    penalty_factor: float = 1.0


def overlong_penalty(
    response_length: int, max_response_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> float:
    """DAPO's soft overlong punishment (``<= 0``), as in verl's ``DAPORewardManager``.

    Zero up to ``max_response_length - buffer_length`` tokens, then falling linearly to
    ``-penalty_factor`` at ``max_response_length`` (and further below beyond it).
    """
    if buffer_length <= 0:
        return 0.0
    expected_len = max_response_length - buffer_length
    exceed_len = response_length - expected_len
    return min(-exceed_len / buffer_length * penalty_factor, 0.0)


# --------------------------------------------------------------------------- extraction

_BOX_CMDS = ("\\boxed", "\\fbox")


def _boxed_starts(text: str) -> list[int]:
    """Positions of every ``\\boxed`` / ``\\fbox`` command (not e.g. ``\\boxedx``)."""
    return [m.start() for m in re.finditer(r"\\(?:boxed|fbox)(?![A-Za-z])", text)]


def _boxed_at(text: str, start: int) -> str | None:
    """The full ``\\boxed{...}`` (or ``\\boxed 5``) command starting at ``start``; None if unbalanced."""
    cmd = next(c for c in _BOX_CMDS if text.startswith(c, start))
    i = start + len(cmd)
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] != "{":
        if i == start + len(cmd):  # "\boxed5": not a command argument we understand
            return None
        m = re.match(r"[^\s$]+", text[i:])
        return text[start : i + m.end()] if m else None
    depth = 0
    for j in range(i, len(text)):
        ch = text[j]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start : j + 1]
    return None


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text`` with balanced braces (verl's name).

    Returns None when there is none, or when the last one is unbalanced (a truncated answer).
    """
    starts = _boxed_starts(text)
    return _boxed_at(text, starts[-1]) if starts else None


def remove_boxed(s: str) -> str:
    """``\\boxed{x}`` / ``\\boxed {x}`` / ``\\boxed x`` / ``\\fbox{x}`` -> ``x``."""
    for cmd in _BOX_CMDS:
        if s.startswith(cmd):
            rest = s[len(cmd) :].lstrip(" ")
            return rest[1:-1] if rest.startswith("{") and rest.endswith("}") else rest
    return s


def extract_answer(response_text: str, think_end_token: str | None = "</think>") -> str | None:
    """Content of the last boxed answer after the last ``think_end_token`` (when present)."""
    if think_end_token and think_end_token in response_text:
        response_text = response_text.rsplit(think_end_token, 1)[1]
    boxed = last_boxed_only_string(response_text)
    return None if boxed is None else remove_boxed(boxed)


def gold_answer(gold: str) -> str:
    """A gold answer as bare content: the last boxed of ``gold`` if it has one, else ``gold``."""
    gold = str(gold).strip()
    boxed = last_boxed_only_string(gold)
    if boxed is not None:
        return remove_boxed(boxed)
    if len(gold) >= 2 and gold[0] == gold[-1] == "$":
        gold = gold.strip("$")
    return gold


_NORM_SUBS = [
    (re.compile(r"\\left(?![A-Za-z])|\\right(?![A-Za-z])"), ""),
    (re.compile(r"\\[dt]frac(?![A-Za-z])"), r"\\frac"),
    (re.compile(r"\\[!,;:]|\\ |~"), ""),
    (re.compile(r"\s+"), ""),
    (re.compile(r"\$"), ""),
]


def normalize_answer(s: str) -> str:
    """Light, meaning-preserving normalisation for the exact-match fast path."""
    for pattern, repl in _NORM_SUBS:
        s = pattern.sub(repl, s)
    return s.rstrip(".")


def _brace_depth(s: str) -> int:
    depth = best = 0
    for ch in s:
        if ch == "{":
            depth += 1
            best = max(best, depth)
        elif ch == "}":
            depth -= 1
    return best


def _too_risky(answer: str) -> bool:
    """Answers no benchmark has and the LaTeX parser may choke on: score 0 unparsed."""
    return len(answer) > MAX_ANSWER_CHARS or _brace_depth(answer) > MAX_BRACE_DEPTH


def _quick_score(answer: str | None, gold: str, fast_path: bool = True) -> float | None:
    """The score when it is decided without math-verify (no answer, exact match, too risky)."""
    if answer is None:
        return 0.0
    if fast_path and gold.strip() and normalize_answer(answer) == normalize_answer(gold):
        return 1.0
    if _too_risky(answer) or _too_risky(gold):
        return 0.0
    return None


# --------------------------------------------------------------------------- grading (signals)


class GradingTimeout(BaseException):
    """Raised by our SIGALRM handler (a BaseException, so ``except Exception`` won't eat it)."""


def _raise_timeout(signum, frame):
    raise GradingTimeout()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _deadline:
    """Context manager: raise ``GradingTimeout`` after ``seconds`` (main thread only).

    Restores a pre-existing SIGALRM handler/timer (e.g. pytest-timeout's) on exit.
    """

    def __init__(self, seconds: float):
        self.seconds = max(float(seconds), 1e-3)  # 0 would disable the timer

    def __enter__(self):
        self._start = time.monotonic()
        self._old_handler = signal.signal(signal.SIGALRM, _raise_timeout)
        self._old_timer = signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        except GradingTimeout:  # fired just now: the one-shot timer is spent, disarm anyway
            signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._old_handler)
        old_delay, old_interval = self._old_timer
        if old_delay > 0:
            left = old_delay - (time.monotonic() - self._start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), old_interval)
        return False


@functools.lru_cache(maxsize=1)
def _math_verify():
    """Import math-verify once, with its own (conflicting) timeout warnings silenced."""
    import math_verify
    import math_verify.grader
    import math_verify.parser

    # We pass parsing_timeout=None / timeout_seconds=None on purpose (our timer covers the
    # call); math-verify would log "Timeout is disabled" once per process otherwise.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    config = [math_verify.LatexExtractionConfig(boxed_match_priority=0), math_verify.ExprExtractionConfig()]
    return math_verify, config


def _parse(content: str) -> list:
    """math-verify parse of ``\\boxed{content}`` (answers and golds go through the same call)."""
    mv, config = _math_verify()
    return mv.parse("\\boxed{" + content + "}", extraction_config=config, parsing_timeout=None)


@functools.lru_cache(maxsize=4096)
def _parse_gold(content: str) -> tuple:
    """Gold parses are cached: a group's G samples share one gold (timeouts are not cached)."""
    return tuple(_parse(content))


def _verify(gold_content: str, answer_content: str) -> bool:
    mv, _ = _math_verify()
    gold = list(_parse_gold(gold_content))
    pred = _parse(answer_content)
    if not gold or not pred:
        return False
    return bool(mv.verify(gold, pred, timeout_seconds=None))


def compute_score(
    solution_str: str,
    ground_truth: str,
    timeout_s: float = 5.0,
    think_end_token: str | None = "</think>",
    fast_path: bool = True,
) -> float:
    """verl-style ``compute_score``: 1.0 if the response's final answer equals the gold, else 0.0.

    Runs in the calling thread; bounded by a SIGALRM timer when that is the main thread. From
    another thread it runs unbounded, so callers there should use ``MathVerifyReward``, which
    sends such calls to worker processes.
    """
    answer = extract_answer(solution_str, think_end_token)
    gold = gold_answer(ground_truth)
    quick = _quick_score(answer, gold, fast_path)
    if quick is not None:
        return quick
    if not _in_main_thread():
        return _safe_verify(gold, answer)
    try:
        with _deadline(timeout_s):
            return _safe_verify(gold, answer)
    except GradingTimeout:
        return 0.0


def _safe_verify(gold: str, answer: str) -> float:
    try:
        return float(_verify(gold, answer))
    except (Exception, RecursionError):  # noqa: BLE001 - malformed LaTeX must score 0, not crash
        logger.debug("grading failed", exc_info=True)
        return 0.0


# --------------------------------------------------------------------------- process pool


def _worker_setup(memory_limit_mb: int | None) -> None:
    """Worker hygiene: ignore Ctrl-C (the parent owns it), die with the parent, cap memory."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # Linux: SIGKILL us when the parent dies (PR_SET_PDEATHSIG = 1)
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if memory_limit_mb:
        try:
            import resource

            limit = memory_limit_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        except (ImportError, ValueError, OSError):
            pass


def _worker_main(read_fd: int, write_fd: int) -> None:
    """Worker process entry point (``python -c``; see ``_Worker``).

    Protocol over two pipes: first ``(grade_kwargs, memory_limit_mb)``, answered by ``"ready"``;
    then ``(idx, text, gold)`` answered by ``(idx, score)``; ``None`` stops the worker.
    """
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    grade_kwargs, memory_limit_mb = inbox.recv()
    _worker_setup(memory_limit_mb)
    _math_verify()
    outbox.send("ready")
    while True:
        try:
            msg = inbox.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, text, gold = msg
        try:
            score = compute_score(text, gold, **grade_kwargs)
        except MemoryError:
            score = 0.0
        outbox.send((idx, score))


def _package_root() -> str:
    """The folder holding the ``aspo_lit`` package (put on the worker's PYTHONPATH)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Worker:
    """One grading subprocess.

    A plain ``subprocess`` running ``python -c`` rather than ``multiprocessing``: it never
    re-imports the caller's ``__main__`` (scripts without an ``if __name__ == "__main__"`` guard
    keep working), inherits no CUDA or thread state, and can be SIGKILLed at any moment.
    """

    def __init__(self, grade_kwargs: dict, memory_limit_mb: int | None):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
        code = f"from {__name__} import _worker_main; _worker_main({to_child_r}, {from_child_w})"
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(to_child_r, from_child_w),
                                         env=env, stdin=subprocess.DEVNULL)
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.outbox = Connection(to_child_w, readable=False)
        self.conn = Connection(from_child_r, writable=False)  # what the pool waits on
        self.outbox.send((grade_kwargs, memory_limit_mb))

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the worker has imported math-verify."""
        try:
            ok = self.conn.poll(timeout_s) and self.conn.recv() == "ready"
        except (EOFError, OSError):
            ok = False
        if not ok:
            self.kill()
            raise RuntimeError(f"reward worker did not start within {timeout_s:.0f} s "
                               f"(exit code {self.proc.returncode})")

    def send(self, msg) -> None:
        self.outbox.send(msg)

    def kill(self) -> None:
        """Hard stop (SIGKILL) and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()
        self.outbox.close()

    def stop(self) -> None:
        """Polite stop, then kill."""
        try:
            self.outbox.send(None)
            self.proc.wait(timeout=2)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        self.kill()


class _GraderPool:
    """Bounded pool of grading processes with a hard per-item deadline."""

    def __init__(self, num_workers: int, hard_timeout_s: float, grade_kwargs: dict,
                 memory_limit_mb: int | None = 4096, start_timeout_s: float = 120.0):
        self.num_workers = max(1, num_workers)
        self.hard_timeout_s = hard_timeout_s
        self.grade_kwargs = grade_kwargs
        self.memory_limit_mb = memory_limit_mb
        self.start_timeout_s = start_timeout_s
        self.num_killed = 0
        self._workers: list[_Worker] = []

    def _new_workers(self, n: int) -> list[_Worker]:
        """Start ``n`` workers in parallel and wait until they are ready."""
        workers = [_Worker(self.grade_kwargs, self.memory_limit_mb) for _ in range(n)]
        for w in workers:
            w.wait_ready(self.start_timeout_s)
        return workers

    def map(self, items: Sequence[tuple[str, str]]) -> list[float]:
        """Grade ``(text, gold)`` pairs; an item past the hard deadline (or crashing) scores 0."""
        try:
            return self._map(items)
        except BaseException:  # e.g. Ctrl-C: busy workers would answer the next call; drop them
            self.close(kill=True)
            raise

    def _map(self, items: Sequence[tuple[str, str]]) -> list[float]:
        results = [0.0] * len(items)
        pending = deque(enumerate(items))
        self._workers += self._new_workers(min(self.num_workers, len(items)) - len(self._workers))
        idle = list(self._workers)
        busy: dict[Any, tuple[_Worker, int, float]] = {}  # conn -> (worker, idx, deadline)
        while pending or busy:
            while idle and pending:
                w = idle.pop()
                idx, (text, gold) = pending.popleft()
                w.send((idx, text, gold))
                busy[w.conn] = (w, idx, time.monotonic() + self.hard_timeout_s)
            wait_s = max(0.0, min(d for _, _, d in busy.values()) - time.monotonic())
            for conn in _mp_wait(list(busy), timeout=wait_s):
                w, idx, _ = busy.pop(conn)
                try:
                    _, results[idx] = conn.recv()
                    idle.append(w)
                except (EOFError, OSError):  # the worker died (e.g. memory limit)
                    idle.append(self._replace(w))
            now = time.monotonic()
            for conn, (w, idx, deadline) in list(busy.items()):
                if now > deadline:
                    del busy[conn]
                    logger.warning("reward worker exceeded %.1f s; killed, item %d scores 0",
                                   self.hard_timeout_s, idx)
                    idle.append(self._replace(w))
        return results

    def _replace(self, w: _Worker) -> _Worker:
        self.num_killed += 1
        w.kill()
        (new,) = self._new_workers(1)
        self._workers[self._workers.index(w)] = new
        return new

    def close(self, kill: bool = False) -> None:
        """Stop all workers (``kill``: SIGKILL at once)."""
        workers, self._workers = self._workers, []
        for w in workers:
            w.kill() if kill else w.stop()


# --------------------------------------------------------------------------- reward


class MathVerifyReward:
    """0/1 math correctness reward with math-verify, bounded in time (see module docstring).

    Args:
        timeout_s: time bound for one grading (gold parse + answer parse + comparison).
        num_workers: grading processes for ``batch`` and non-main-thread calls
            (default ``min(8, cpu_count)``); 0 grades ``batch`` sequentially in the main thread.
        think_end_token: grade only the text after the last occurrence of this token, when
            present (None: grade the whole text).
        format_reward: if True, a response without ``think_end_token`` or without a final
            ``\\boxed{}`` scores ``format_error_score`` instead of 0.
        format_error_score: see ``format_reward``.
        overlong_buffer: DAPO soft overlong penalty (an ``OverlongBuffer`` or a dict of its
            fields); added when the caller passes ``response_length(s)`` (tokens).
        fast_path: exact match after normalisation scores 1 without math-verify.
        hard_timeout_s: per-item deadline in a worker before it is killed
            (default ``1.5 * timeout_s + 2``).
        worker_memory_limit_mb: address-space limit of each worker (None: no limit).
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        num_workers: int | None = None,
        think_end_token: str | None = "</think>",
        format_reward: bool = False,
        format_error_score: float = -1.0,
        overlong_buffer: OverlongBuffer | Mapping[str, Any] | None = None,
        fast_path: bool = True,
        hard_timeout_s: float | None = None,
        worker_memory_limit_mb: int | None = 4096,
    ):
        self.timeout_s = float(timeout_s)
        self.num_workers = min(8, os.cpu_count() or 1) if num_workers is None else int(num_workers)
        self.think_end_token = think_end_token
        self.format_reward = format_reward
        self.format_error_score = float(format_error_score)
        if isinstance(overlong_buffer, Mapping):
            overlong_buffer = OverlongBuffer(**overlong_buffer)
        self.overlong_buffer = overlong_buffer
        self.fast_path = fast_path
        self.hard_timeout_s = 1.5 * self.timeout_s + 2.0 if hard_timeout_s is None else float(hard_timeout_s)
        self.worker_memory_limit_mb = worker_memory_limit_mb
        self._pool: _GraderPool | None = None
        self._lock = threading.Lock()

    # -- pickling: the pool and lock stay behind
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_pool"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def close(self) -> None:
        """Stop the worker processes (they restart on the next pooled call)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    @property
    def grade_kwargs(self) -> dict:
        return dict(timeout_s=self.timeout_s, think_end_token=self.think_end_token, fast_path=self.fast_path)

    # -- scoring
    def __call__(self, response_text: str, gold: str, response_length: int | None = None) -> float:
        """Score one response; bounded in time from any thread (other threads use a worker)."""
        if _in_main_thread():
            score = compute_score(response_text, gold, **self.grade_kwargs)
        else:
            answer = extract_answer(response_text, self.think_end_token)
            score = _quick_score(answer, gold_answer(gold), self.fast_path)
            if score is None:
                score = self._grade_in_processes([(response_text, gold)])[0]
        return self._finalize(response_text, score, response_length)

    def batch(
        self, texts: Sequence[str], golds: Sequence[str], response_lengths: Sequence[int] | None = None
    ) -> list[float]:
        """Score ``texts[i]`` against ``golds[i]`` in parallel worker processes."""
        if len(texts) != len(golds):
            raise ValueError(f"{len(texts)} texts but {len(golds)} golds")
        scores: list[float | None] = [
            _quick_score(extract_answer(t, self.think_end_token), gold_answer(g), self.fast_path)
            for t, g in zip(texts, golds)
        ]
        todo = [i for i, s in enumerate(scores) if s is None]
        if todo:
            if self.num_workers == 0 and _in_main_thread():
                graded = [compute_score(texts[i], golds[i], **self.grade_kwargs) for i in todo]
            else:
                graded = self._grade_in_processes([(texts[i], golds[i]) for i in todo])
            for i, s in zip(todo, graded):
                scores[i] = s
        lengths = response_lengths if response_lengths is not None else [None] * len(texts)
        return [self._finalize(t, s, n) for t, s, n in zip(texts, scores, lengths)]

    def _grade_in_processes(self, items: list[tuple[str, str]]) -> list[float]:
        with self._lock:
            if self._pool is None:
                self._pool = _GraderPool(max(1, self.num_workers), self.hard_timeout_s,
                                         self.grade_kwargs, self.worker_memory_limit_mb)
            return self._pool.map(items)

    def _finalize(self, text: str, score: float, response_length: int | None) -> float:
        """Apply the optional format check and overlong penalty."""
        if self.format_reward and not self._well_formed(text):
            score = self.format_error_score
        if self.overlong_buffer is not None and response_length is not None:
            ob = self.overlong_buffer
            score += overlong_penalty(response_length, ob.max_response_length, ob.buffer_length,
                                      ob.penalty_factor)
        return float(score)

    def _well_formed(self, text: str) -> bool:
        if self.think_end_token and self.think_end_token not in text:
            return False
        return extract_answer(text, self.think_end_token) is not None

    def __repr__(self) -> str:
        return (f"MathVerifyReward(timeout_s={self.timeout_s}, num_workers={self.num_workers}, "
                f"think_end_token={self.think_end_token!r}, format_reward={self.format_reward}, "
                f"overlong_buffer={self.overlong_buffer})")
