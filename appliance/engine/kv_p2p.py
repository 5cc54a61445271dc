"""Disaggregated prefill (1P1D), scheduler side (torch-free):
``kv_transfer.connector=p2p``, vLLM's ``kv_transfer_params`` flow.

A **producer** runs a request's prefill. The client (a router's ``pd``
policy) asks for it with ``kv_transfer_params: {"do_remote_decode": true}``
and usually ``max_tokens=1``. As the request ends, ``request_finished``
keeps its blocks and returns where they are, and the response carries that
back as ``kv_transfer_params``:

    do_remote_prefill: true, do_remote_decode: false,
    remote_engine_id, remote_host, remote_port,
    remote_request_id (the transfer's id; an unguessable capability),
    remote_block_ids, remote_num_tokens (tokens whose KV the blocks hold)

A **consumer** is given the same prompt with those parameters. It allocates
blocks for the prompt except its last token (past any prefix-cache hits of
its own). It waits for them in WAITING_FOR_REMOTE_KVS while other requests
keep running. The worker side (``worker/kv_p2p.py``) pulls them over
ZeroMQ/TCP, checks they hold the same tokens (a digest of the token ids),
writes them, and releases the producer's copy. Then only the last prompt
token runs and the request decodes.

A load that fails (producer gone or restarted, timed out, other tokens,
another KV layout) is reported and the request computes its prompt itself:
nothing is lost. The producer frees a transfer's blocks once the consumer
releases them, or after ``timeout_s``.
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional

from appliance.engine.request import Request, RequestStatus

ROLES = ("producer", "consumer", "both")
REMOTE_PREFILL_KEYS = {"remote_engine_id": str, "remote_host": str, "remote_port": int, "remote_request_id": str,
                       "remote_block_ids": list, "remote_num_tokens": int}
MAX_ID_CHARS = 128


def token_digest(token_ids: list[int]) -> str:
    """What a producer's and a consumer's tokens are compared by."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()


def kv_transfer_problem(params: Any, connector: Optional[str], role: str, block_size: int) -> Optional[str]:
    """Why a request's ``kv_transfer_params`` (in ``params``, its sampling
    parameters) cannot run on an engine with this KV connector and role, or
    None. They are either ``do_remote_decode: true`` (a prefill for a
    consumer) or ``do_remote_prefill: true`` with every ``remote_*`` field a
    producer returned; other keys (a router's bookkeeping) are let through."""
    p = params.kv_transfer_params
    if p is None:
        return None
    if not isinstance(p, dict):
        return "must be an object"
    if connector != "p2p":
        return (f"asks for disaggregated prefill; this server's KV connector is {connector or 'none'} "
                f"(kv_transfer.connector=p2p does it)")
    decode, prefill = p.get("do_remote_decode", False), p.get("do_remote_prefill", False)
    if not isinstance(decode, bool) or not isinstance(prefill, bool):
        return "do_remote_decode and do_remote_prefill must be booleans"
    if decode and prefill:
        return "do_remote_decode and do_remote_prefill cannot both be true"
    if (decode or prefill) and params.n != 1:
        return "takes one sequence per request (n=1)"
    if decode and role == "consumer":
        return "do_remote_decode asks for a prefill; this server is a consumer (kv_transfer.role=consumer)"
    if not prefill:
        return None
    if role == "producer":
        return "do_remote_prefill asks to fetch KV; this server is a producer (kv_transfer.role=producer)"
    if params.prompt_logprobs is not None:
        return "do_remote_prefill fetches the prompt's KV instead of computing it; prompt_logprobs need it computed"
    for key, kind in REMOTE_PREFILL_KEYS.items():
        v = p.get(key)
        if not isinstance(v, kind) or isinstance(v, bool):
            return f"{key} must be {'an integer' if kind is int else 'a ' + kind.__name__.replace('str', 'string')}"
        if kind is str and not 0 < len(v) <= MAX_ID_CHARS:
            return f"{key} must hold 1 to {MAX_ID_CHARS} characters"
    if not 0 < p["remote_port"] < 65536:
        return "remote_port must be in 1..65535"
    if p["remote_num_tokens"] < 1:
        return "remote_num_tokens must be positive"
    ids = p["remote_block_ids"]
    if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2**31 for b in ids):
        return "remote_block_ids must be block ids (non-negative integers)"
    if len(ids) * block_size < p["remote_num_tokens"]:
        return f"remote_block_ids ({len(ids)} blocks of {block_size}) cannot hold remote_num_tokens tokens"
    return None


@dataclass
class RecvSpec:
    """Fill ``block_ids`` with the producer's ``remote_block_ids``: they hold
    the KV of the request's first ``num_tokens`` tokens (``token_digest``)."""

    request_id: str
    block_ids: list[int]
    remote_block_ids: list[int]
    num_tokens: int
    token_digest: str
    host: str
    port: int
    engine_id: str
    transfer_id: str


