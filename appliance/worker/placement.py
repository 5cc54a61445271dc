"""Where a rank runs on this host: its share of the CPU cores, or its CUDA devices.

A tensor-parallel worker (``worker.executor``) and a data-parallel engine
core (``runner.build_engine``) both call these first, before the model is
built, so each rank computes on its own cores or devices.
"""

from __future__ import annotations

import os


NODE_DIR = "/sys/devices/system/node"


def parse_cpulist(text: str) -> list[int]:
    """The cores of a kernel cpulist such as ``0-3,8,10-11``."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def numa_nodes(allowed: list[int], node_dir: str = NODE_DIR) -> list[list[int]]:
    """The allowed cores of each NUMA node that has some, in node order (one
    list of all of them where the host says nothing of its nodes)."""
    try:
        names = sorted((n for n in os.listdir(node_dir) if n.startswith("node") and n[4:].isdigit()),
                       key=lambda n: int(n[4:]))
    except OSError:
        return [allowed]
    mine, nodes = set(allowed), []
    for name in names:
        try:
            with open(os.path.join(node_dir, name, "cpulist")) as f:
                cores = [c for c in parse_cpulist(f.read()) if c in mine]
        except (OSError, ValueError):
            continue
        if cores:
            nodes.append(cores)
    return nodes or [allowed]


def cpu_share(rank: int, world_size: int, cores: list[int], nodes: list[list[int]] | None = None) -> list[int]:
    """The cores rank ``rank`` runs on. With several NUMA ``nodes`` and a
    rank count they divide, each node's ranks split that node's cores (one
    rank per node when the counts match), so a rank's memory stays local.
    Otherwise: its own contiguous run of ``cores`` when there are at least as
    many as ranks (the remainder to the first ranks), else all of them (the
    ranks share, one thread each)."""
    if nodes is not None and len(nodes) > 1 and world_size % len(nodes) == 0:
        per_node = world_size // len(nodes)
        return cpu_share(rank % per_node, per_node, nodes[rank // per_node])
    if len(cores) < world_size:
        return cores
    base, extra = divmod(len(cores), world_size)
    start = rank * base + min(rank, extra)
    return cores[start : start + base + (rank < extra)]


def pin_cpu_rank(rank: int, world_size: int) -> list[int]:
    """Pin this process to rank ``rank``'s share of the cores it may run on
    (NUMA nodes first, see ``cpu_share``) and give torch as many threads
    (one when the ranks share the cores). Returns the cores."""
    import torch

    allowed = sorted(os.sched_getaffinity(0))
    cores = cpu_share(rank, world_size, allowed, numa_nodes(allowed))
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
