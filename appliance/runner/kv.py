"""The KV connectors' sides (``config/kv_connectors.py`` names the flows;
``CONNECTOR_BUILDS`` builds each once): an offload tier in a folder of its
own per model and KV layout, or disaggregated prefill's transfers between
engines of one KV layout; and the KV cache events' publisher."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from appliance.config.deployment import Deployment
from appliance.config.kv_connectors import DISAGGREGATED_PREFILL, OFFLOAD, connector_of, offload_medium
from appliance.config.kv_groups import kv_layout
from appliance.config.schema import ApplianceConfig
from appliance.errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path


def connector_sides(deployment: Deployment, runner: Any) -> Optional[tuple[Any, Any]]:
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
    ranks = worker_ranks(deployment)
    p = kt.p2p
    worker = None if ranks is not None else _p2p_worker(deployment, _kv_layout(deployment, runner.kv_caches))
    assert kt.connector is not None  # sides are built for a connector only (connector_sides)
    # at most half the pool waits for consumers: a flood of unfetched prefills cannot take it all
    return P2PConnector(kt.role, _engine_id(deployment), p.host or p.bind_host, _p2p_port(deployment),
                        cfg.cache.block_size, p.timeout_s, deployment.num_kv_blocks // 2, ranks or 1,
                        name=kt.connector), worker


def _engine_id(deployment: Deployment) -> str:
    """The name a disaggregated connector's engine goes by (its peers fetch from it by that name)."""
    assert deployment.kv_engine_id is not None  # build_engine names every engine with a disaggregated connector
    return deployment.kv_engine_id


def _offload_sides(deployment: Deployment, runner: Any) -> tuple[Any, Any]:
    from appliance.engine.kv_connector import OffloadConnector

    cfg = deployment.cfg
    ranks = worker_ranks(deployment)
    on_disk = offload_medium(cfg) == "disk"  # else host memory: nothing there at start
    if ranks is not None:
        folder = _tier_folder(deployment, _ranks_kv_layout(deployment)) if on_disk else None
        return OffloadConnector(folder, cfg.cache.block_size, ranks=ranks), None
    folder = _tier_folder(deployment, _kv_layout(deployment, runner.kv_caches)) if on_disk else None
    return OffloadConnector(folder, cfg.cache.block_size), _offload_worker(deployment, folder)


def worker_ranks(deployment: Deployment) -> Optional[int]:
    """How many ranks of this engine core run in worker processes (``mp``,
    ``ray``); None: the model runs in this process."""
    lay = deployment.layout
    return lay.ranks_per_engine if lay.executor in ("mp", "ray") else None


def _p2p_port(deployment: Deployment) -> int:
    """Where this engine core's producer listens (its first rank; rank k at + k)."""
    return deployment.cfg.kv_transfer.p2p.port + deployment.data_parallel_rank * (worker_ranks(deployment) or 1)


def _p2p_worker(deployment: Deployment, layout: dict[str, Any], rank: int = 0) -> Any:
    """Rank ``rank``'s side of disaggregated prefill: a producer's server on
    ``_p2p_port + rank``, a consumer's pulls from a producer's rank ``rank``;
    the blocks go in the answers (``p2p``) or are read through NIXL
    (``nixl``)."""
    from appliance.engine.kv_connector import layout_key

    kt = deployment.cfg.kv_transfer
    p = kt.p2p
    key = connector_key(deployment.cfg)
    args = (kt.role, _engine_id(deployment), layout_key(layout), p.bind_host, _p2p_port(deployment) + rank,
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

    share = deployment.layout.data_parallel_size * (worker_ranks(deployment) or 1)
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


def kv_event_publisher(deployment: Deployment) -> Any:
    """The KV cache events' publisher of this engine core (``kv_events``), or None."""
    ev = deployment.cfg.kv_events
    if not ev.enabled:
        return None
    from appliance.server.kv_events import KVEventPublisher

    try:
        curve = None
        if ev.curve_secret_key_file is not None:
            assert ev.curve_authorized_keys is not None  # validation asks for both or neither
            curve = (os.path.expanduser(ev.curve_secret_key_file), os.path.expanduser(ev.curve_authorized_keys))
        return KVEventPublisher(ev.endpoint, ev.replay_endpoint, ev.topic, ev.buffer_steps, ev.hwm,
                                ev.max_queue_size, deployment.data_parallel_rank,
                                "CPU" if deployment.device == "cpu" else "GPU", ev.include_token_ids, curve)
    except OSError as e:
        raise ConfigError(str(e)) from None


def connector_key(cfg: ApplianceConfig) -> bytes:
    """The internal key a disaggregated-prefill connector signs its messages with (refused without one)."""
    from appliance.server.auth import need_internal_key

    return need_internal_key(cfg.server, f"kv_transfer.connector={cfg.kv_transfer.connector} (its messages are "
                                         "signed)")


def kv_group_specs(deployment: Deployment) -> list[Any]:
    """The engine's KV-cache groups, as the plan lays them out (config/kv_groups.py)."""
    from appliance.engine.kv_cache.single_type import KVCacheGroupSpec

    layout = kv_layout(deployment.cfg.model, deployment.max_model_len)
    return [KVCacheGroupSpec(g.sliding_window, g.attention_chunk) for g in layout.groups]
