"""The composition root: one place turns a resolved config into what runs.

``compose(resolved)`` checks that this machine can run the profile,
resolves dtype, KV dtype and attention backend together (walking the
hardware's priority list, importability included), plans memory and
returns the frozen ``Deployment`` that the offline ``LLM``, the server, the
engine-core process and ``appliance plan`` all read. ``build_engine``
turns a ``Deployment`` into model, backend, KV cache, scheduler and engine
core; the server receives it as a function, so nothing below this module
imports it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Optional

from appliance.config.compose import ResolvedConfig
from appliance.config.deployment import PROMPT_CHARS_PER_TOKEN, Deployment, ExecutorLayout, ExpertGroupAddress
from appliance.config.detect import DeviceDescription, detect_device
from appliance.config.execution import Execution, resolve_execution
from appliance.config.kv_connectors import DISAGGREGATED_PREFILL, OFFLOAD, connector_of, offload_medium
from appliance.config.plan import format_plan, make_plan, max_model_len
from appliance.config.schema import ApplianceConfig
from appliance.config.unbuilt import not_built
from appliance.errors import ConfigError
from appliance.kernels.registry import BackendSelectionError, Selection

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase

    from appliance.engine.core import EngineCore


def device_problems(cfg: ApplianceConfig, device: DeviceDescription) -> list[str]:
    """Why this machine cannot run ``cfg`` (empty when it can)."""
    hw = cfg.hardware
    want = hw.device_kind
    if want == "cpu":
        return []
    if device.kind != want:
        kind = {"cuda": "a CUDA", "rocm": "a ROCm"}[want]
        return [
            f"profile {cfg.profile} needs {kind} device (hardware={hw.name}"
            + (f", compute capability {hw.compute_capability}" if want == "cuda" else "")
            + f"); this machine has {'none' if device.kind == 'cpu' else device.kind}. "
            "Use +profile=cpu, or +profile=auto to pick what this machine can run"
        ]
    problems = []
    if want == "cuda" and hw.compute_capability and device.capability:
        have = f"{device.capability[0]}.{device.capability[1]}"
        if have != hw.compute_capability:
            problems.append(
                f"profile {cfg.profile} targets compute capability {hw.compute_capability} but "
                f"{device.name} has {have}; use +profile=auto"
            )
    needed = cfg.parallel.tensor_parallel_size * cfg.parallel.pipeline_parallel_size * cfg.parallel.data_parallel_size
    # Ray places the ranks on its cluster's nodes (and says when it cannot); otherwise they are this machine's
    if device.count and needed > device.count and executor_kind(cfg) != "ray":
        problems.append(f"the parallel layout needs {needed} devices; this machine has {device.count}")
    return problems


def execution_here(resolved: ResolvedConfig, device: DeviceDescription | None = None) -> Execution:
    """What ``resolved`` runs as on this machine when the profile is of this
    machine's kind (probed: importable backends only); the target hardware's
    plan otherwise."""
    device = device or detect_device()
    if resolved.cfg.hardware.device_kind != device.kind:
        return resolve_execution(resolved.cfg)
    return resolve_execution(resolved.cfg, probe=True, device=device)


def check_runnable(resolved: ResolvedConfig, device: DeviceDescription | None = None) -> Execution:
    """The execution this machine will run, or ConfigError with every reason it cannot."""
    device = device or detect_device()
    problems = device_problems(resolved.cfg, device)
    if problems:
        raise ConfigError("\n".join(problems))
    ex = resolve_execution(resolved.cfg, probe=True, device=device)
    if executor_kind(resolved.cfg) == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("parallel.executor=ray needs the ray package, which is not installed here: "
                          "pip install 'appliance[ray]' (or use parallel.executor=mp)")
    sel = ex.selection
    if sel.chosen is None:
        raise BackendSelectionError(
            "no attention backend can serve this deployment:\n" + "\n".join(f"  - {ln}" for ln in sel.explain())
            + ("\n  (attention.fallback=allow lets the profile fall back to the next backend)"
               if resolved.cfg.attention.fallback == "deny" else "")
        )
    return ex


def startup_lines(deployment: Deployment) -> list[str]:
    """What every entry point prints first: the profile picked, then a fallback
    with its reason and the override that avoids it, each once."""
    resolved, ex = deployment.resolved, deployment.execution
    lines = []
    if resolved.profile_reason:
        lines.append(f"profile auto -> {resolved.cfg.profile}: {resolved.profile_reason}")
    note = ex.fallback_note()
    if note:
        lines.append(f"note: {note}")
    return lines


def compose(resolved: ResolvedConfig, *, here: bool = True, device: Optional[DeviceDescription] = None,
            selection: Optional[Selection] = None) -> Deployment:
    """The deployment ``resolved`` describes.

    ``here`` (serving, the offline ``LLM``): as this machine runs it, or
    ConfigError / BackendSelectionError with every reason it cannot.
    Otherwise (``appliance plan``): as this machine would run it when the
    profile is of its kind, else as the target hardware would.
    ``selection`` replaces backend selection (to compare one backend with
    another on the same config)."""
    if selection is not None:
        ex = replace(resolve_execution(resolved.cfg), selection=selection)
    elif here:
        ex = check_runnable(resolved, device)
    else:
        ex = execution_here(resolved, device)
    unbuilt = not_built(resolved.cfg)
    if unbuilt and (here or selection is not None):
        raise ConfigError("this deployment plans but cannot run yet:\n" + "\n".join(f"  - {u}" for u in unbuilt))
    cfg = resolved.cfg
    plan = make_plan(cfg, ex)
    mml = max_model_len(cfg)
    par = cfg.parallel
    return Deployment(
        resolved=resolved, execution=ex, plan=plan,
        device="cuda" if cfg.hardware.device_kind in ("cuda", "rocm") else "cpu",
        num_kv_blocks=cfg.cache.num_blocks or plan.num_kv_blocks,
        max_model_len=mml,
        max_prompt_chars=cfg.server.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * mml,
        layout=ExecutorLayout(par.tensor_parallel_size, par.pipeline_parallel_size, par.data_parallel_size,
                              plan.parallel["expert_parallel_size"], executor_kind(cfg)),
    )


def executor_kind(cfg: ApplianceConfig) -> str:
    """What runs an engine core's ranks (tensor x pipeline; each
    data-parallel rank is a core of its own): ``parallel.executor``, where
    ``auto`` is ``uni`` for one rank and ``mp`` for more."""
    par = cfg.parallel
    if par.executor != "auto":
        return par.executor
    return "uni" if par.tensor_parallel_size * par.pipeline_parallel_size == 1 else "mp"


def build_engine(deployment: Deployment) -> tuple[EngineCore, PreTrainedTokenizerBase]:
    """Model, backend, KV cache, scheduler and engine core for ``deployment``:
    the model runner in this process (executor ``uni``), or an executor over
    a worker process per tensor-parallel rank (``mp``, ``worker.executor``)
    or a Ray actor per rank (``ray``, ``worker.ray_executor``), each building
    its part with ``build_rank_runner``. A data-parallel
    rank's core first takes its share of the host (``place_data_parallel_rank``).

    Returns (EngineCore, tokenizer)."""
    from appliance.engine.core import EngineCore
    from appliance.engine.kv_cache.manager import KVCacheManager
    from appliance.engine.scheduler import Scheduler
    from appliance.engine.token_budget import TokenBudget

    cfg = deployment.cfg
    place_data_parallel_rank(deployment)
    row = connector_of(cfg)
    if row is not None and row.disaggregated and deployment.kv_engine_id is None:  # one for its ranks
        deployment = replace(deployment, kv_engine_id=uuid.uuid4().hex)
    if deployment.layout.executor in ("mp", "ray"):
        from appliance.models.loader import load_tokenizer

        if deployment.layout.executor == "mp":
            from appliance.worker.executor import MultiprocExecutor as Executor
        else:
            from appliance.worker.ray_executor import RayExecutor as Executor
        tokenizer = load_tokenizer(cfg.model, cfg.quantization.method)
        _prepare_draft(cfg)  # once, here: the ranks each load it
        runner: Any = Executor(deployment, build_rank_runner, deployment.layout.ranks_per_engine,
                               cfg.parallel.step_timeout_s)
        if deployment.layout.experts_across_cores:  # the ranks exchange with the other cores' ranks
            from appliance.worker.lockstep import Lockstep, LockstepRunner

            runner = LockstepRunner(runner)
            lockstep = Lockstep(_core_group(deployment), runner)
    elif deployment.layout.experts_across_cores:
        runner, tokenizer, lockstep = _lockstep_runner(deployment)
    else:
        runner, tokenizer = _model_runner(deployment)
    num_blocks, mml = deployment.num_kv_blocks, deployment.max_model_len
    kv = KVCacheManager(num_blocks, cfg.cache.block_size, cfg.cache.enable_prefix_caching,
                        cfg.cache.prefix_caching_hash_algo, enable_events=cfg.kv_events.enabled)
    connector = _kv_connector(deployment, runner)
    s = cfg.scheduler
    plan = deployment.plan
    budget = None
    if s.target_itl_ms is not None:
        budget = TokenBudget(s.target_itl_ms, plan.token_budget, s.max_num_batched_tokens,
                             min_prefill_share=s.min_prefill_share)
    scheduler = Scheduler(
        kv,
        max_num_batched_tokens=plan.token_budget,
        max_num_seqs=s.max_num_seqs,
        max_model_len=mml,
        policy=s.policy,
        enable_chunked_prefill=s.enable_chunked_prefill,
        long_prefill_token_threshold=s.long_prefill_token_threshold,
        max_num_partial_prefills=s.max_num_partial_prefills,
        max_long_partial_prefills=s.max_long_partial_prefills,
        # a draft model writes its K/V at the positions of its drafts, past the step
        num_lookahead_tokens=cfg.speculative.num_speculative_tokens if cfg.speculative.method == "draft_model" else 0,
        connector=connector[0] if connector is not None else None,
    )
    if connector is not None and connector[1] is not None:
        runner.kv_connector = connector[1]
    eos = tokenizer.eos_token_id
    return EngineCore(scheduler, runner, tokenizer, eos, vocab_size=cfg.model.vocab_size, token_budget=budget,
                      grammars=_grammars(cfg, tokenizer, eos),
                      lockstep=lockstep if deployment.layout.experts_across_cores else None,
                      kv_events=_kv_event_publisher(deployment)), tokenizer


def _kv_connector(deployment: Deployment, runner: Any) -> Optional[tuple[Any, Any]]:
    """The KV connector's (scheduler side, worker side) (``kv_transfer``), or
    None: an offload tier in a folder of its own per model and KV layout, or
    disaggregated prefill's ZeroMQ/TCP transfers between engines of one KV
    layout. With the model in this process ``runner`` is the ModelRunner
    whose caches they fill; with the core's ranks in workers (``mp``) the
    scheduler side is here and each rank's worker side in that rank
    (``build_rank_runner``; None here). Data-parallel core ``r`` has its
    own: a producer listens on ``_p2p_port`` (``p2p.port + r``, times its
    ranks); a tier keeps ``core<r>`` under the folder and ``offload.max_gib
    / n`` of it (split again over its ranks)."""
    row = connector_of(deployment.cfg)
    return CONNECTOR_BUILDS[row.flow].sides(deployment, runner) if row is not None else None


def _disaggregated_sides(deployment: Deployment, runner: Any) -> tuple[Any, Any]:
    from appliance.engine.kv_p2p import P2PConnector

    kt, cfg = deployment.cfg.kv_transfer, deployment.cfg
    ranks = _worker_ranks(deployment)
    p = kt.p2p
    worker = None if ranks is not None else _p2p_worker(deployment, _kv_layout(deployment, runner.kv_caches))
    # at most half the pool waits for consumers: a flood of unfetched prefills cannot take it all
    return P2PConnector(kt.role, deployment.kv_engine_id, p.host or p.bind_host, _p2p_port(deployment),
                        cfg.cache.block_size, p.timeout_s, deployment.num_kv_blocks // 2, ranks or 1,
                        name=kt.connector), worker


def _offload_sides(deployment: Deployment, runner: Any) -> tuple[Any, Any]:
    from appliance.engine.kv_connector import OffloadConnector

    cfg = deployment.cfg
    ranks = _worker_ranks(deployment)
    on_disk = offload_medium(cfg) == "disk"  # else host memory: nothing there at start
    if ranks is not None:
        folder = _tier_folder(deployment, _ranks_kv_layout(deployment)) if on_disk else None
        return OffloadConnector(folder, cfg.cache.block_size, ranks=ranks), None
    folder = _tier_folder(deployment, _kv_layout(deployment, runner.kv_caches)) if on_disk else None
    return OffloadConnector(folder, cfg.cache.block_size), _offload_worker(deployment, folder)


def _worker_ranks(deployment: Deployment) -> Optional[int]:
    """How many ranks of this engine core run in worker processes (``mp``,
    ``ray``); None: the model runs in this process."""
    lay = deployment.layout
    return lay.ranks_per_engine if lay.executor in ("mp", "ray") else None


def _p2p_port(deployment: Deployment) -> int:
    """Where this engine core's producer listens (its first rank; rank k at + k)."""
    return deployment.cfg.kv_transfer.p2p.port + deployment.data_parallel_rank * (_worker_ranks(deployment) or 1)


