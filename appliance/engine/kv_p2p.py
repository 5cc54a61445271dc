"""Disaggregated prefill (1P1D), scheduler side (torch-free):
``kv_transfer.connector=p2p`` or ``nixl``, vLLM's ``kv_transfer_params`` flow.

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
blocks for the whole prompt past any prefix-cache hits of its own, to be
filled with the KV of all but its last token, and waits for them in
WAITING_FOR_REMOTE_KVS while other requests keep running. The worker side
(``worker/kv_p2p.py``) pulls them over ZeroMQ/TCP, or (connector ``nixl``,
``worker/kv_nixl.py``) reads them out of the producer's cache through NIXL,
checks they hold the same tokens (a digest of the token ids), and releases
the producer's copy. Then only the last prompt token runs and the request
decodes.

A load that fails (producer gone or restarted, timed out, other tokens,
another KV layout, KV that fails its checks) is reported and the request
computes its prompt itself: nothing is lost. The producer frees a
transfer's blocks once the consumer releases them, or after ``timeout_s``.

Trust. Producer and consumer sign every message between them with the
deployment's internal key (``seal``/``unseal``: an HMAC-SHA256 over the
message kind and body; a body names the SHA-256 of any bytes beside it, so
the blocks a producer sends are covered too), and a consumer writes no
block whose bytes do not match the checksum its producer computed or hold
a NaN or infinity. Over HTTP, ``kv_transfer_params`` come from this
deployment's router (a request signed with the same key) or name a producer
in ``kv_transfer.p2p.trusted_producers`` (``kv_transfer_trust_problem``);
anything else is refused before any connection is made, so every block a
consumer caches came from a producer it trusts.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from appliance.engine.kv_connector import KVConnectorOutput, RankTally
from appliance.engine.request import Request, RequestStatus
from appliance.sampling_params import SamplingParams

log = logging.getLogger("appliance.kv_p2p")

ROLES = ("producer", "consumer", "both")
DISAGGREGATED_PREFILL = ("p2p", "nixl")  # connectors of this flow: the blocks over ZeroMQ/TCP, or read through NIXL
REMOTE_PREFILL_KEYS = {"remote_engine_id": str, "remote_host": str, "remote_port": int, "remote_request_id": str,
                       "remote_block_ids": list, "remote_num_tokens": int}
MAX_ID_CHARS = 128


def token_digest(token_ids: list[int]) -> str:
    """What a producer's and a consumer's tokens are compared by."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()


MAC_DOMAIN = b"appliance-kv-transfer-v1\0"
MAC_BYTES = 32


def _mac(key: bytes, kind: bytes, body: bytes) -> bytes:
    return hmac.new(key, MAC_DOMAIN + kind + b"\0" + body, hashlib.sha256).digest()


def seal(key: bytes, kind: bytes, body: bytes, *extras: object) -> list:
    """The frames of one message between a producer and a consumer:
    ``[kind, body, *extras, mac]``; the MAC covers the kind and the body
    (whose fields give the digest of any extra frame that matters)."""
    return [kind, body, *extras, _mac(key, kind, body)]


def unseal(key: bytes, frames: list) -> Optional[tuple[bytes, bytes, list]]:
    """``(kind, body, extras)`` of a message signed with ``key``, or None
    (too few frames, or a MAC that does not match: another key, or altered
    on the way). Frames may be bytes or ZeroMQ frames; the extras are
    returned as they came."""
    if len(frames) < 3:
        return None
    kind, body, mac = (f if isinstance(f, bytes) else f.bytes for f in (frames[0], frames[1], frames[-1]))
    if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, _mac(key, kind, body)):
        return None
    return kind, body, list(frames[2:-1])


