"""An engine core's ranks as its executor starts them, and how a rank joins them.

``RankGroup`` is everything an executor (``executor.MultiprocExecutor``,
``ray_executor.RayExecutor``) reads of the deployment: the device kind,
the tensor x pipeline split, the collectives wanted on CPUs, the Ray
cluster, the step timeout, the data-parallel cores that share experts,
and the composition root's function that builds a rank's model runner
(``build_rank(rank, RankCollectives)``, pickled to each rank's process).
``init_rank`` makes a process that rank: its share of the host, its
collectives (shared-memory segments between one CPU host's ranks, else
torch.distributed: gloo on CPUs, NCCL on CUDA), then its runner.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from appliance.worker.placement import pin_cpu_rank

log = logging.getLogger("appliance.executor")


@dataclass(frozen=True)
class CoreGroup:
    """Data-parallel engine cores that split the experts between them, their
    ranks in worker processes: how many cores (``size``), which this one is
    (``rank``), and where their ranks meet (``rank_addresses``: one
    shared-memory segment per stage and tensor-parallel index, or one
    ``tcp://`` address for a torch.distributed world of every core's
    ranks)."""

    size: int
    rank: int
    rank_addresses: tuple[str, ...]


@dataclass(frozen=True)
class RankGroup:
    """An engine core's ranks (see the module docstring). ``build_rank`` is
    module-level or a ``functools.partial`` of one: it travels pickled."""

    device: str  # "cpu" or "cuda"
    tensor_parallel_size: int
    pipeline_parallel_size: int
    build_rank: Callable[[int, "RankCollectives"], Any]
    step_timeout_s: float
    cpu_collectives: str = "shm"  # "shm" or "gloo" (parallel.cpu_collectives)
    ray_address: Optional[str] = None  # parallel.ray_address
    cores: Optional[CoreGroup] = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def collectives(self) -> str:
        """How this group's ranks exchange (``collectives``)."""
        return collectives(self.device, self.cpu_collectives, self.world_size)


class TorchDistributedComm:
    """The collectives a model runs, over a ``torch.distributed`` process
    group (``group``; None: every rank) whose backend moves tensors on
    ``device`` (``cuda`` for NCCL, ``cpu`` for gloo). ``broadcast`` names its
    source by its rank in the whole world."""

    def __init__(self, world_size: int, group: Any = None, device: str = "cpu"):
        self.world_size, self.group, self.device = world_size, group, device

    def _here(self, t: Any) -> Any:
        """``t`` on the group's device (NCCL moves only GPU tensors: a host flag, counter or count list
        goes there and its result comes back)."""
        return t if t.device.type == self.device else t.to(self.device)

    def all_reduce(self, t: Any) -> None:
        """In place, wherever ``t`` is."""
        import torch.distributed as dist

        staged = self._here(t)
        dist.all_reduce(staged, group=self.group)
        if staged is not t:
            t.copy_(staged)

    def all_gather(self, t: Any) -> list:
        """Every rank's ``t``, in rank order, where ``t`` is."""
        import torch
        import torch.distributed as dist

        staged = self._here(t.contiguous())
        out = [torch.empty_like(staged) for _ in range(self.world_size)]
        dist.all_gather(out, staged, group=self.group)
        return out if staged.device == t.device else [o.to(t.device) for o in out]

    def broadcast(self, t: Any, src: int) -> None:
        """In place, wherever ``t`` is."""
        import torch.distributed as dist

        staged = self._here(t)
        dist.broadcast(staged, src, group=self.group)
        if staged is not t:
            t.copy_(staged)

    has_all_to_all = True

    def all_to_all(self, t: Any, send_counts: list[int], recv_counts: Optional[list[int]] = None) -> tuple:
        """Rows ``t`` (in rank order, ``send_counts[r]`` of them to rank r) to
        their ranks: (the rows this rank received, in rank order, and how
        many from each; ``recv_counts`` when already known), where ``t`` is."""
        import torch
        import torch.distributed as dist

        rows = self._here(t.contiguous())
        if recv_counts is None:
            sent = torch.tensor(send_counts, dtype=torch.int64, device=rows.device)
            got = torch.empty_like(sent)
            dist.all_to_all_single(got, sent, group=self.group)
            recv_counts = got.tolist()
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        dist.all_to_all_single(out, rows, recv_counts, send_counts, group=self.group)
        return out.to(t.device), recv_counts