def _p2p_worker(deployment: Deployment, layout: dict[str, Any], rank: int = 0) -> Any:
    """Rank ``rank``'s side of disaggregated prefill: a producer's server on
    ``_p2p_port + rank``, a consumer's pulls from a producer's rank ``rank``;
    the blocks go in the answers (``p2p``) or are read through NIXL
    (``nixl``)."""
    from appliance.engine.kv_connector import layout_key

    kt = deployment.cfg.kv_transfer
    p = kt.p2p
    key = _connector_key(deployment.cfg)
    args = (kt.role, deployment.kv_engine_id, layout_key(layout), p.bind_host, _p2p_port(deployment) + rank,
            p.timeout_s, key)
    try:
        if kt.connector == "nixl":
            from appliance.worker.kv_nixl import NixlWorker

            return NixlWorker(*args, peer_offset=rank, backends=tuple(kt.nixl.backends))
        from appliance.worker.kv_p2p import P2PWorker

        return P2PWorker(*args, peer_offset=rank)
    except OSError as e:
        raise ConfigError(str(e)) from None


def _tier_folder(deployment: Deployment, layout: dict[str, Any]) -> Path:
    """This engine core's offload tier folder: one per model and KV
    ``layout`` (with the hash algorithm); data-parallel core r's
    ``core<r>`` in it."""
    from appliance.engine.kv_connector import tier_folder

    cfg = deployment.cfg
    folder = tier_folder(_tier_root(cfg), {**layout, "hash": cfg.cache.prefix_caching_hash_algo})
    return folder / f"core{deployment.data_parallel_rank}" if deployment.layout.data_parallel_size > 1 else folder


