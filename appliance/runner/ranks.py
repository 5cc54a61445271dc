"""An engine core's ranks: in this process (one rank, or one of lock-step
data-parallel cores that split the experts), or in worker processes or
Ray actors (``rank_group``: the narrow description the executors read;
``build_rank_runner`` builds each rank's part there); and a data-parallel
core's share of the host."""

from __future__ import annotations

import functools
from typing import Any, Optional

from appliance.config.deployment import Deployment, ExpertGroupAddress
from appliance.config.kv_connectors import connector_of
from appliance.errors import ConfigError
from appliance.runner.kv import CONNECTOR_BUILDS
from appliance.runner.model import build_model_runner, prepare_draft
from appliance.worker.rank_group import CoreGroup, RankGroup


def step_runner(deployment: Deployment) -> tuple[Any, Any, Optional[Any]]:
    """(step runner, tokenizer, lock-step or None) of this engine core: an
    executor over its ranks (``mp``, ``ray``), or the model runner here;
    wrapped to keep lock-step with the other cores when they split the
    experts (``worker/lockstep.py``)."""
    lay, cfg = deployment.layout, deployment.cfg
    if lay.executor not in ("mp", "ray"):
        if lay.experts_across_cores:
            return lockstep_runner(deployment)
        runner, tokenizer = build_model_runner(deployment)
        return runner, tokenizer, None
    from appliance.models.loader import load_tokenizer

    tokenizer = load_tokenizer(cfg.model, cfg.quantization.method)
    prepare_draft(cfg)  # once, here: the ranks each load it
    if lay.executor == "mp":
        from appliance.worker.executor import MultiprocExecutor

        runner = MultiprocExecutor(rank_group(deployment))
    else:
        from appliance.worker.ray_executor import RayExecutor

        runner = RayExecutor(rank_group(deployment))
    if not lay.experts_across_cores:
        return runner, tokenizer, None
    from appliance.worker.lockstep import Lockstep, LockstepRunner  # the ranks exchange with the other cores' ranks

    runner = LockstepRunner(runner)
    return runner, tokenizer, Lockstep(core_group(deployment), runner)


def rank_group(deployment: Deployment) -> RankGroup:
    """What the executors read of ``deployment`` to start its engine core's
    ranks, each of which builds its part with ``build_rank_runner``."""
    lay, par = deployment.layout, deployment.cfg.parallel
    cores = None
    if lay.experts_across_cores:
        if deployment.expert_group is None or not deployment.expert_group.ranks:
            raise ConfigError("expert parallelism across engine cores with their ranks in worker processes needs "
                              "the ranks' addresses the front end makes (Deployment.expert_group.ranks)")
        cores = CoreGroup(lay.data_parallel_size, deployment.data_parallel_rank, tuple(deployment.expert_group.ranks))
    return RankGroup(deployment.device, lay.tensor_parallel_size, lay.pipeline_parallel_size,
                     functools.partial(build_rank_runner, deployment), par.step_timeout_s, par.cpu_collectives,
                     par.ray_address, cores)


def lockstep_runner(deployment: Deployment) -> tuple[Any, Any, Any]:
    """Data-parallel core ``deployment.data_parallel_rank``'s model, of one
    rank, with its share of the experts, exchanging rows with the other
    cores over the front end's segment (``deployment.expert_group``); the
    runner and the lock-step its loop follows (``worker/lockstep.py``)."""
    from appliance.models.layers.moe import ExpertParallel
    from appliance.worker.lockstep import Lockstep, LockstepRunner

    group = core_group(deployment)
    runner, tokenizer = build_model_runner(deployment, ep=ExpertParallel(group.rank, group.world_size, group,
                                                                         replicated=False))
    runner = LockstepRunner(runner)
    return runner, tokenizer, Lockstep(group, runner)


