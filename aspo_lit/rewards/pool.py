"""Grading in worker processes with a hard per-item deadline, on Pebble's ``ProcessPool``.

Every item is one Pebble task scheduled with ``timeout=hard_timeout_s`` (counted from when a
worker picks it up): a worker past it, e.g. stuck inside C code where no signal lands, is killed
and replaced by Pebble, and the item scores 0; so does an item whose worker died. Each such item is counted
(``GradingPool.num_killed``) and logged as a warning, as is one past the worker's memory limit.

Workers are started with ``spawn``: forking a process that runs torch (threads, CUDA) is unsafe.
As with any ``spawn`` pool, a script run as ``python script.py`` that grades through the pool
must guard its entry point with ``if __name__ == "__main__":`` (``python -m ...`` needs nothing).
Workers ignore Ctrl-C (Pebble; the parent owns it), die with the parent, and have a capped
address space.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Callable, Sequence

import pebble

logger = logging.getLogger(__name__)

__all__ = ["GradingPool"]


def _init_worker(memory_limit_mb: int | None, warmup: Callable[[], Any] | None) -> None:
    """Worker set-up: die at once when stopped or when the parent dies, cap memory, warm up."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Pebble's handler waits for C code to return
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
        except (ImportError, ValueError, OSError):  # no rlimits here, or a lower hard limit
            pass
    if warmup is not None:
        warmup()


class GradingPool:
    """``map(items)``: ``grade(*item)`` for every item, in worker processes, 0.0 past the deadline.

    Args:
        grade: a picklable function returning a float (module-level, or a ``functools.partial``).
        num_workers: worker processes.
        hard_timeout_s: per-item deadline before the worker is killed and the item scores 0.
        memory_limit_mb: address-space limit (``RLIMIT_AS``) of each worker (None: no limit).
        warmup: called once in each new worker before it takes items (slow imports), so that
            it does not count against the deadline.
    """

    def __init__(self, grade: Callable[..., float], num_workers: int, hard_timeout_s: float,
                 memory_limit_mb: int | None = 4096, warmup: Callable[[], Any] | None = None):
        self.grade = grade
        self.num_workers = max(1, num_workers)
        self.hard_timeout_s = hard_timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.warmup = warmup
        self.num_killed = 0
        self._pool: pebble.ProcessPool | None = None

    def map(self, items: Sequence[tuple]) -> list[float]:
        """Grade every item; one past the hard deadline (or whose worker died) scores 0."""
        if self._pool is None or not self._pool.active:  # not started, or broken (a worker died idle)
            self.close()
            self._pool = pebble.ProcessPool(max_workers=self.num_workers, initializer=_init_worker,
                                            initargs=(self.memory_limit_mb, self.warmup),
                                            context=multiprocessing.get_context("spawn"))
        try:
            futures = [self._pool.schedule(self.grade, args=item, timeout=self.hard_timeout_s) for item in items]
            return [self._score(future, idx) for idx, future in enumerate(futures)]
        except BaseException:  # e.g. Ctrl-C: the items left would run ahead of the next call's
            self.close()
            raise

    def _score(self, future: pebble.ProcessFuture, idx: int) -> float:
        try:
            return float(future.result())
        except MemoryError:  # raised inside the worker, which survives it
            logger.warning("reward worker hit its %s MB memory limit; item %d scores 0", self.memory_limit_mb, idx)
            return 0.0
        except FutureTimeoutError:
            logger.warning("reward worker exceeded %.1f s; killed, item %d scores 0", self.hard_timeout_s, idx)
        except pebble.ProcessExpired as err:
            logger.warning("reward worker died (exit code %s); item %d scores 0", err.exitcode, idx)
        self.num_killed += 1
        return 0.0

    def close(self) -> None:
        """Stop the workers at once (the next ``map`` starts new ones)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join()