@dataclass(frozen=True)
class RankCollectives:
    """What a rank's model exchanges over: ``tp`` among its pipeline stage's
    tensor-parallel ranks (None: one); ``receive`` (the stage before's rows)
    and ``send`` (its rows to the next stage, its first rank only), each a
    (comm, source rank as the comm numbers it) pair whose broadcast spans
    the sending stage's first rank and the receiving stage's ranks (None:
    no such hand-off); ``experts``, with expert parallelism across
    data-parallel engine cores, this rank's peers of its tensor-parallel
    index in every core (rank = core)."""

    tp: Any = None
    receive: Optional[tuple[Any, int]] = None
    send: Optional[tuple[Any, int]] = None
    experts: Any = None


def rank_position(rank: int, tp_size: int) -> tuple[int, int]:
    """(pipeline stage, tensor-parallel rank) of world rank ``rank``: a stage's
    tensor-parallel ranks are consecutive, as vLLM numbers them."""
    return divmod(rank, tp_size)


def link_ranks(stage: int, tp_size: int) -> list[int]:
    """The world ranks of the hand-off from ``stage`` to the next: the
    stage's first rank, then the next stage's ranks."""
    return [stage * tp_size, *range((stage + 1) * tp_size, (stage + 2) * tp_size)]


def create_segments(tp_size: int, pp_size: int) -> dict[str, str]:
    """The shared-memory segments a layout's collectives need: one per stage
    for its tensor-parallel ranks (``tp<stage>``), one per hand-off between
    stages (``link<stage>``: that stage's first rank and the next stage's
    ranks)."""
    from appliance.kernels.shm_comm import create_segment

    out = {f"tp{stage}": create_segment(tp_size) for stage in range(pp_size)} if tp_size > 1 else {}
    out.update({f"link{stage}": create_segment(tp_size + 1) for stage in range(pp_size - 1)})
    return out


def unlink_segments(segments: Optional[dict[str, str]]) -> None:
    for path in (segments or {}).values():
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(group: RankGroup, rank: int, init_method: str, segments: Optional[dict[str, str]],
              local_rank: Optional[int] = None, local_world_size: Optional[int] = None) -> Any:
    """Make this process ``group``'s rank ``rank``: take its cores (CPUs: its
    share of this host's, by ``local_rank`` of ``local_world_size`` ranks
    here) or its GPU, join the collectives (the shared-memory ``segments``
    of ``create_segments``, else torch.distributed at ``init_method``: gloo
    on CPUs, NCCL on CUDA, a group per pipeline stage and per hand-off
    between stages), then build its model runner with its
    ``RankCollectives``."""
    import torch

    local_rank = rank if local_rank is None else local_rank
    local_world_size = group.world_size if local_world_size is None else local_world_size
    if group.device == "cpu":
        pin_cpu_rank(local_rank, local_world_size)
        backend = "gloo"
    else:
        torch.cuda.set_device(local_rank if torch.cuda.device_count() > 1 else 0)
        backend = "nccl"
    tp, pp, timeout_s, cores = group.tensor_parallel_size, group.pipeline_parallel_size, group.step_timeout_s, \
        group.cores
    stage, tp_rank = rank_position(rank, tp)
    sends = stage < pp - 1 and tp_rank == 0
    if cores is not None and cores.rank_addresses[0].startswith("tcp://"):  # one world of every core's ranks
        comms = _torch_comms(backend, cores.rank_addresses[0], tp, pp, stage, tp_rank, timeout_s,
                             (cores.size, cores.rank))
    elif segments is not None or (cores is not None and tp * pp == 1):  # one rank: no segments of its core
        from appliance.kernels.shm_comm import ShmComm

        segs = segments or {}  # none only for one rank alone, which needs none

        def link(s: int, member: int) -> tuple[Any, int]:
            return ShmComm(segs[f"link{s}"], member, tp + 1, timeout_s), 0

        comms = RankCollectives(tp=ShmComm(segs[f"tp{stage}"], tp_rank, tp, timeout_s) if tp > 1 else None,
                                receive=link(stage - 1, 1 + tp_rank) if stage > 0 else None,
                                send=link(stage, 0) if sends else None)
        if cores is not None:  # this rank's peers in the other cores: a segment per stage and tensor-parallel index
            comms = replace(comms, experts=ShmComm(cores.rank_addresses[stage * tp + tp_rank], cores.rank,
                                                   cores.size, timeout_s))
    elif cores is not None:
        raise RuntimeError("the cores' ranks meet over shared memory but this core's ranks do not")
    else:
        comms = _torch_comms(backend, init_method, tp, pp, stage, tp_rank, timeout_s)
    return group.build_rank(rank, comms)