def _tier_root(cfg: Any) -> str:
    """Where the offload tiers' folders are: ``kv_transfer.offload.path``,
    else kv_offload beside the appliance's model cache."""
    from appliance.models.loader import cache_dir

    return cfg.kv_transfer.offload.path or str(cache_dir().parent / "kv_offload")


def _offload_worker(deployment: Deployment, folder: Optional[Path], agree: Any = None) -> Any:
    """The offload tier's worker side in ``folder`` (None: host memory), with
    its share of ``offload.max_gib`` (the engine cores' and their ranks'
    shares even)."""
    from appliance.engine.kv_connector import tier_identity
    from appliance.worker.kv_offload import HostTierWorker, OffloadWorker

    share = deployment.layout.data_parallel_size * (_worker_ranks(deployment) or 1)
    max_bytes = int(deployment.cfg.kv_transfer.offload.max_gib * (1 << 30) / share)
    if folder is None:
        return HostTierWorker(max_bytes, agree)
    try:
        return OffloadWorker(folder, tier_identity(_tier_root(deployment.cfg), folder), max_bytes, agree)
    except OSError as e:
        raise ConfigError(f"kv_transfer.offload.path: the tier's folder {folder} cannot be used: {e}") from None


def _ranks_kv_layout(deployment: Deployment) -> dict[str, Any]:
    """The KV layout of an engine core whose ranks run in workers (the engine
    process holds no cache): the model, precisions, block size and the
    tensor x pipeline split of the heads and layers (each rank's files hold
    its part; their headers check its shape)."""
    layout = _kv_layout(deployment, None)
    lay = deployment.layout
    return {**layout, "block_size": deployment.cfg.cache.block_size,
            "ranks": [lay.tensor_parallel_size, lay.pipeline_parallel_size]}


