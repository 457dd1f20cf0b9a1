"""What the graders that start workers share: workers that belong to one process.

``MathReward`` grades in worker processes, ``CodeReward`` in threads over sandboxed processes;
both start them on first use. A pickled copy of a grader (a spawned DataLoader worker, another
training rank) leaves them and the lock that guards them behind and starts its own; a collected
grader stops its workers without waiting for them.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["ProcessLocalWorkers"]


class ProcessLocalWorkers:
    """Mixin: pickling without the workers, stopping them when collected.

    A subclass names the attributes that hold its workers in ``_process_local`` (a copy gets None
    there) and guards starting them with ``self._lock``; ``close()`` stops them."""

    _process_local: tuple[str, ...] = ()

    def close(self) -> None:
        """Stop the workers (the next call that needs them starts them again)."""
        raise NotImplementedError

    def _stop_without_waiting(self) -> None:
        """``close`` as garbage collection calls it: it must not wait for a worker."""
        self.close()

    def __getstate__(self) -> dict:
        return {**self.__dict__, **dict.fromkeys(self._process_local), "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown, or a constructor that raised
            self._stop_without_waiting()
