"""Disaggregated prefill over NIXL (``kv_transfer.connector=nixl``): the
flow of ``p2p`` (scheduler side: ``engine/kv_p2p.py``), but a consumer
reads the blocks straight out of the producer's KV cache through NIXL
(its UCX backend: RDMA, CUDA IPC or shared memory, GPU or host memory)
instead of receiving them in a ZeroMQ message.

Each rank has a NIXL agent named ``<engine id>-<rank>`` with its KV cache
registered (one region per layer, ``[2, blocks, ...]``: a block's K at
``(0 * blocks + id) * block bytes`` into it, its V at ``(1 * blocks + id)
* block bytes``). The side channel is p2p's ZeroMQ server and its checks
(engine id, KV layout, blocks within the transfer, a transfer served only
while registered and never after it ended); only the answer to a pull
differs. A pull asks for the producer's agent metadata the first time the
consumer meets that agent (``metadata``). The answer is

    [b"ok", msgpack {transfer, digest, agent, regions, num_blocks,
                     block_bytes, mem, device, blocks, hold_s, checksum,
                     metadata_checksum}, agent metadata or b"", mac]

``regions``: each layer's cache address; ``blocks``: the transfer's block
ids asked for; ``hold_s``: how long the producer still holds them;
``checksum``: the digest of those blocks' K and V, layer by layer, as p2p's
(``kv_checksum.layers_digest``, gathered where they lie), ``metadata_checksum``
the SHA-256 of the metadata frame. The consumer checks the answer is for its transfer,
the digest against its own tokens and the geometry against its cache,
adds the agent, and posts one NIXL READ of every layer's K and V of those
blocks (consecutive runs of blocks as one descriptor) into its own blocks.
Once the read is done (or failed, or past ``hold_s`` less a margin or its
own timeout: then it is aborted first, so nothing is still written into
blocks a failed load gives back), it checks the blocks it read against the
checksum and for NaN and infinity (a mismatch fails the load: the blocks
go back to the pool uncached and the prompt is computed), sends p2p's
``done``, and the producer frees the blocks. Every side-channel message is
signed as p2p's are.

NIXL reads any registered memory of an agent whose metadata it holds:
expose producers to trusted consumers only, as with p2p.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Optional

import msgspec
import numpy as np
import torch

from appliance.engine.kv_p2p import P2PMetadata, RecvSpec, seal, token_digest
from appliance.worker.kv_checksum import cached_layers, kv_digest, layers_digest, layers_problem
from appliance.worker.kv_p2p import READING, P2PWorker, _Load, _Send, is_int

log = logging.getLogger("appliance.kv_nixl")

HOLD_MARGIN_S = 1.0  # a read still moving this close to the producer's deadline is aborted
MAX_ANSWER = 4 << 20  # bytes of a pull's answer past its block ids (the agent's metadata)
MAX_REMOTE_AGENTS = 64  # producers' agents kept added (least recently read dropped)


def nixl_api() -> Optional[tuple[Any, Any]]:
    """NIXL's ``(nixl_agent, nixl_agent_config)``: from the ``nixl``
    package, or a build of it for one CUDA major (``nixl-cu13``,
    ``nixl-cu12``; their UCX runs on host memory without a GPU too); None
    when none is installed."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = importlib.import_module(name)
        except (ImportError, OSError):  # not installed, or built for libraries this machine lacks
            continue
        if "NIXL_LOG_LEVEL" not in os.environ:  # its INFO lines go to stdout
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api.nixl_agent, api.nixl_agent_config
    return None


def agent_name(engine_id: str, rank: int) -> str:
    """The NIXL agent of an engine's rank ``rank``."""
    return f"{engine_id}-{rank}"


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src first, dst first, count)``: runs of blocks consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def block_descs(regions: list[int], num_blocks: int, block_bytes: int, device: int, firsts: list[int],
                counts: list[int]) -> np.ndarray:
    """NIXL descriptors ``(address, bytes, device)`` of every layer's K and
    V of the runs of blocks starting at ``firsts``, in (layer, K/V, run)
    order."""
    firsts_a, counts_a = np.asarray(firsts, dtype=np.uint64), np.asarray(counts, dtype=np.uint64)
    out = np.empty((len(regions), 2, len(firsts), 3), dtype=np.uint64)
    for layer, base in enumerate(regions):
        for kv in range(2):
            out[layer, kv, :, 0] = np.uint64(base) + (np.uint64(kv * num_blocks) + firsts_a) * np.uint64(block_bytes)
            out[layer, kv, :, 1] = counts_a * np.uint64(block_bytes)
            out[layer, kv, :, 2] = device
    return out.reshape(-1, 3)