def _ranks_offload(deployment: Deployment, rank: int, comms: Any) -> Any:
    """Rank ``rank``'s part of the offload tier (``rank_folder``): its stage's
    tensor-parallel ranks agree on failed loads over ``comms.tp``."""
    import torch

    from appliance.engine.kv_connector import rank_folder

    def agree(failed: bool) -> bool:
        flag = torch.tensor([float(failed)])
        comms.tp.all_reduce(flag)
        return bool(flag[0] > 0)

    folder = None
    if offload_medium(deployment.cfg) == "disk":
        folder = rank_folder(_tier_folder(deployment, _ranks_kv_layout(deployment)), rank)
    return _offload_worker(deployment, folder, agree if comms.tp is not None else None)


@dataclass(frozen=True)
class ConnectorBuild:
    """How a KV connector flow (``config/kv_connectors.py``) is built: ``sides(deployment, runner)`` its
    scheduler side and, with the model in this process, its worker side (else None); ``rank_worker(deployment,
    rank, comms)`` a worker process's rank's side."""

    sides: Callable[[Deployment, Any], tuple[Any, Any]]
    rank_worker: Callable[[Deployment, int, Any], Any]


CONNECTOR_BUILDS = {
    OFFLOAD: ConnectorBuild(_offload_sides, _ranks_offload),
    DISAGGREGATED_PREFILL: ConnectorBuild(
        _disaggregated_sides, lambda deployment, rank, comms: _p2p_worker(deployment, _ranks_kv_layout(deployment),
                                                                          rank)),
}


