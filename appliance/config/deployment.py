"""``Deployment``: everything machine- and config-derived that the running
system needs, decided once by ``appliance.runner.compose``.

The offline ``LLM``, the engine-core process, the HTTP server and
``appliance plan`` all read it; none of them recomputes a dtype, a backend,
a KV block count or a length limit. It is plain data (picklable: the
engine-core process receives it whole).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from appliance.config.compose import ResolvedConfig
from appliance.config.execution import Execution
from appliance.config.plan import Plan
from appliance.config.schema import ApplianceConfig

PROMPT_CHARS_PER_TOKEN = 16  # server.max_prompt_chars=null: this many characters per token of max_model_len


@dataclass(frozen=True)
class ExecutorLayout:
    """How many devices of each kind of parallelism the deployment spans,
    and what runs one engine core's ranks (tensor x pipeline): ``uni`` (the
    model in the engine's process) or ``mp`` (a worker process per rank,
    ``worker.executor``). Each data-parallel rank is an engine core of its
    own, behind one server."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    executor: str = "uni"

    @property
    def experts_across_cores(self) -> bool:
        """Whether the data-parallel engine cores split the experts (and so step in lock-step)."""
        return self.expert_parallel_size > 1 and self.data_parallel_size > 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def ranks_per_engine(self) -> int:
        """Devices (or CPU ranks) one engine core's model spans."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class ExpertGroupAddress:
    """Where data-parallel engine cores that split the experts meet: ``cores``,
    the cores' own group (each core's agreement to step and, with one rank
    per core in its process, its sparse layers' exchanges); with the cores'
    ranks in worker processes (executor ``mp``), ``ranks``, where those
    exchange: a shared-memory segment per rank of a core (stage x tp + tp
    rank: that rank of every core), or one torch.distributed address for
    every core's ranks. A segment is a file
    path, an address ``tcp://host:port``."""

    cores: str
    ranks: tuple[str, ...] = ()

    def files(self) -> list[str]:
        """The segment files among them (the front end unlinks them once mapped)."""
        return [a for a in (self.cores, *self.ranks) if not a.startswith("tcp://")]


@dataclass(frozen=True)
class Deployment:
    resolved: ResolvedConfig
    execution: Execution  # dtype, KV dtype and attention backend, with the reasons
    plan: Plan
    device: str  # torch device type the engine runs on: "cpu" or "cuda" (ROCm included)
    num_kv_blocks: int  # cache.num_blocks, or what the plan's memory budget holds
    max_model_len: int
    max_prompt_chars: int  # prompts longer than this are refused before tokenizing
    layout: ExecutorLayout
    data_parallel_rank: int = 0  # which engine core of ``layout.data_parallel_size`` this one builds
    # Expert parallelism across the data-parallel engine cores: where they and
    # their ranks exchange their sparse layers' tokens, made by the front end
    # for each generation of cores (None otherwise).
    expert_group: Optional[ExpertGroupAddress] = None
    # disaggregated prefill (kv_transfer=p2p): this engine's id, the same on all its ranks (made as it is built)
    kv_engine_id: Optional[str] = None

    @property
    def cfg(self) -> ApplianceConfig:
        return self.resolved.cfg

    @property
    def fingerprint(self) -> str:
        """The config hash plus what this host resolved it to."""
        return self.execution.fingerprint(self.resolved.hash)

    def for_data_parallel_rank(self, rank: int) -> "Deployment":
        """The same deployment as data-parallel rank ``rank``'s engine core builds it."""
        if not 0 <= rank < self.layout.data_parallel_size:
            raise ValueError(f"data-parallel rank {rank} outside 0..{self.layout.data_parallel_size - 1}")
        return replace(self, data_parallel_rank=rank)

    @property
    def model_name(self) -> str:
        return self.cfg.server.served_model_name or self.cfg.model.name
