"""Torch CPU threads per rank: a host's cores divided among the ranks it runs.

Each rank's torch starts one intra-op thread per physical core of the machine, whatever the
number of ranks beside it: N ranks on a host run N times its cores, and their OpenMP threads
spin against each other (on CPU the matrix products themselves; on GPU nodes tokenisation,
grading and the CPU sampling paths). docs/performance.md measured the cost of threads beyond the
cores: on a loaded 2-core machine a demo rollout batch took 11 s with one thread per process and
69 s with two. torchrun sets ``OMP_NUM_THREADS=1`` for its ranks; Lightning's launchers give each
rank the host's logical CPUs divided by the ranks, hyper-threads counted as cores. `FSDP2Strategy`
sets each rank to its share of the physical cores this process may run on (`threads_per_rank`),
unless the user has set ``OMP_NUM_THREADS`` (or ``MKL_NUM_THREADS``, which torch also reads):
that is kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: the variables torch reads for its thread count at start-up (a user's setting of either is kept)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

_set_here: str | None = None  # the OMP_NUM_THREADS `set_threads_per_rank` wrote in this process: not the user's


def threads_per_rank(cores: int, local_world_size: int, env: Mapping[str, str]) -> int | None:
    """Torch threads for each of ``local_world_size`` ranks sharing ``cores``: ``max(1, cores //
    local_world_size)``; None when ``env`` sets a thread count (`THREAD_VARIABLES`), which is then
    the user's to keep."""
    if any(env.get(name, "").strip() for name in THREAD_VARIABLES):
        return None
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    return max(1, cores // local_world_size)


def usable_cores() -> int:
    """Physical cores this process may run on: the CPUs of its affinity mask (a cgroup cpuset,
    ``taskset``), hyper-thread siblings counted once, as torch counts its default threads."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores.add(siblings.read_text().strip())
        except OSError:  # no sysfs topology (not Linux, some containers): each CPU a core
            cores.add(f"cpu{cpu}")
    return max(1, len(cores))


def user_thread_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `THREAD_VARIABLES` set in ``env`` (default: this process's environment), to read
    before a launcher sets its own; the value `set_threads_per_rank` wrote (a fit before, in this
    process) is not the user's."""
    env = os.environ if env is None else env
    settings = {name: env[name] for name in THREAD_VARIABLES if name in env}
    if _set_here is not None and settings.get("OMP_NUM_THREADS") == _set_here:
        del settings["OMP_NUM_THREADS"]
    return settings


def set_threads_per_rank(local_world_size: int, user_settings: Mapping[str, str], cores: int | None = None) -> str:
    """Set torch's intra-op threads (and ``OMP_NUM_THREADS``, for the processes this rank starts) to
    `threads_per_rank` of `usable_cores`; a user's `user_settings` leave them as they are. Returns
    the line to log."""
    import torch

    cores = usable_cores() if cores is None else cores
    threads = threads_per_rank(cores, local_world_size, user_settings)
    if threads is None:
        given = ", ".join(f"{k}={v}" for k, v in user_settings.items())
        return f"aspo-lit: {given} set: torch keeps {torch.get_num_threads()} threads per rank"
    global _set_here
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = _set_here = str(threads)
    return (f"aspo-lit: {threads} torch threads per rank ({cores} cores / {local_world_size} ranks on this host; "
            "set OMP_NUM_THREADS to choose)")