# Model keys that change neither K/V values nor their layout: engines that differ only in these share KV.
_KV_NEUTRAL_MODEL_KEYS = ("name", "param_count_b", "max_model_len")


def _kv_layout(deployment: Deployment, caches: Optional[list]) -> dict[str, Any]:
    """What a block's K/V depend on: the model and its weights' precision,
    the activations' dtype, and the block's shape and dtype in the cache
    (``caches``; None: the configured KV dtype only)."""
    cfg = deployment.cfg
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in _KV_NEUTRAL_MODEL_KEYS}
    layout = {"model": model, "quantization": dataclasses.asdict(cfg.quantization),
              "dtype": deployment.execution.dtype}
    if caches is None:
        return {**layout, "kv_dtype": deployment.execution.kv_cache_dtype}
    return {**layout, "kv_dtype": str(caches[0].dtype), "block": list(caches[0][:, 0].shape), "layers": len(caches)}


def _kv_event_publisher(deployment: Deployment) -> Any:
    """The KV cache events' publisher of this engine core (``kv_events``), or None."""
    ev = deployment.cfg.kv_events
    if not ev.enabled:
        return None
    from appliance.server.kv_events import KVEventPublisher

    try:
        curve = None if ev.curve_secret_key_file is None else (os.path.expanduser(ev.curve_secret_key_file),
                                                               os.path.expanduser(ev.curve_authorized_keys))
        return KVEventPublisher(ev.endpoint, ev.replay_endpoint, ev.topic, ev.buffer_steps, ev.hwm,
                                ev.max_queue_size, deployment.data_parallel_rank,
                                "CPU" if deployment.device == "cpu" else "GPU", ev.include_token_ids, curve)
    except OSError as e:
        raise ConfigError(str(e)) from None


def _lockstep_runner(deployment: Deployment) -> tuple[Any, Any, Any]:
    """Data-parallel core ``deployment.data_parallel_rank``'s model, of one
    rank, with its share of the experts, exchanging rows with the other
    cores over the front end's segment (``deployment.expert_group``); the
    runner and the lock-step its loop follows (``worker/lockstep.py``)."""
    from appliance.models.layers.moe import ExpertParallel
    from appliance.worker.lockstep import Lockstep, LockstepRunner

    group = _core_group(deployment)
    runner, tokenizer = _model_runner(deployment, ep=ExpertParallel(group.rank, group.world_size, group,
                                                                   replicated=False))
    runner = LockstepRunner(runner)
    return runner, tokenizer, Lockstep(group, runner)


def _core_group(deployment: Deployment) -> Any:
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

        from appliance.worker.executor import TorchDistributedComm

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
    from appliance.worker.executor import rank_position

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
    runner = _model_runner(deployment, tp, pp, ep)[0]
    row = connector_of(cfg)
    if row is not None:
        runner.kv_connector = CONNECTOR_BUILDS[row.flow].rank_worker(deployment, rank, comms)
    if layout.experts_across_cores:
        from appliance.worker.lockstep import LockstepRunner

        return LockstepRunner(runner)  # an empty step still joins the other cores' exchanges
    return runner


