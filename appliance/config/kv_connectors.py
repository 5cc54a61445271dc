"""The KV connectors (``kv_transfer.connector``), as a registry: one row per
connector, with the ``kv_transfer`` sections it reads, the roles it takes,
its flow (an offload tier the engine saves to and loads from, or
disaggregated prefill between a producer and a consumer engine), the rules
validation applies to its keys and the line ``appliance plan`` prints. The
runner builds each flow's scheduler and worker sides (``runner/kv.py``,
``CONNECTOR_BUILDS``); the engine's side of disaggregated prefill names its
connectors in ``engine/kv_p2p.DISAGGREGATED_PREFILL``, which a test holds
equal to this registry's.

Torch-free, like the rest of ``config/``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from appliance.config.schema import ApplianceConfig, KVTransferConfig

OFFLOAD = "offload"
DISAGGREGATED_PREFILL = "disaggregated prefill"
OFFLOAD_MEDIA = ("auto", "disk", "host")


def offload_medium(cfg: ApplianceConfig) -> str:
    """Where the offload tier keeps blocks: ``disk`` or ``host`` (``auto``:
    host memory on GPU profiles, disk on CPU ones)."""
    medium = cfg.kv_transfer.offload.medium
    if medium == "auto":
        return "disk" if cfg.hardware.device_kind == "cpu" else "host"
    return medium


def _offload_problems(cfg: ApplianceConfig) -> list[str]:
    kt = cfg.kv_transfer
    problems = []
    if kt.offload.medium not in OFFLOAD_MEDIA:
        problems.append(f"kv_transfer.offload.medium={kt.offload.medium} must be one of {', '.join(OFFLOAD_MEDIA)}")
    elif offload_medium(cfg) == "host" and kt.offload.path is not None:
        problems.append(f"kv_transfer.offload.path={kt.offload.path} has no effect with the tier in host memory "
                        f"(kv_transfer.offload.medium={kt.offload.medium}); set medium=disk for a folder")
    if not kt.offload.max_gib > 0:
        problems.append(f"kv_transfer.offload.max_gib={kt.offload.max_gib} must be positive")
    if not cfg.cache.enable_prefix_caching:
        problems.append("kv_transfer.connector=offload keys blocks by their prefix hashes; it needs "
                        "cache.enable_prefix_caching=true")
    if cfg.cache.prefix_caching_hash_algo == "builtin" and offload_medium(cfg) == "disk":
        problems.append("kv_transfer.connector=offload needs hashes that stay the same across processes "
                        "(cache.prefix_caching_hash_algo=sha256 or sha256_cbor); builtin hashes change per "
                        "process")
    return problems


def _offload_plan(cfg: ApplianceConfig) -> str:
    kt = cfg.kv_transfer
    if offload_medium(cfg) == "host":
        return (f"offload: full blocks copied to host memory as they fill (pinned on GPUs), at most "
                f"{kt.offload.max_gib:g} GiB, least recently used dropped first; a prefix found there loads instead "
                f"of being recomputed (gone at a restart: kv_transfer.offload.medium=disk keeps it)")
    where = kt.offload.path or "kv_offload in the appliance's cache folder"
    return (f"offload: full blocks saved to {where} as they fill (a subfolder per model and KV layout), at most "
            f"{kt.offload.max_gib:g} GiB, least recently used dropped first; a prefix found there loads instead "
            f"of being recomputed, after a restart too")


def _nixl_problems(cfg: ApplianceConfig) -> list[str]:
    backends = cfg.kv_transfer.nixl.backends
    if not backends or not all(isinstance(b, str) and b for b in backends):
        return [f"kv_transfer.nixl.backends={backends} must name NIXL backends (e.g. [UCX])"]
    return []


def _p2p_problems(cfg: ApplianceConfig) -> list[str]:
    """The ZeroMQ/TCP side channel every disaggregated-prefill connector speaks (``kv_transfer.p2p``)."""
    kt = cfg.kv_transfer
    p2p, defaults = kt.p2p, KVTransferConfig().p2p
    problems = []
    if not 0 < p2p.port < 65536:
        problems.append(f"kv_transfer.p2p.port={p2p.port} must be a TCP port (1..65535)")
    if not p2p.timeout_s > 0:
        problems.append(f"kv_transfer.p2p.timeout_s={p2p.timeout_s} must be positive")
    for key in ("host", "bind_host"):
        v = getattr(p2p, key)
        if v is not None and (not v or any(c in v for c in "/ ")):
            problems.append(f"kv_transfer.p2p.{key}={v!r} must be a host name or address")
    if kt.role != "consumer" and p2p.host is None and p2p.bind_host in ("0.0.0.0", "::", "*"):
        problems.append(f"kv_transfer.p2p.bind_host={p2p.bind_host} listens everywhere; consumers need an "
                        f"address to reach this producer at: set kv_transfer.p2p.host")
    for entry in p2p.trusted_producers:
        if not _is_producer_entry(entry):
            problems.append(f"kv_transfer.p2p.trusted_producers: {str(entry)[:100]!r} must be host:port "
                            f"([v6addr]:port), or a host alone for any of its ports")
    if kt.role == "producer" and p2p.trusted_producers:
        problems.append("kv_transfer.p2p.trusted_producers has no effect with kv_transfer.role=producer (it "
                        "names the producers a consumer fetches from)")
    if kt.role == "consumer":  # a consumer only connects
        for key in ("host", "bind_host", "port"):
            if getattr(p2p, key) != getattr(defaults, key):
                problems.append(f"kv_transfer.p2p.{key}={getattr(p2p, key)} has no effect with "
                                f"kv_transfer.role=consumer (it fetches from the producers it is told of)")
    return problems


def _is_producer_entry(entry: Any) -> bool:
    """Whether ``entry`` reads as ``kv_transfer.p2p.trusted_producers`` takes
    them: host:port, [v6addr]:port, a host, or [v6addr]."""
    if not isinstance(entry, str) or not entry or any(c in entry for c in "/ @"):
        return False
    if entry.startswith("["):
        addr, _, rest = entry[1:].partition("]")
        return bool(addr) and (rest == "" or (rest[:1] == ":" and rest[1:].isdigit() and 0 < int(rest[1:]) < 65536))
    host, sep, port = entry.rpartition(":")
    if not sep:
        return True
    return bool(host) and ":" not in host and port.isdigit() and 0 < int(port) < 65536


def _disaggregated_plan(cfg: ApplianceConfig) -> str:
    kt = cfg.kv_transfer
    p = kt.p2p
    how = ("over ZeroMQ/TCP" if kt.connector == "p2p" else
           f"straight from the producer's KV cache through NIXL ({', '.join(kt.nixl.backends)}), asked for "
           f"over ZeroMQ/TCP")
    produce = (f"produces: holds a prefill's KV (requests with kv_transfer_params do_remote_decode) for its "
               f"consumer at {p.host or p.bind_host}:{p.port} (listening on {p.bind_host}), freed once fetched "
               f"or after {p.timeout_s:g} s")
    consume = (f"consumes: fetches a producer's KV (kv_transfer_params do_remote_prefill) in the background "
               f"{how}, then runs the last prompt token; a fetch failed or over {p.timeout_s:g} s "
               f"computes the prompt here")
    parts = {"producer": [produce], "consumer": [consume], "both": [produce, consume]}.get(kt.role, [])
    return f"{kt.connector} (disaggregated prefill): " + "; ".join(parts)


@dataclass(frozen=True)
class KVConnector:
    name: str  # kv_transfer.connector
    flow: str  # OFFLOAD or DISAGGREGATED_PREFILL
    sections: tuple[str, ...]  # the kv_transfer sections it reads
    roles: tuple[str, ...]  # the kv_transfer.role values it takes
    problems: Callable[[ApplianceConfig], list[str]]  # its keys' rules (validation)
    plan: Callable[[ApplianceConfig], str]  # what it does, in words (``appliance plan``)
    # where it runs across parallel.executor=ray's nodes, which is not built yet
    ray: str

    @property
    def disaggregated(self) -> bool:
        return self.flow == DISAGGREGATED_PREFILL


_DISAGGREGATED_ROLES = ("producer", "consumer", "both")
_RAY_P2P = "each rank serves and pulls its part from its own node"

KV_CONNECTORS: dict[str, KVConnector] = {c.name: c for c in (
    KVConnector("offload", OFFLOAD, ("offload",), ("both",), _offload_problems, _offload_plan,
                "each rank's part of the tier is on its node's disk, the engine core reads them on its own"),
    KVConnector("p2p", DISAGGREGATED_PREFILL, ("p2p",), _DISAGGREGATED_ROLES, _p2p_problems, _disaggregated_plan,
                _RAY_P2P),
    # NIXL's requests and notifications go over p2p's side channel
    KVConnector("nixl", DISAGGREGATED_PREFILL, ("p2p", "nixl"), _DISAGGREGATED_ROLES,
                lambda cfg: _nixl_problems(cfg) + _p2p_problems(cfg), _disaggregated_plan, _RAY_P2P),
)}


def connector_of(cfg: ApplianceConfig) -> Optional[KVConnector]:
    """The configured connector's row; None: no connector (or an unknown name, which validation refuses)."""
    return KV_CONNECTORS.get(cfg.kv_transfer.connector) if cfg.kv_transfer.connector is not None else None