def core_group(deployment: Deployment) -> Any:
    """The lock-step engine cores' group (``worker.lockstep.ExpertGroup``) at
    the front end's address for them (``deployment.expert_group.cores``)."""
    from appliance.kernels.shm_comm import ShmComm
    from appliance.worker.lockstep import ExpertGroup

    layout = deployment.layout
    if deployment.expert_group is None:
        raise ConfigError("expert parallelism across data-parallel engine cores needs the segment the front end "
                          "makes for them (Deployment.expert_group)")
    rank, world = deployment.data_parallel_rank, layout.data_parallel_size
    timeout_s = deployment.cfg.parallel.step_timeout_s
    address = deployment.expert_group.cores
    if address.startswith("tcp://"):  # gloo between CPU cores, NCCL between GPU ones (each sees one device)
        import datetime

        import torch.distributed as dist

        from appliance.worker.rank_group import TorchDistributedComm

        device = "cpu" if deployment.device == "cpu" else "cuda"
        dist.init_process_group("gloo" if device == "cpu" else "nccl", init_method=address, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        return ExpertGroup(TorchDistributedComm(world, device=device), rank, world, device)
    return ExpertGroup(ShmComm(address, rank, world, timeout_s), rank, world)


def place_data_parallel_rank(deployment: Deployment) -> None:
    """With data parallelism, confine this engine core (and the workers it
    starts) to its rank's share of the host: on CPUs its run of the cores,
    pinned, and as many torch threads; on GPUs its ``tp x pp`` devices
    (``CUDA_VISIBLE_DEVICES``, set before CUDA starts). One rank: nothing."""
    layout = deployment.layout
    if layout.data_parallel_size == 1 or layout.executor == "ray":  # Ray's placement groups place the ranks
        return
    from appliance.worker.placement import cuda_devices, pin_cpu_rank

    rank = deployment.data_parallel_rank
    if deployment.device == "cpu":
        pin_cpu_rank(rank, layout.data_parallel_size)
    else:
        cuda_devices(rank, layout.ranks_per_engine)


def build_rank_runner(deployment: Deployment, rank: int, comms: Any) -> Any:
    """Rank ``rank``'s model runner under the ``mp`` or ``ray`` executor: its
    part of the model (its pipeline stage's layers, its tensor-parallel
    rows and columns of them; ``comms``, an ``executor.RankCollectives``,
    runs the exchanges) and the cache of its layers' KV heads; one rank
    alone, the whole model. Runs in that rank's worker process."""
    from appliance.config.sizes import pipeline_partition
    from appliance.models.layers.parallel import PipelineParallel, StageLink, TensorParallel
    from appliance.models.layers.moe import ExpertParallel
    from appliance.worker.rank_group import rank_position

    layout, cfg = deployment.layout, deployment.cfg
    tp_size, pp_size = layout.tensor_parallel_size, layout.pipeline_parallel_size
    stage, tp_rank = rank_position(rank, tp_size)
    tp = TensorParallel(tp_rank, tp_size, comms.tp) if tp_size > 1 else None
    ep = None
    if layout.experts_across_cores:  # this rank's whole experts; its rows exchanged with the other cores' ranks
        core = deployment.data_parallel_rank
        ep = ExpertParallel(core * tp_size + tp_rank, layout.data_parallel_size * tp_size, comms.experts,
                            replicated=False, tp=comms.tp)
    elif cfg.parallel.enable_expert_parallel and tp_size > 1:  # within one core: its ranks' whole experts
        ep = ExpertParallel(tp_rank, tp_size, comms.tp)
    pp = None
    if pp_size > 1:
        parts = pipeline_partition(cfg.model.num_layers, pp_size, cfg.parallel.pp_layer_partition)
        start = sum(parts[:stage])
        pp = PipelineParallel(stage, pp_size, start, start + parts[stage],
                              receive=StageLink(*comms.receive) if comms.receive is not None else None,
                              send=StageLink(*comms.send) if comms.send is not None else None)
    runner = build_model_runner(deployment, tp, pp, ep)[0]
    row = connector_of(cfg)
    if row is not None:
        runner.kv_connector = CONNECTOR_BUILDS[row.flow].rank_worker(deployment, rank, comms)
    if layout.experts_across_cores:
        from appliance.worker.lockstep import LockstepRunner

        return LockstepRunner(runner)  # an empty step still joins the other cores' exchanges
    return runner


def expert_group_address(deployment: Deployment, world_size: int) -> ExpertGroupAddress:
    """Where ``world_size`` lock-step engine cores and, when their ranks run
    in worker processes (executor ``mp``), those ranks meet (the front end
    picks them per generation of cores): new shared-memory segments for CPU
    cores with ``parallel.cpu_collectives=shm`` (the ranks' one per
    tensor-parallel index), else torch.distributed addresses on this host
    (gloo, or NCCL between GPU cores)."""
    from appliance.worker.rank_group import collectives, free_port

    in_workers = deployment.layout.executor == "mp"  # the cores' ranks exchange, not the cores
    if collectives(deployment.device, deployment.cfg.parallel.cpu_collectives, world_size) == "shm":
        from appliance.kernels.shm_comm import create_segment

        return ExpertGroupAddress(create_segment(world_size),
                                  tuple(create_segment(world_size) for _ in range(deployment.layout.ranks_per_engine))
                                  if in_workers else ())
    return ExpertGroupAddress(f"tcp://127.0.0.1:{free_port()}",
                              (f"tcp://127.0.0.1:{free_port()}",) if in_workers else ())
