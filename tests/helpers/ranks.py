"""Run a test's function on gloo ranks in spawned processes and collect what each rank returns."""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as tmp

from tools.ports import free_port


class RankFailed(RuntimeError):
    """A rank's function raised (its traceback is the message), or a rank exited abnormally."""


class _Raised(str):
    """A rank's traceback, sent through the queue in place of its result."""


def leave_group() -> None:
    """A spawned rank's clean end, after its work succeeded: the ranks leave together (a barrier:
    rank 0 hosts the TCPStore), the group is destroyed, and the process exits at once with status 0,
    without interpreter finalization. Finalization is where gloo's worker threads can still be live
    and abort the process ("terminate called without an active exception", pytorch/pytorch#179291):
    two CI runs in ~30 lost a rank that way after its work was done (docs/ci.md). A failing rank
    raises instead (see `on_ranks`)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_main(rank: int, fn: Callable[[int, int], Any], world_size: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size)
    except BaseException:
        queue.put((rank, _Raised(traceback.format_exc())))   # a SimpleQueue: in the pipe before put returns
        dist.destroy_process_group()
        raise
    queue.put((rank, result))
    leave_group()


def on_ranks(fn: Callable[[int, int], Any], world_size: int = 2, timeout_s: float = 600.0) -> dict[int, Any]:
    """``{rank: fn(rank, world_size)}``, each call in its own spawned process inside one gloo group.
    ``fn`` is a module-level function (the spawned processes import it by name).

    Every rank runs to its own end (a peer's failure ends the others through their sockets), so
    when a rank's ``fn`` raises, `RankFailed` carries that rank's traceback, not the connection
    reset a peer saw first. Past ``timeout_s`` the ranks still alive are killed."""
    queue = tmp.get_context("spawn").SimpleQueue()
    procs = tmp.start_processes(_rank_main, args=(fn, world_size, free_port(), queue), nprocs=world_size,
                                join=False, start_method="spawn").processes
    items: list[tuple[int, Any]] = []
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        while not queue.empty():                  # read as they come: a full pipe would block a writer
            items.append(queue.get())
        time.sleep(0.02)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    while not queue.empty():
        items.append(queue.get())
    raised = {rank: tb for rank, tb in items if isinstance(tb, _Raised)}
    if raised:
        raise RankFailed("".join(f"rank {r} raised:\n{tb}" for r, tb in sorted(raised.items())))
    exits = {rank: p.exitcode for rank, p in enumerate(procs) if p.exitcode != 0}
    if exits:
        raise RankFailed(f"ranks exited abnormally (rank: exit code, negative = signal): {exits}")
    return dict(items)