def _torch_comms(backend: str, init_method: str, tp: int, pp: int, stage: int, tp_rank: int, timeout_s: float,
                 cores: tuple[int, int] = (1, 0)) -> RankCollectives:
    """A rank's collectives over torch.distributed at ``init_method``: a
    group per pipeline stage's tensor-parallel ranks and per hand-off
    between stages. With ``cores`` (how many data-parallel engine cores,
    which is this rank's) that split the experts, one world of every core's
    ranks (world rank = core x tp x pp + rank in the core), every core's
    groups, and a group per stage and tensor-parallel index across the
    cores (``RankCollectives.experts``)."""
    import datetime

    import torch.distributed as dist

    n, (num_cores, core) = tp * pp, cores
    base = core * n
    dist.init_process_group(backend, init_method=init_method, rank=base + stage * tp + tp_rank,
                            world_size=num_cores * n, timeout=datetime.timedelta(seconds=timeout_s))
    # every rank makes every group, in one order
    if num_cores == 1 and pp == 1:
        stages = [[None]]  # the whole world
    else:
        stages = [[dist.new_group([c * n + s * tp + t for t in range(tp)]) if tp > 1 else None for s in range(pp)]
                  for c in range(num_cores)]
    links = [[dist.new_group([c * n + r for r in link_ranks(s, tp)]) for s in range(pp - 1)] for c in range(num_cores)]
    across = ([[dist.new_group([c * n + s * tp + t for c in range(num_cores)]) for t in range(tp)] for s in range(pp)]
              if num_cores > 1 else None)
    device = "cuda" if backend == "nccl" else "cpu"
    return RankCollectives(
        tp=TorchDistributedComm(tp, stages[core][stage], device) if tp > 1 else None,
        receive=(TorchDistributedComm(tp + 1, links[core][stage - 1], device), base + (stage - 1) * tp)
        if stage > 0 else None,
        send=(TorchDistributedComm(tp + 1, links[core][stage], device), base + stage * tp)
        if stage < pp - 1 and tp_rank == 0 else None,
        experts=TorchDistributedComm(num_cores, across[stage][tp_rank], device) if across is not None else None)


def collectives(device: str, cpu_collectives: str, world_size: int) -> str:
    """How ``world_size`` ranks on ``device`` exchange: ``shm`` (one host's
    CPU ranks with ``cpu_collectives=shm``, where the shared-memory
    collectives build; else gloo with a warning), ``gloo`` or ``nccl``."""
    if device != "cpu":
        return "nccl"
    if cpu_collectives != "shm" or world_size == 1:
        return "gloo"
    try:
        import appliance.kernels.shm_comm  # noqa: F401  (builds the library once, here)
    except ImportError as e:
        log.warning("parallel.cpu_collectives=shm: the shared-memory collectives cannot load (%s); the ranks use "
                    "gloo", e)
        return "gloo"
    return "shm"
