"""Run a test's function on gloo ranks in spawned processes and collect what each rank returns."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as tmp

from tools.ports import free_port


def leave_group() -> None:
    """A spawned rank's clean end, after its work succeeded: the ranks leave together (a barrier:
    rank 0 hosts the TCPStore), the group is destroyed, and the process exits at once with status 0,
    without interpreter finalization. Finalization is where gloo's worker threads can still be live
    and abort the process ("terminate called without an active exception", pytorch/pytorch#179291):
    two CI runs in ~30 lost a rank that way after its work was done (docs/ci.md). A failing rank
    raises instead, and `torch.multiprocessing` reports it and stops the others."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_main(rank: int, fn: Callable[[int, int], Any], world_size: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        queue.put((rank, fn(rank, world_size)))   # a SimpleQueue: written to the pipe before put returns
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()


def on_ranks(fn: Callable[[int, int], Any], world_size: int = 2) -> dict[int, Any]:
    """``{rank: fn(rank, world_size)}``, each call in its own spawned process inside one gloo group.
    ``fn`` is a module-level function (the spawned processes import it by name)."""
    queue = tmp.get_context("spawn").SimpleQueue()
    tmp.start_processes(_rank_main, args=(fn, world_size, free_port(), queue), nprocs=world_size, join=True,
                        start_method="spawn")
    return dict(queue.get() for _ in range(world_size))