def _geometry(caches: list[torch.Tensor]) -> dict[str, Any]:
    """Where a rank's cache is, as a producer answers it."""
    like = caches[0]
    for c in caches:
        if not c.is_contiguous() or c.shape[0] != 2 or c.shape != like.shape or c.device != like.device:
            raise ValueError(f"kv_transfer.connector=nixl reads [2, blocks, ...] caches, one contiguous tensor per "
                             f"layer; this backend's are {tuple(c.shape)} on {c.device}")
    return {"regions": [c.data_ptr() for c in caches], "num_blocks": like.shape[1],
            "block_bytes": like[0, 0].numel() * like.element_size(),
            "mem": "DRAM" if like.device.type == "cpu" else "VRAM", "device": like.device.index or 0}


class NixlWorker(P2PWorker):
    """One rank's transfers over NIXL (see the module docstring); p2p's
    ZeroMQ server and puller, with the blocks read through NIXL."""

    def __init__(self, role: str, engine_id: str, layout: str, bind_host: str, port: int, timeout_s: float,
                 key: bytes, peer_offset: int = 0, backends: tuple[str, ...] = ("UCX",)):
        api = nixl_api()
        if api is None:
            raise OSError("kv_transfer.connector=nixl needs NIXL: pip install nixl (or nixl-cu12 / nixl-cu13 for "
                          "one CUDA major; their UCX backend runs on host memory too)")
        agent_cls, config_cls = api
        self.agent_name = agent_name(engine_id, peer_offset)
        # no progress thread: NIXL's spins a core for the agent's whole life; the puller's polls of its reads
        # and the server's loop (``_progress_agent``) drive the backends instead
        self._agent = agent_cls(self.agent_name, config_cls(backends=list(backends), enable_prog_thread=False))
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise OSError(f"kv_transfer.nixl.backends: {', '.join(missing)} cannot start here; NIXL's plugins: "
                          f"{', '.join(self._agent.get_plugin_list())}")
        self._agent_lock = threading.Lock()  # NIXL's agent is not thread-safe: the step's and both threads' calls
        self._registered: Any = None  # the caches' registration
        self._geometry: Optional[dict[str, Any]] = None  # where they are (None: not registered yet)
        self._metadata = b""  # this agent's metadata, with its registrations
        self._remote: OrderedDict[str, None] = OrderedDict()  # producers' agents added, least recently read first
        super().__init__(role, engine_id, layout, bind_host, port, timeout_s, key, peer_offset)

    # -- the model runner's calls ------------------------------------------------------
    def start_load_kv(self, meta: Optional[P2PMetadata], kv_caches: list[torch.Tensor]) -> None:
        self._register(kv_caches)
        super().start_load_kv(meta, kv_caches)

    def _register(self, caches: list[torch.Tensor]) -> None:
        """Register the caches with NIXL (again if they moved)."""
        geometry = _geometry(caches)
        if self._geometry is not None and self._geometry["regions"] == geometry["regions"]:
            return
        with self._agent_lock:
            if self._registered is not None:
                self._agent.deregister_memory(self._registered)
            self._registered = self._agent.register_memory(list(caches))
            self._metadata = self._agent.get_agent_metadata()
            self._geometry = geometry

    def close(self) -> None:
        super().close()
        with self._agent_lock:
            for load in self._reading:
                self._release_read(load)
            self._reading.clear()
            if self._registered is not None:
                self._agent.deregister_memory(self._registered)
                self._registered = None

    # -- producer -------------------------------------------------------------------------
    def _progress_agent(self) -> None:
        """Let the backends progress (what a remote read of our memory may
        need on transports that emulate it); NIXL's notifications are not used."""
        with self._agent_lock:
            self._agent.get_new_notifs()

    def _serve_blocks(self, send: _Send, first: int, count: int, tokens: int, msg: dict) -> list:
        """Where the blocks are, for the consumer to read (with this agent's
        metadata if it asks)."""
        with self._agent_lock:
            geometry, metadata = self._geometry, self._metadata
        if geometry is None:
            return self._error(b"the producer's cache is not registered with NIXL yet")
        spec = send.spec
        blocks = spec.block_ids[first:first + count]
        metadata = metadata if msg.get("metadata") is True else b""
        header = {**geometry, "transfer": spec.transfer_id, "digest": token_digest(spec.token_ids[:tokens]),
                  "agent": self.agent_name, "blocks": blocks, "checksum": layers_digest(cached_layers(self.caches, blocks)),
                  "metadata_checksum": kv_digest(metadata), "hold_s": max(0.0, send.deadline - time.monotonic())}
        return seal(self._key, b"ok", msgspec.msgpack.encode(header), metadata)

    # -- consumer ---------------------------------------------------------------------------
    def _answer_bytes(self, spec: RecvSpec) -> int:
        return MAX_ANSWER + 16 * len(spec.block_ids)

    def _pull_fields(self, spec: RecvSpec) -> dict:
        with self._agent_lock:
            return {"metadata": agent_name(spec.engine_id, self.peer_offset) not in self._remote}

    def _take(self, load: _Load, header: dict, payload_frame: Any) -> Optional[str]:
        """Check the producer's geometry against this cache and post the read."""
        spec = load.spec
        peer = agent_name(spec.engine_id, self.peer_offset)
        with self._agent_lock:
            ours = self._geometry
        problem = _answer_problem(header, ours, peer, len(spec.block_ids))
        if problem is not None:
            log.debug("request %s: the producer's answer does not fit this cache: %s", spec.request_id, problem)
            return "an answer that does not fit this cache (another KV layout?)"
        assert ours is not None  # _answer_problem refuses a cache not registered yet
        metadata = payload_frame.bytes
        if kv_digest(metadata) != header.get("metadata_checksum"):
            return "NIXL metadata that does not match its checksum"
        src = block_runs(header["blocks"], spec.block_ids)
        remote = block_descs(header["regions"], header["num_blocks"], ours["block_bytes"], header["device"],
                             [r[0] for r in src], [r[2] for r in src])
        local = block_descs(ours["regions"], ours["num_blocks"], ours["block_bytes"], ours["device"],
                            [r[1] for r in src], [r[2] for r in src])
        with self._agent_lock:
            if peer not in self._remote:
                problem = self._add_remote(peer, metadata)
                if problem is not None:
                    return problem
            self._remote.move_to_end(peer)
            handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, ours["mem"]),
                                                 self._agent.get_xfer_descs(remote, header["mem"]), peer)
            if self._agent.transfer(handle) == "ERR":
                self._agent.release_xfer_handle(handle)
                return "the NIXL read could not start"
        load.reading, load.checksum = handle, header.get("checksum")
        load.deadline = min(load.deadline, time.monotonic() + header["hold_s"] - HOLD_MARGIN_S)
        return READING

    def _add_remote(self, peer: str, metadata: bytes) -> Optional[str]:
        """(under the agent lock) Add a producer's agent; why it could not be, or None."""
        if not metadata:
            return "the producer sent no NIXL metadata"
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != peer:
            self._agent.remove_remote_agent(name)
            return f"the producer's NIXL agent is {name[:80]!r}, not {peer!r}"
        self._remote[peer] = None
        while len(self._remote) > MAX_REMOTE_AGENTS:
            self._agent.remove_remote_agent(self._remote.popitem(last=False)[0])
        return None

    def _progress(self, load: _Load, now: float) -> Optional[str]:
        with self._agent_lock:
            try:
                state = self._agent.check_xfer_state(load.reading)
            except Exception as e:  # the agent's error: the read is over
                state = f"ERR ({type(e).__name__}: {e})"
            if state == "DONE":
                if not self._release_read(load):
                    return "the NIXL read could not be released"
                return layers_problem(cached_layers(self.caches, load.spec.block_ids), self.caches[0].dtype,
                                      load.checksum)
            if state.startswith("ERR"):
                self._release_read(load)
                return f"the NIXL read failed: {state}"
            if now < load.deadline:
                return READING
            if not self._release_read(load):  # still writing into our blocks: the load stays until it can end
                return READING
        return "the NIXL read did not end before the producer's hold (or this consumer's timeout)"

    def _release_read(self, load: _Load) -> bool:
        """(under the agent lock) Release a load's read, aborting it if it
        still moves; whether it is released."""
        try:
            self._agent.release_xfer_handle(load.reading)
        except Exception as e:
            log.warning("a NIXL read of request %s cannot be released yet: %s", load.spec.request_id, e)
            return False
        load.reading = None
        return True


