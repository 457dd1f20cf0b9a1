"""A rollout engine in its own process: the generating half of bounded-staleness rollouts
(``data.max_staleness``; docs/staleness.md).

The child process builds nothing of its own: it gets the parent's engine object *before*
``attach`` (an ``HFEngine`` or ``VLLMEngine`` with its settings), attaches it to its own copy of
the model (``attach(None, None, model_path)``: the transformers engine loads the checkpoint, vLLM
starts from it, in the child itself: ``in_process``, TP 1), and serves one queue **in order**:

- ``("weights", version, state)``: ``engine.update_weights(state)``; requests after it are
  generated with these weights, and their results say ``version``;
- ``("generate", ticket, prompts, n, sampling)``: the completions go back with the version that
  produced them, the seconds of generation, and the seconds the engine sat idle before the request
  (waiting for the trainer: for work, or for the weights that precede it);
- ``("close",)``.

One queue, read in order, is what makes the staleness schedule exact: a request sent after a push
is generated with exactly that push's weights, however fast either side runs. The child ignores
SIGINT (Ctrl-C reaches the whole process group; the trainer finishes its batch, saves a checkpoint
and closes the child) but not SIGTERM: Python's exit terminates daemon children with SIGTERM and
then joins them, so a child deaf to it would hang the trainer's exit; a SIGTERM that reaches the
child first is a dead engine to the trainer, which saves a checkpoint all the same. It is a daemon,
so it never outlives the trainer. A child that
dies (killed, out of memory) or raises is reported as :class:`EngineProcessError` with its exit
code or traceback at the next :meth:`EngineProcess.result`; nothing waits forever.
"""

from __future__ import annotations

import os
import queue
import signal
import time
import traceback
from collections.abc import Iterable
from typing import Any

import torch

from aspo_lit.rollout.base import Completion, RolloutEngine, SamplingConfig, iter_named_tensors

__all__ = ["EngineProcess", "EngineProcessError"]

#: seconds between checks that the child is alive while a result is awaited
POLL_S = 0.5


class EngineProcessError(RuntimeError):
    """The rollout engine's process died or raised; the message says which and how."""


def _serve(engine: RolloutEngine, model_path: str, threads: int, requests, results) -> None:
    """The child's loop (module level: spawn pickles it by name)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    if getattr(engine, "in_process", None) is False:
        # vLLM's default engine starts a process of its own, which a daemon may not have: this
        # process *is* the engine's, so vLLM runs in it (its TP > 1 needs that process: refused)
        if getattr(engine, "tensor_parallel_size", 1) > 1:
            results.put(("error", None, "the engine process runs vLLM in itself: tensor_parallel_size > 1 is not "
                                        "supported with data.max_staleness >= 1 (docs/staleness.md)"))
            return
        engine.in_process = True
    try:
        engine.attach(None, None, model_path)
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        results.put(("error", None, traceback.format_exc()))
        return
    results.put(("ready", os.getpid(), None))
    version, idle_s = -1, 0.0   # idle: waiting on the queue since the last result (for work or weights)
    while True:
        idle_start = time.perf_counter()
        message = requests.get()
        idle_s += time.perf_counter() - idle_start
        kind = message[0]
        if kind == "close":
            break
        try:
            if kind == "weights":
                _, version, state = message
                engine.update_weights(state)
                del state
            elif kind == "generate":
                _, ticket, prompts, n, sampling = message
                start = time.perf_counter()
                completions = engine.generate(prompts, n=n, sampling=sampling)
                results.put(("result", ticket, (version, completions, time.perf_counter() - start, idle_s)))
                idle_s = 0.0
        except Exception:  # noqa: BLE001
            results.put(("error", message[1] if kind == "generate" else None, traceback.format_exc()))
            break
    engine.close()


class EngineProcess:
    """Runs ``engine`` (not yet attached) in a spawned process on ``model_path``'s weights.

    ``push(version, named_tensors)`` sends full CPU copies of the weights (in ``dtype`` when given:
    the engine's), ``submit(ticket, ...)`` queues a generation behind everything sent before it,
    ``result(ticket)`` waits for it (results may be awaited in any order). ``threads``: the
    child's torch threads."""

    def __init__(self, engine: RolloutEngine, model_path: str, threads: int = 1, start_timeout_s: float = 600.0) -> None:
        self.engine, self.model_path, self.threads = engine, str(model_path), int(threads)
        self.start_timeout_s = start_timeout_s
        self._ctx = torch.multiprocessing.get_context("spawn")
        self._requests = self._ctx.Queue()
        self._results = self._ctx.Queue()
        self._done: dict[int, tuple] = {}
        self.process: Any = None

    def start(self) -> "EngineProcess":
        self.process = self._ctx.Process(target=_serve, daemon=True, name="aspo-lit-rollout",
                                         args=(self.engine, self.model_path, self.threads, self._requests, self._results))
        self.process.start()
        kind, _, detail = self._next(deadline=time.monotonic() + self.start_timeout_s, waiting_for="its start")
        if kind != "ready":
            raise EngineProcessError(f"the rollout engine process failed to start:\n{detail}")
        return self

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def push(self, version: int, named_tensors: Iterable, dtype: torch.dtype | None = None) -> None:
        """Queue the weights of policy ``version`` (every floating tensor in ``dtype``, if given)."""
        state = {name: t.to("cpu", copy=True) for name, t in iter_named_tensors(named_tensors, dtype)}
        self._requests.put(("weights", int(version), state))

    def submit(self, ticket: int, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> None:
        self._requests.put(("generate", int(ticket), prompts, int(n), sampling))

    def _next(self, deadline: float | None, waiting_for: str) -> tuple:
        while True:
            try:
                return self._results.get(timeout=POLL_S)
            except queue.Empty:
                pass
            if self.process is None or not self.process.is_alive():
                code = None if self.process is None else self.process.exitcode
                why = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
                raise EngineProcessError(f"the rollout engine process (pid {self.pid}) {why} while the trainer "
                                         f"waited for {waiting_for}")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineProcessError(f"the rollout engine process (pid {self.pid}) did not answer within "
                                         f"{self.start_timeout_s:.0f} s while the trainer waited for {waiting_for}")

    def result(self, ticket: int) -> tuple[int, list[list[Completion]], float, float, float]:
        """``(version, completions, generate_s, engine_idle_s, wait_s)`` of request ``ticket``;
        ``wait_s``: the seconds this call blocked."""
        start = time.perf_counter()
        while ticket not in self._done:
            kind, got, payload = self._next(deadline=None, waiting_for=f"rollout batch {ticket}")
            if kind == "error":
                raise EngineProcessError(f"the rollout engine process raised while generating rollout batch {got}:\n{payload}")
            self._done[got] = payload
        version, completions, generate_s, idle_s = self._done.pop(ticket)
        return version, completions, generate_s, idle_s, time.perf_counter() - start

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the child to stop, then make sure it has (terminate, then kill)."""
        if self.process is None:
            return
        if self.process.is_alive():
            try:
                self._requests.put(("close",))
            except (ValueError, OSError):  # pragma: no cover - queue already closed
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        for q in (self._requests, self._results):
            q.cancel_join_thread()
            q.close()
        self.process = None