def producer_address(host: str, port: int) -> str:
    """``host:port`` as ``kv_transfer.p2p.trusted_producers`` lists producers (IPv6 hosts bracketed)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def kv_transfer_trust_problem(params: dict, internal: bool, trusted_producers: Sequence[str]) -> Optional[str]:
    """Why a request's well-formed ``kv_transfer_params`` are not to be
    acted on, or None: they come from this deployment's router (``internal``:
    the request is signed with the deployment's internal key), or they ask
    this consumer to fetch from a producer in ``trusted_producers``
    (``host:port``, or a host alone for any of its ports)."""
    if internal:
        return None
    how = ("are taken from this deployment's router (a request signed with its internal key, server.internal_key) "
           "or naming a producer in kv_transfer.p2p.trusted_producers")
    if not params.get("do_remote_prefill"):
        return f"ask this server to hold KV for a consumer; kv_transfer_params {how}"
    host, port = params["remote_host"], params["remote_port"]
    bare = f"[{host}]" if ":" in host else host
    if producer_address(host, port) in trusted_producers or bare in trusted_producers:
        return None
    return f"name producer {producer_address(host, port)[:200]}, which this server does not trust; " \
           f"kv_transfer_params {how}"


KV_TRANSFER_KEYS = ("do_remote_decode", "do_remote_prefill", *REMOTE_PREFILL_KEYS, "tp_size")


def kv_transfer_problem(params: SamplingParams, connector: Optional[str], role: str,
                        block_size: int) -> Optional[str]:
    """Why a request's ``kv_transfer_params`` (in ``params``, its sampling
    parameters) cannot run on an engine with this KV connector and role, or
    None. They are either ``do_remote_decode: true`` (a prefill for a
    consumer; ``remote_*`` fields may be present as null, as vLLM's proxies
    send them) or ``do_remote_prefill: true`` with every ``remote_*`` field
    a producer returned. Other keys are refused, not ignored."""
    p = params.kv_transfer_params
    if p is None:
        return None
    if not isinstance(p, dict):
        return "must be an object"
    if connector not in DISAGGREGATED_PREFILL:
        return (f"asks for disaggregated prefill; this server's KV connector is {connector or 'none'} "
                f"(kv_transfer.connector={' or '.join(DISAGGREGATED_PREFILL)} does it)")
    unknown = [k for k in p if k not in KV_TRANSFER_KEYS]
    if unknown:
        return f"has unknown key(s) {', '.join(map(repr, unknown[:4]))[:200]}; known: {', '.join(KV_TRANSFER_KEYS)}"
    decode, prefill = p.get("do_remote_decode", False), p.get("do_remote_prefill", False)
    if not isinstance(decode, bool) or not isinstance(prefill, bool):
        return "do_remote_decode and do_remote_prefill must be booleans"
    if decode and prefill:
        return "do_remote_decode and do_remote_prefill cannot both be true"
    if not decode and not prefill:
        return "asks for nothing: do_remote_decode (a prefill for a consumer) or do_remote_prefill (fetch it)"
    if params.n != 1:
        return "takes one sequence per request (n=1)"
    if decode:
        if role == "consumer":
            return "do_remote_decode asks for a prefill; this server is a consumer (kv_transfer.role=consumer)"
        given = [k for k in REMOTE_PREFILL_KEYS if p.get(k) is not None]
        return f"do_remote_decode with {', '.join(given)} set: those come from a producer" if given else None
    if role == "producer":
        return "do_remote_prefill asks to fetch KV; this server is a producer (kv_transfer.role=producer)"
    if params.prompt_logprobs is not None:
        return "do_remote_prefill fetches the prompt's KV instead of computing it; prompt_logprobs need it computed"
    for key, kind in REMOTE_PREFILL_KEYS.items():
        v = p.get(key)
        if not isinstance(v, kind) or isinstance(v, bool):
            return f"{key} must be {'an integer' if kind is int else 'a ' + kind.__name__.replace('str', 'string')}"
        if isinstance(v, str) and not 0 < len(v) <= MAX_ID_CHARS:
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
    """Fill ``block_ids`` with the producer's blocks ``first_block`` on, in
    the producer's own order: they hold the KV of the request's first
    ``num_tokens`` tokens (``token_digest``)."""

    request_id: str
    block_ids: list[int]
    first_block: int
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
    # (host, port, transfer id) of producers' transfers a consumer will not fetch (its pool held the prompt,
    # or the request ended first): released at once instead of held until their timeout
    releases: list[tuple[str, int, str]] = field(default_factory=list)


def _remote_prefill(request: Request) -> Optional[dict]:
    p = request.sampling_params.kv_transfer_params
    return p if p is not None and p.get("do_remote_prefill") else None


class P2PConnector:
    """Disaggregated prefill's scheduler side (see the module docstring).
    Whatever a lost worker report would leave open is closed after
    ``timeout_s`` + ``GRACE_S`` (``overdue``): a load counts as failed, a
    transfer as ended (the worker side ends both within ``timeout_s``)."""

    GRACE_S = 30.0

    def __init__(self, role: str, engine_id: str, host: str, port: int, block_size: int, timeout_s: float,
                 max_held_blocks: int, ranks: int = 1, name: str = "p2p"):
        self.name, self.role, self.ranks = name, role, ranks
        self._ended = RankTally(ranks)  # several ranks: which ranks ended a load or a transfer
        self._failed_on: set[str] = set()  # loads some rank failed
        self.produces, self.consumes = role in ("producer", "both"), role in ("consumer", "both")
        self.engine_id, self.host, self.port = engine_id, host, port
        self.block_size, self.timeout_s, self.max_held_blocks = block_size, timeout_s, max_held_blocks
        self._meta = P2PMetadata()  # until build_connector_meta
        self.recving: dict[str, int] = {}  # request id -> tokens computed once its load is in, while in flight
        self._fetching: dict[str, int] = {}  # request id -> tokens its load brings (past its pool's hits)
        self.sending: dict[str, int] = {}  # finished requests whose blocks wait for their consumer -> blocks
        self._deadlines: dict[str, float] = {}  # recving and sending: when to stop waiting for the worker side
        self._tried: set[str] = set()  # live requests that asked for their remote KV (a preempted one computes)
        self.loaded_tokens = 0  # tokens whose KV came from producers
        self.failed_loads = 0
        self.first_loaded_block: dict[str, int] = {}  # a step's loads (none here: they run between steps)
        self.corrupt_blocks = 0  # none: nothing is stored (a failed pull is failed_loads, recomputed)

    @property
    def has_pending_meta(self) -> bool:
        """Instructions not handed to the worker side yet (one more step is due)."""
        m = self._meta
        return bool(m.recvs or m.sends or m.releases)

    @property
    def has_transfers(self) -> bool:
        """Loads in flight, or blocks held for consumers: steps must keep
        coming to learn when they end."""
        return bool(self.recving or self.sending) or self.has_pending_meta

    # -- consumer -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens past ``num_computed_tokens`` a producer holds for this
        request, up to but not including its last token; loaded
        asynchronously). A producer's transfer this request does not need
        (its pool holds them) is released."""
        p = _remote_prefill(request) if self.consumes else None
        if p is None or request.request_id in self._tried:
            return 0, False
        end = min(request.num_tokens - 1, p["remote_num_tokens"])
        if end > num_computed_tokens:
            return end - num_computed_tokens, True
        self._release(request)
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None:
        """The blocks after the local hits (``block_ids``: the request's
        table) are to be filled from the producer's."""
        if num_external_tokens <= 0:
            return
        p, bs, rid = request.sampling_params.kv_transfer_params, self.block_size, request.request_id
        assert p is not None  # get_num_new_matched_tokens offered tokens for its remote prefill
        first, end = num_local_tokens // bs, num_local_tokens + num_external_tokens
        last = -(-end // bs)
        self._meta.recvs.append(RecvSpec(
            rid, block_ids[first:last], first, end, token_digest(request.all_token_ids[:end]), p["remote_host"],
            p["remote_port"], p["remote_engine_id"], p["remote_request_id"]))
        self.recving[rid], self._fetching[rid] = end, num_external_tokens
        self._deadlines[rid] = time.monotonic() + self.timeout_s + self.GRACE_S
        self._tried.add(rid)

    def _release(self, request: Request) -> None:
        p = request.sampling_params.kv_transfer_params
        assert p is not None  # a request that asked for its remote prefill
        self._tried.add(request.request_id)
        self._meta.releases.append((p["remote_host"], p["remote_port"], p["remote_request_id"]))

    # -- both -----------------------------------------------------------------------
    def build_connector_meta(self, scheduled: dict[str, int], requests: dict[str, Request],
                             block_ids: Callable[[str], list[int]]) -> P2PMetadata:
        meta, self._meta = self._meta, P2PMetadata()
        return meta

    def update_connector_output(self, output: Optional[KVConnectorOutput]) -> None:
        if output is None:
            return
        for rid in output.finished_recving:
            self.recving.pop(rid, None)
            self._deadlines.pop(rid, None)
            self.loaded_tokens += self._fetching.pop(rid, 0)
        for rid in output.failed_recving:
            self.recving.pop(rid, None)
            self._deadlines.pop(rid, None)
            self._fetching.pop(rid, None)
            self.failed_loads += 1
        for rid in output.finished_sending:
            self.sending.pop(rid, None)
            self._deadlines.pop(rid, None)

    def combine_ranks(self, output: KVConnectorOutput) -> KVConnectorOutput:
        """The whole report of an engine core's ranks' (``output.by_rank``;
        each rank moves its KV heads of its layers, from the producer's rank
        of the same number): a load ends once every rank's part has ended,
        failed if any part failed (so no rank still writes into blocks a
        failed load gives back); a transfer ends once every rank's has."""
        whole = KVConnectorOutput()
        for rank, o in enumerate(output.by_rank or []):
            self._failed_on.update(o.failed_recving)
            for rid in [*o.finished_recving, *o.failed_recving]:
                if self._ended.add(("recv", rid), rank):
                    failed = rid in self._failed_on
                    self._failed_on.discard(rid)
                    (whole.failed_recving if failed else whole.finished_recving).append(rid)
            whole.finished_sending += [rid for rid in o.finished_sending if self._ended.add(("send", rid), rank)]
        return whole

    def overdue(self) -> Any:
        """A report of the loads and transfers the worker side should have
        ended by now (as failed loads and ended transfers), or None."""
        now = time.monotonic()
        late = [rid for rid, t in self._deadlines.items() if t <= now]
        if not late:
            return None
        for rid in late:  # what some ranks reported of them is moot
            self._ended.forget(("recv", rid))
            self._ended.forget(("send", rid))
            self._failed_on.discard(rid)
        log.error("KV transfers of %d request(s) had no word from the worker side past their timeout; ended", len(late))
        return KVConnectorOutput(failed_recving=[r for r in late if r in self.recving],
                                 finished_sending=[r for r in late if r in self.sending])

    def step_failed(self, meta: Optional[P2PMetadata]) -> None:
        """A failed step may not have handed its instructions over: they go
        again with the next (the worker side ignores what it already had)."""
        if meta is not None:
            m = self._meta
            m.recvs[:0], m.sends[:0], m.releases[:0] = meta.recvs, meta.sends, meta.releases

    # -- producer -------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        """(whether the request's blocks must outlive it, what a consumer
        needs to fetch them). A load in flight writes into the blocks: they
        wait for it to end. A producer's finished prefill keeps them for its
        consumer, while what it holds for consumers stays under
        ``max_held_blocks``."""
        rid = request.request_id
        if rid in self.recving:
            self._tried.discard(rid)
            return True, None
        if _remote_prefill(request) is not None and self.consumes and rid not in self._tried:
            self._release(request)  # ended before it fetched: the producer need not wait
        self._tried.discard(rid)
        p = request.sampling_params.kv_transfer_params
        computed = min(request.num_computed_tokens, request.num_tokens)
        if (not self.produces or p is None or not p.get("do_remote_decode") or computed <= 0
                or request.status == RequestStatus.FINISHED_ABORTED):
            return False, None
        if sum(self.sending.values()) + len(block_ids) > self.max_held_blocks:
            log.warning("request %s: the blocks held for consumers would pass %d; its KV is not kept (the consumer "
                        "computes the prompt)", rid, self.max_held_blocks)
            return False, None
        transfer_id = secrets.token_hex(16)
        self._meta.sends.append(SendSpec(transfer_id, rid, list(block_ids), request.all_token_ids[:computed],
                                         self.timeout_s))
        self.sending[rid] = len(block_ids)
        self._deadlines[rid] = time.monotonic() + self.timeout_s + self.GRACE_S
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                      "remote_host": self.host, "remote_port": self.port, "remote_request_id": transfer_id,
                      "remote_block_ids": list(block_ids), "remote_num_tokens": computed}