def _answer_problem(header: dict, ours: Optional[dict], peer: str, count: int) -> Optional[str]:
    """Why a producer's answer (past its digest) cannot be read into this
    cache, or None."""
    if ours is None:
        return "this consumer's cache is not registered with NIXL yet"
    if header.get("agent") != peer:
        return f"the answer names NIXL agent {str(header.get('agent'))[:80]!r}, not {peer!r}"
    regions, blocks, num_blocks = header.get("regions"), header.get("blocks"), header.get("num_blocks")
    if not isinstance(regions, list) or len(regions) != len(ours["regions"]) or not all(map(is_int, regions)):
        return f"the producer's cache has {len(regions) if isinstance(regions, list) else '?'} layers, not " \
               f"{len(ours['regions'])}"
    if header.get("block_bytes") != ours["block_bytes"]:
        return f"the producer's blocks take {header.get('block_bytes')} bytes, not {ours['block_bytes']}"
    if not is_int(num_blocks) or not is_int(header.get("device")) or header.get("mem") not in ("DRAM", "VRAM"):
        return "a malformed answer (its cache's place)"
    if (not isinstance(blocks, list) or len(blocks) != count
            or not all(is_int(b) and 0 <= b < num_blocks for b in blocks)):
        return "the answer's blocks are not the transfer's"
    hold = header.get("hold_s")
    if not isinstance(hold, (int, float)) or isinstance(hold, bool):
        return "a malformed answer (its hold)"
    if hold <= HOLD_MARGIN_S:
        return f"the producer holds the blocks {hold:.2f} s more: too little to read them"
    return None
