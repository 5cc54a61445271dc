"""Where a rank runs on this host: its share of the CPU cores, or its CUDA devices.

A tensor-parallel worker (``worker.executor``) and a data-parallel engine
core (``runner.build_engine``) both call these first, before the model is
built, so each rank computes on its own cores or devices.
"""

from __future__ import annotations

import os


def cpu_share(rank: int, world_size: int, cores: list[int]) -> list[int]:
    """The cores rank ``rank`` runs on: its own contiguous run of ``cores``
    when there are at least as many as ranks (the remainder to the first
    ranks), else all of them (the ranks share, one thread each)."""
    if len(cores) < world_size:
        return cores
    base, extra = divmod(len(cores), world_size)
    start = rank * base + min(rank, extra)
    return cores[start : start + base + (rank < extra)]


def pin_cpu_rank(rank: int, world_size: int) -> list[int]:
    """Pin this process to rank ``rank``'s share of the cores it may run on
    and give torch as many threads (one when the ranks share the cores).
    Returns the cores."""
    import torch

    allowed = sorted(os.sched_getaffinity(0))
    cores = cpu_share(rank, world_size, allowed)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores) if len(allowed) >= world_size else 1)
    return cores


def cuda_devices(rank: int, per_rank: int) -> str:
    """Keep only rank ``rank``'s ``per_rank`` CUDA devices visible to this
    process (of those already visible: ``CUDA_VISIBLE_DEVICES``, else all).
    Must run before CUDA is initialized. Returns the new value."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]  # counts without initializing CUDA
    else:
        ids = [d for d in visible.split(",") if d.strip()]
    mine = ids[rank * per_rank : (rank + 1) * per_rank]
    if len(mine) < per_rank:
        raise RuntimeError(f"data-parallel rank {rank} needs CUDA devices {rank * per_rank}.."
                           f"{(rank + 1) * per_rank - 1} but only {len(ids)} are visible")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    return os.environ["CUDA_VISIBLE_DEVICES"]