@dataclass
class SendSpec:
    """A finished request's blocks, held for a consumer for ``timeout_s``;
    ``token_ids``: the tokens whose KV they hold."""

    transfer_id: str
    request_id: str
    block_ids: list[int]
    token_ids: list[int]
    timeout_s: float


@dataclass
class P2PMetadata:
    """One step's instructions for the worker side."""

    recvs: list[RecvSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)


def _remote_prefill(request: Request) -> Optional[dict]:
    p = request.sampling_params.kv_transfer_params
    return p if p is not None and p.get("do_remote_prefill") else None


class P2PConnector:
    """Disaggregated prefill's scheduler side (see the module docstring)."""

    name = "p2p"

    def __init__(self, role: str, engine_id: str, host: str, port: int, block_size: int, timeout_s: float):
        self.role = role
        self.produces, self.consumes = role in ("producer", "both"), role in ("consumer", "both")
        self.engine_id, self.host, self.port = engine_id, host, port
        self.block_size, self.timeout_s = block_size, timeout_s
        self._meta = P2PMetadata()  # until build_connector_meta
        self.recving: dict[str, int] = {}  # request id -> tokens computed once its load is in, while in flight
        self._fetching: dict[str, int] = {}  # request id -> tokens its load brings (past its pool's hits)
        self.sending: set[str] = set()  # finished requests whose blocks wait for their consumer
        self._tried: set[str] = set()  # requests that asked for their remote KV once (a preempted one computes)
        self.loaded_tokens = 0  # tokens whose KV came from producers
        self.failed_loads = 0
        self.first_loaded_block: dict[str, int] = {}  # a step's loads (none here: they run between steps)

    @property
    def has_pending_meta(self) -> bool:
        """Instructions not handed to the worker side yet (one more step is due)."""
        return bool(self._meta.recvs or self._meta.sends)

    @property
    def has_transfers(self) -> bool:
        """Loads in flight, or blocks held for consumers: steps must keep
        coming to learn when they end."""
        return bool(self.recving or self.sending) or self.has_pending_meta

    # -- consumer -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens past ``num_computed_tokens`` a producer holds for this
        request, up to but not including its last token; loaded asynchronously)."""
        p = _remote_prefill(request) if self.consumes else None
        if p is None or request.request_id in self._tried:
            return 0, False
        end = min(request.num_tokens - 1, p["remote_num_tokens"])
        return (end - num_computed_tokens, True) if end > num_computed_tokens else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        """The blocks after the local hits (``block_ids``: the request's
        table) are to be filled from the producer's."""
        if num_external_tokens <= 0:
            return
        p, bs, rid = request.sampling_params.kv_transfer_params, self.block_size, request.request_id
        first, end = num_local_tokens // bs, num_local_tokens + num_external_tokens
        last = -(-end // bs)
        self._meta.recvs.append(RecvSpec(
            rid, block_ids[first:last], p["remote_block_ids"][first:last], end,
            token_digest(request.all_token_ids[:end]), p["remote_host"], p["remote_port"], p["remote_engine_id"],
            p["remote_request_id"]))
        self.recving[rid], self._fetching[rid] = end, num_external_tokens
        self._tried.add(rid)

    # -- both -----------------------------------------------------------------------
    def build_connector_meta(self, scheduled: dict[str, int], requests: dict[str, Request],
                             block_ids: Any) -> P2PMetadata:
        meta, self._meta = self._meta, P2PMetadata()
        return meta

    def update_connector_output(self, output: Any) -> None:
        if output is None:
            return
        for rid in output.finished_recving:
            self.recving.pop(rid, None)
            self.loaded_tokens += self._fetching.pop(rid, 0)
        for rid in output.failed_recving:
            self.recving.pop(rid, None)
            self._fetching.pop(rid, None)
            self.failed_loads += 1
        self.sending.difference_update(output.finished_sending)

    def step_failed(self, meta: Optional[P2PMetadata]) -> None:
        """A failed step may not have handed its instructions over: they go
        again with the next (the worker side ignores what it already has)."""
        if meta is not None:
            self._meta.recvs[:0], self._meta.sends[:0] = meta.recvs, meta.sends

    # -- producer -------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        """(whether the request's blocks must outlive it, what a consumer
        needs to fetch them). A load in flight writes into the blocks: they
        wait for it to end. A producer's finished prefill keeps them for its
        consumer."""
        rid = request.request_id
        if rid in self.recving:
            return True, None
        p = request.sampling_params.kv_transfer_params
        computed = min(request.num_computed_tokens, request.num_tokens)
        if (not self.produces or p is None or not p.get("do_remote_decode") or computed <= 0
                or request.status == RequestStatus.FINISHED_ABORTED):
            return False, None
        transfer_id = secrets.token_hex(16)
        self._meta.sends.append(SendSpec(transfer_id, rid, list(block_ids), request.all_token_ids[:computed],
                                         self.timeout_s))
        self.sending.add(rid)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                      "remote_host": self.host, "remote_port": self.port, "remote_request_id": transfer_id,
                      "remote_block_ids": list(block_ids), "remote_num_tokens": computed}