def _model_runner(deployment: Deployment, tp: Any = None, pp: Any = None,
                  ep: Any = None) -> tuple[Any, PreTrainedTokenizerBase]:
    """The model (one rank's part with ``tp``, ``pp`` and / or ``ep``), quantized as
    configured, on its attention backend, in a ``ModelRunner`` with the KV
    cache; and the tokenizer."""
    import torch

    from appliance.kernels.registry import load_backend
    from appliance.models.loader import load_model
    from appliance.models.arch import ModelArch
    from appliance.models.layers.parallel import shard_arch
    from appliance.worker.model_runner import ModelRunner

    cfg, ex = deployment.cfg, deployment.execution
    dtype = getattr(torch, ex.dtype)
    # a tensor-parallel rank's GPU is the one its worker selected (executor.init_rank)
    device = torch.device(deployment.device if (tp is None and pp is None) or deployment.device == "cpu"
                          else f"cuda:{torch.cuda.current_device()}")
    m = cfg.model
    heads, kv_heads = m.num_heads, m.num_kv_heads
    if tp is not None:
        local = shard_arch(ModelArch.from_model_config(m), tp.size, expert_parallel=ep is not None)
        heads, kv_heads = local.num_heads, local.num_kv_heads
    backend = load_backend(ex.backend)(heads, kv_heads, m.head_dim, m.head_dim ** -0.5, ex.kv_cache_dtype)
    eplb = cfg.parallel.eplb
    model, tokenizer, _ = load_model(m, backend, dtype, device, cfg.quantization.method, tp, pp, ep,
                                     eplb.num_redundant_experts if eplb.enabled else 0)
    if eplb.enabled:
        model.enable_eplb(eplb.window_size, eplb.step_interval)
    from appliance.models.loader import quantize_at_load

    quantize_at_load(model, cfg.quantization)
    if device.type != "cpu":  # int4 weights travel packed (4 bits a weight), as the GPU GEMM reads them
        from appliance.models.quant import Int4WeightOnlyLinear

        for module in model.modules():
            if isinstance(module, Int4WeightOnlyLinear):
                module.prepare_for(device, dtype)
    model.to(device)  # modules a quantization method built from host tensors
    num_blocks, mml = deployment.num_kv_blocks, deployment.max_model_len
    kv_dtype = backend.cache_dtype(ex.kv_cache_dtype, dtype)
    spec = cfg.speculative
    proposer = None
    drafts = pp is None or pp.last  # a pipeline stage before the last samples nothing, so it drafts nothing
    if drafts and spec.method == "ngram":
        from appliance.worker.spec_decode import NgramProposer

        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max, mml)
    elif drafts and spec.method == "draft_model":
        proposer = _draft_proposer(cfg, ex, tokenizer, num_blocks, dtype, kv_dtype, device, mml)
    runner = ModelRunner(model, backend, num_blocks, cfg.cache.block_size, mml, cfg.scheduler.max_num_seqs, dtype,
                         kv_dtype, device, tokenizer.eos_token_id, seed=m.seed, proposer=proposer,
                         disable_spec_above=spec.disable_by_batch_size, bitmask_kernel=_bitmask_kernel(ex.backend))
    return runner, tokenizer


def _bitmask_kernel(backend: str) -> Optional[Callable]:
    """The kernel that masks constrained logits rows (sampling runs on host
    logits): the native one where the native kernels are loaded, else None
    (xgrammar's)."""
    if backend != "cpu_native":
        return None
    from appliance.kernels.cpu_native import apply_token_bitmask

    return apply_token_bitmask


def _grammars(cfg: Any, tokenizer: Any, eos: Optional[int]):
    """The output constraints' compiler (``structured_output``) for this tokenizer;
    a grammar ends on the model's end-of-sequence token."""
    from appliance.structured_output import ConstraintLimits, Grammars

    so = cfg.structured_output
    return Grammars(tokenizer, cfg.model.vocab_size, [] if eos is None else [eos], so.num_threads,
                    so.cache_size_mib << 20, any_whitespace=not so.disable_any_whitespace,
                    max_whitespace=so.max_json_whitespace,
                    limits=ConstraintLimits(so.max_schema_bytes, so.max_schema_depth))