def kv_transfer_problems(cfg: ApplianceConfig) -> list[str]:
    kt, par = cfg.kv_transfer, cfg.parallel
    defaults = KVTransferConfig()
    if kt.connector is None:
        problems = []
        if kt.role != defaults.role:
            problems.append(f"kv_transfer.role={kt.role} has no effect without a connector (kv_transfer.connector)")
        return problems + _unused_keys(kt, defaults, None)
    row = KV_CONNECTORS.get(kt.connector)
    if row is None:
        return [f"kv_transfer.connector={kt.connector} is unknown; built: {', '.join(KV_CONNECTORS)}"]
    problems = []
    if kt.role not in _DISAGGREGATED_ROLES:
        problems.append(f"kv_transfer.role={kt.role} must be producer, consumer or both")
    elif kt.role not in row.roles:
        problems.append(f"kv_transfer.role={kt.role}: an offload tier saves and loads (role both); producer and "
                        f"consumer are disaggregated prefill's roles (kv_transfer.connector=p2p)")
    problems += _unused_keys(kt, defaults, row)
    problems += row.problems(cfg)
    if par.executor == "ray":
        problems.append(f"kv_transfer.connector={kt.connector} on parallel.executor=ray is not built yet ({row.ray}); "
                        f"use parallel.executor=mp or auto on one host")
    if par.enable_expert_parallel and par.data_parallel_size > 1:
        problems.append(f"kv_transfer.connector={kt.connector} with expert parallelism across engine cores is not "
                        f"built yet (the cores step together; a step waiting for remote KV would hold them all)")
    return problems


def _unused_keys(kt: KVTransferConfig, defaults: KVTransferConfig, row: Optional[KVConnector]) -> list[str]:
    """Keys of sections the configured connector (None: none) does not
    read, set away from their defaults."""
    problems = []
    used = row.sections if row is not None else ()
    for group in sorted({g for c in KV_CONNECTORS.values() for g in c.sections} - set(used)):
        ours, default = getattr(kt, group), getattr(defaults, group)
        readers = " or ".join(c.name for c in KV_CONNECTORS.values() if group in c.sections)
        for key in dataclasses.asdict(default):
            if getattr(ours, key) != getattr(default, key):
                problems.append(f"kv_transfer.{group}.{key}={getattr(ours, key)} has no effect without "
                                f"kv_transfer.connector={readers}")
    return problems


def describe_kv_transfer(cfg: ApplianceConfig) -> str:
    row = connector_of(cfg)
    return row.plan(cfg) if row is not None else "off"
