"""Run a test's function on gloo ranks in spawned processes and collect what each rank returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as tmp

from tools.ports import free_port


def _rank_main(rank: int, fn: Callable[[int, int], Any], world_size: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        queue.put((rank, fn(rank, world_size)))
    finally:
        dist.destroy_process_group()


def on_ranks(fn: Callable[[int, int], Any], world_size: int = 2) -> dict[int, Any]:
    """``{rank: fn(rank, world_size)}``, each call in its own spawned process inside one gloo group.
    ``fn`` is a module-level function (the spawned processes import it by name)."""
    queue = tmp.get_context("spawn").SimpleQueue()
    tmp.start_processes(_rank_main, args=(fn, world_size, free_port(), queue), nprocs=world_size, join=True,
                        start_method="spawn")
    return dict(queue.get() for _ in range(world_size))