def _prepare_draft(cfg: Any) -> None:
    """The draft model's folder made (converted or generated) before the ranks
    start, which each hold the whole draft and would race to make it."""
    if cfg.speculative.method != "draft_model":
        return
    from appliance.models.loader import resolve_model_folder

    resolve_model_folder(_draft_config(cfg))


def _draft_config(cfg: Any) -> Any:
    """The draft model's config, or ConfigError with why it cannot be had."""
    from appliance.config.draft import draft_model_config

    d, problems = draft_model_config(cfg)
    if d is None or problems:
        raise ConfigError("; ".join(problems))
    return d


def _draft_proposer(cfg: Any, ex: Any, tokenizer: Any, num_blocks: int, dtype: Any, kv_dtype: Any, device: Any,
                    mml: int):
    """The draft model on its own backend instance and KV cache (the target's
    blocks), checked to read the target's tokens."""
    import torch

    from appliance.kernels.registry import load_backend
    from appliance.models.loader import load_model
    from appliance.worker.draft_proposer import DraftModelProposer

    spec = cfg.speculative
    d = _draft_config(cfg)
    # K/V of the draft's own dtype, unless the cache is set to another element type (fp8, bf16)
    kv_name = "auto" if cfg.cache.kv_cache_dtype == "auto" else ex.kv_cache_dtype
    backend = load_backend(ex.backend)(d.num_heads, d.num_kv_heads, d.head_dim, d.head_dim ** -0.5, kv_name)
    if spec.draft_dtype != "auto":
        dtype = getattr(torch, spec.draft_dtype)
        kv_dtype = backend.cache_dtype(kv_name, dtype)
    model, draft_tokenizer, _ = load_model(d, backend, dtype, device)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"speculative.draft_model={spec.draft_model}: its tokenizer's vocabulary differs from the "
                          f"target's; a draft must share the target's tokenizer")
    model.to(device)
    return DraftModelProposer(model, backend, spec.num_speculative_tokens, mml, num_blocks, cfg.cache.block_size,
                              dtype, kv_dtype, device, cfg.scheduler.max_num_batched_tokens)


def _connector_key(cfg: ApplianceConfig) -> bytes:
    """The internal key a disaggregated-prefill connector signs its messages with (refused without one)."""
    from appliance.server.auth import need_internal_key

    return need_internal_key(cfg.server, f"kv_transfer.connector={cfg.kv_transfer.connector} (its messages are "
                                         "signed)")


def serve(resolved: ResolvedConfig) -> int:
    from appliance.server.auth import check_exposure, load_api_keys, load_internal_key

    cfg = resolved.cfg
    check_exposure(cfg.server, load_api_keys(cfg.server))
    # the keys read before anything starts: an unreadable file or a missing key leaves nothing half-started
    row = connector_of(cfg)
    if row is not None and row.disaggregated:
        _connector_key(cfg)
    else:
        load_internal_key(cfg.server)
    deployment = compose(resolved)
    for line in startup_lines(deployment):
        print(line)
    print(format_plan(deployment.plan))
    print(f"config hash        {resolved.hash}")
    print(f"deployment         {deployment.fingerprint}")
    from appliance.server.launch import serve_forever

    return serve_forever(deployment, build_engine, lambda n: expert_group_address(deployment, n))


def expert_group_address(deployment: Deployment, world_size: int) -> ExpertGroupAddress:
    """Where ``world_size`` lock-step engine cores and, when their ranks run
    in worker processes (executor ``mp``), those ranks meet (the front end
    picks them per generation of cores): new shared-memory segments for CPU
    cores with ``parallel.cpu_collectives=shm`` (the ranks' one per
    tensor-parallel index), else torch.distributed addresses on this host
    (gloo, or NCCL between GPU cores)."""
    from appliance.worker.executor import collectives, free_port

    in_workers = deployment.layout.executor == "mp"  # the cores' ranks exchange, not the cores
    if collectives(deployment, world_size) == "shm":
        from appliance.kernels.shm_comm import create_segment

        return ExpertGroupAddress(create_segment(world_size),
                                  tuple(create_segment(world_size) for _ in range(deployment.layout.ranks_per_engine))
                                  if in_workers else ())
    return ExpertGroupAddress(f"tcp://127.0.0.1:{free_port()}",
                              (f"tcp://127.0.0.1:{free_port()}",) if in_workers else ())
