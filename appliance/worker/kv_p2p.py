"""Disaggregated prefill's worker side (``kv_transfer.connector=p2p``; the
flow and the scheduler side: ``engine/kv_p2p.py``), over ZeroMQ/TCP.

A producer binds a ROUTER socket. Its server thread holds the transfers the
scheduler side registered as requests finished (``SendSpec``: blocks, the
tokens whose KV they hold, a deadline). A consumer's puller thread sends, on
a DEALER socket per load:

    [b"pull", msgpack {transfer, engine, layout, first, count, tokens}, mac]

``first`` and ``count`` say which of the transfer's blocks, in the
producer's own order, and ``tokens`` how many of its tokens the consumer
takes. The server answers

    [b"ok", msgpack {transfer, digest, shape, dtype, checksum}, payload, mac]

``digest`` is that of the transfer's first ``tokens`` token ids. The payload
is the blocks' K and V of every layer, ``[layers, 2, blocks, block_size,
kv_heads, head_dim]`` in the cache dtype, and ``checksum`` its SHA-256.
Otherwise it answers ``[b"error", reason, mac]``. Every message is signed
with the deployment's internal key (``mac``: ``engine/kv_p2p.seal``); one
that is not, or whose MAC does not match, is refused (the server answers it
with an error, the consumer fails the load).

The consumer checks the answer is for its transfer, the digest against its
own tokens, the shape against its cache, the payload against the checksum
and its values for NaN and infinity (``kv_checksum.layers_problem``). It
writes the blocks only then, sends ``[b"done", msgpack {transfer}, mac]``
(after a failed load too), and the producer frees the transfer's blocks.
Without a ``done``, they are freed at the deadline. A consumer that will
not fetch a transfer (its pool held the prompt, or the request ended) sends
the ``done`` alone.

A pull for a transfer that is not registered yet (its response can reach
the consumer before the producer's next step hands the registration over)
waits for it, up to the consumer's timeout (at most ``MAX_WAITING`` pulls
wait). An ended transfer (remembered, and never registered again),
another engine id (the producer restarted), another KV layout, or blocks
outside the transfer are refused at once. Messages to the server past
``MAX_MESSAGE`` bytes are dropped by ZeroMQ, and an answer no larger than
the blocks a consumer asked for is all it accepts. Both threads keep going
whatever one message does; a consumer's failed load is reported
(``failed_recving``) and the request computes its prompt.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, TypeGuard, cast

import msgspec
import torch

from appliance.engine.kv_connector import KVConnectorOutput
from appliance.engine.kv_p2p import P2PMetadata, RecvSpec, SendSpec, seal, token_digest, unseal
from appliance.worker.kv_checksum import dtype_name, gather_blocks, gathered_layers, layers_digest, layers_problem
from appliance.worker.kv_connector import KVConnectorWorker

log = logging.getLogger("appliance.kv_p2p")

POLL_MS = 20
READ_POLL_MS = 1  # while blocks are moving: how often to look
MAX_WAITING = 1024  # pulls waiting for their transfer's registration
MAX_ENDED = 100_000  # ended transfer ids remembered
MAX_MESSAGE = 1 << 16  # bytes of a message to the server


@dataclass
class _Send:
    spec: SendSpec
    deadline: float


@dataclass
class _Load:
    spec: RecvSpec
    socket: Any
    deadline: float
    reading: Any = None  # answered, its blocks still moving: what moves them (a NIXL transfer)
    checksum: Optional[str] = None  # of the blocks being read (their producer's), checked once they are in


READING: Any = object()  # a load whose answer started moving its blocks: not ended yet


_OPEN: "weakref.WeakSet[P2PWorker]" = weakref.WeakSet()  # workers whose threads run


@atexit.register
def _close_open_workers() -> None:
    """At the interpreter's exit, before it tears itself down: stop every
    worker still open (an engine nobody closed). Its daemon threads would
    otherwise go on into a transport's native calls (NIXL's) while the
    process unloads that library, which aborts the process."""
    for worker in list(_OPEN):
        worker.close()



def is_int(v: Any) -> TypeGuard[int]:
    """An int from a peer's message (a bool is not one)."""
    return isinstance(v, int) and not isinstance(v, bool)

class P2PWorker(KVConnectorWorker):
    """One rank's transfers (see the module docstring; nothing is saved per
    layer: a producer's blocks are read when their consumer asks). An engine core of
    several ranks has one per rank: rank k listens on the core's port + k
    and pulls from (and releases to) a producer's port + k, the producer's
    rank of its number (``peer_offset``), so each moves its own KV heads
    of its own layers."""

    def __init__(self, role: str, engine_id: str, layout: str, bind_host: str, port: int, timeout_s: float,
                 key: bytes, peer_offset: int = 0):
        import zmq

        self.engine_id, self.layout, self.timeout_s, self.peer_offset = engine_id, layout, timeout_s, peer_offset
        self._key = key  # the deployment's internal key: every message is signed with it
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._caches: Optional[list[torch.Tensor]] = None
        self._sends: dict[str, _Send] = {}  # transfer id -> what it holds (producer)
        self._ended: OrderedDict[str, None] = OrderedDict()  # transfer ids fetched or expired (producer)
        self._known: set[str] = set()  # requests whose instructions arrived (a failed step hands them over again)
        self._finished_sending: list[str] = []
        self._finished_recving: list[str] = []
        self._failed_recving: list[str] = []
        self._recvs: queue.Queue = queue.Queue()
        self._reading: list[_Load] = []  # loads whose blocks are moving (the puller's)
        self._stop = threading.Event()
        self._threads = []
        if role in ("producer", "both"):
            self._server = self._ctx.socket(zmq.ROUTER)
            self._server.setsockopt(zmq.LINGER, 0)
            self._server.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
            self._server.setsockopt(zmq.IPV6, int(":" in bind_host))  # "::" or an IPv6 address
            try:
                self._server.bind(f"tcp://{bind_host}:{port}")
            except zmq.ZMQError as e:
                self._server.close()
                self._ctx.term()
                raise OSError(f"kv_transfer.p2p: cannot listen on {bind_host}:{port}: {e}") from None
            self._threads.append(threading.Thread(target=self._serve, name="kv-p2p-server", daemon=True))
        if role in ("consumer", "both"):
            self._threads.append(threading.Thread(target=self._pull, name="kv-p2p-puller", daemon=True))
        for t in self._threads:
            t.start()
        _OPEN.add(self)

    # -- the model runner's calls ------------------------------------------------------
    @property
    def caches(self) -> list[torch.Tensor]:
        """The KV caches the model runner hands over with every step (transfers start with one)."""
        assert self._caches is not None, "no step has handed the KV caches over yet"
        return self._caches

    def start_load_kv(self, meta: Optional[P2PMetadata], kv_caches: list[torch.Tensor]) -> None:
        """Register the step's finished prefills for their consumers and start
        the step's loads (in the background; ``get_finished`` says when)."""
        self._caches = kv_caches
        if meta is None:
            return
        with self._lock:
            for spec in meta.sends:  # a failed step hands them over again: once is enough
                if spec.transfer_id not in self._sends and spec.transfer_id not in self._ended:
                    self._sends[spec.transfer_id] = _Send(spec, time.monotonic() + spec.timeout_s)
        for recv in meta.recvs:
            if recv.request_id not in self._known:
                self._known.add(recv.request_id)
                self._recvs.put(recv)
        for host, port, transfer in meta.releases:
            self._recvs.put((host, port + self.peer_offset, transfer))

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            out = KVConnectorOutput(finished_recving=self._finished_recving, failed_recving=self._failed_recving,
                                    finished_sending=self._finished_sending)
            self._finished_recving, self._failed_recving, self._finished_sending = [], [], []
        self._known.difference_update(out.finished_recving, out.failed_recving)
        return out

    def close(self) -> None:
        if self._stop.is_set():
            return
        _OPEN.discard(self)
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        self._ctx.destroy(linger=0)

    # -- producer -------------------------------------------------------------------------
    def _serve(self) -> None:
        import zmq

        sock = self._server
        waiting: dict[tuple, tuple[float, list]] = {}  # (client, transfer) -> (give up at, frames), not registered yet
        while not self._stop.is_set():
            try:
                if sock.poll(POLL_MS, zmq.POLLIN):
                    frames = sock.recv_multipart(copy=True)
                    key = self._answer(sock, frames)
                    if key is not None:
                        if len(waiting) < MAX_WAITING:
                            waiting[key] = (time.monotonic() + self.timeout_s, frames)
                        else:
                            self._reply(sock, frames[0], self._error(b"too many pulls waiting"))
                self._progress_agent()
                if waiting:
                    now = time.monotonic()
                    for key, (give_up, frames) in list(waiting.items()):
                        if self._answer(sock, frames, final=now >= give_up) is None:
                            del waiting[key]
                self._expire()
            except Exception:  # one bad message never stops the server
                log.exception("the KV transfer server failed")

    def _progress_agent(self) -> None:
        """Between the server's polls: nothing here (a transport with an agent to drive overrides it)."""

    def _error(self, reason: bytes) -> list:
        """A signed error answer."""
        return seal(self._key, b"error", reason)

    @staticmethod
    def _reply(sock: Any, ident: bytes, frames: list) -> None:
        import zmq

        try:  # the blocks' buffer goes out as it is (ZeroMQ keeps it alive until sent)
            sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            pass  # the client is gone, or not reading: its pull times out there

    def _answer(self, sock: Any, frames: list, final: bool = False) -> Optional[tuple]:
        """Answer one message; for a pull whose transfer is not registered
        yet (unless ``final``), its waiting key instead."""
        ident = frames[0]
        message = unseal(self._key, frames[1:])
        if message is None:
            self._reply(sock, ident, self._error(b"a message not signed with this deployment's internal key"))
            return None
        kind, body, extras = message
        try:
            if kind not in (b"pull", b"done") or extras:
                raise ValueError("not a pull or a done")
            msg = msgspec.msgpack.decode(body)
            transfer = msg["transfer"]
            if not isinstance(transfer, str):
                raise TypeError("transfer must be a string")
        except Exception as e:
            self._reply(sock, ident, self._error(f"malformed message: {e}"[:200].encode()))
            return None
        with self._lock:
            send = self._sends.get(transfer)
            if kind == b"done":
                if send is not None:
                    del self._sends[transfer]
                    self._close_transfer(transfer, send.spec.request_id)
                return None
            ended = transfer in self._ended
        if send is None:
            if not final and not ended and msg.get("engine") == self.engine_id:
                return ident, transfer
            self._reply(sock, ident, self._error(b"unknown or ended transfer (or another engine)"))
            return None
        try:
            reply = self._blocks_of(send, msg)
        except Exception as e:  # never leave a consumer waiting for its timeout
            log.exception("answering a pull of transfer %s failed", transfer)
            reply = self._error(f"{type(e).__name__}: {e}"[:200].encode())
        self._reply(sock, ident, reply)
        return None

    def _close_transfer(self, transfer: str, request_id: str) -> None:
        """(under the lock) A transfer's blocks may be freed; it is never served again."""
        self._finished_sending.append(request_id)
        self._ended[transfer] = None
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)

    def _blocks_of(self, send: _Send, msg: dict) -> list:
        """The reply to a pull: the blocks it names, or why not."""
        spec = send.spec
        first, count, tokens = msg.get("first"), msg.get("count"), msg.get("tokens")
        if msg.get("engine") != self.engine_id:
            return self._error(b"another engine (the producer restarted)")
        if msg.get("layout") != self.layout:
            return self._error(b"another KV layout (model, dtype or block shape differ)")
        n = len(spec.block_ids)
        if (not (is_int(first) and is_int(count) and is_int(tokens))
                or not 0 <= first < first + count <= n or not 0 < tokens <= len(spec.token_ids)):
            return self._error(b"blocks or tokens outside the transfer")
        return self._serve_blocks(send, first, count, tokens, msg)

    def _serve_blocks(self, send: _Send, first: int, count: int, tokens: int, msg: dict) -> list:
        """The answer to a valid pull of the transfer's blocks ``first`` to
        ``first + count``: their K and V and its checksum, with the digest of
        its first ``tokens`` tokens."""
        spec, caches = send.spec, self.caches
        data = gather_blocks(caches, spec.block_ids[first:first + count])
        shape = [len(caches), caches[0].shape[0], count, *caches[0].shape[2:]]
        header = msgspec.msgpack.encode({"transfer": spec.transfer_id, "digest": token_digest(spec.token_ids[:tokens]),
                                         "shape": shape, "dtype": dtype_name(caches[0].dtype),
                                         "checksum": layers_digest(gathered_layers(data))})
        return seal(self._key, b"ok", header, memoryview(cast(Any, data.numpy())))

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for tid in [t for t, s in self._sends.items() if s.deadline <= now]:
                send = self._sends.pop(tid)
                self._close_transfer(tid, send.spec.request_id)
                log.warning("no consumer fetched the KV of request %s within %g s; its blocks are freed",
                            send.spec.request_id, send.spec.timeout_s)

    # -- consumer ---------------------------------------------------------------------------
    def _pull(self) -> None:
        import zmq

        poller = zmq.Poller()
        loads: dict[Any, _Load] = {}  # pulls waiting for their answer, by socket
        reading = self._reading
        while not self._stop.is_set():
            try:
                specs = []
                if not loads and not reading:
                    try:
                        specs.append(self._recvs.get(timeout=POLL_MS / 1000))
                    except queue.Empty:
                        continue
                while not self._recvs.empty():
                    specs.append(self._recvs.get_nowait())
                for spec in specs:
                    if isinstance(spec, tuple):
                        self._release(*spec)
                        continue
                    try:
                        load = self._start(spec)
                    except Exception as e:  # an address ZeroMQ cannot use
                        self._report(spec, f"{type(e).__name__}: {e}")
                        continue
                    loads[load.socket] = load
                    poller.register(load.socket, zmq.POLLIN)
                wait_ms = READ_POLL_MS if reading else POLL_MS
                if loads:
                    ready = dict(poller.poll(wait_ms))
                else:
                    ready = {}
                    time.sleep(wait_ms / 1000)
                now = time.monotonic()
                for sock, load in list(loads.items()):
                    if sock in ready:
                        try:
                            error = self._receive(load)
                        except Exception as e:  # a malformed answer fails this load only
                            error = f"{type(e).__name__}: {e}"
                    elif now >= load.deadline:
                        error = f"no answer within {self.timeout_s:g} s"
                    else:
                        continue
                    poller.unregister(sock)
                    del loads[sock]
                    if error is READING:
                        reading.append(load)
                    else:
                        self._end(load, error)
                for load in list(reading):
                    error = self._progress(load, now)
                    if error is not READING:
                        reading.remove(load)
                        self._end(load, error)
            except Exception:
                log.exception("the KV transfer puller failed")

    def _socket(self, host: str, port: int, max_message: int) -> Any:
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.IPV6, int(":" in host))  # IPv6 for IPv6 addresses only: "localhost" stays IPv4
        sock.setsockopt(zmq.MAXMSGSIZE, max_message)
        try:
            sock.connect(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
        except Exception:
            sock.close()
            raise
        return sock

    def _release(self, host: str, port: int, transfer: str) -> None:
        """Tell a producer its transfer will not be fetched (best effort)."""
        import zmq

        try:
            sock = self._socket(host, port, MAX_MESSAGE)
        except Exception as e:
            log.warning("cannot release a KV transfer at %s:%d: %s", host, port, e)
            return
        try:
            sock.send_multipart(self._done(transfer), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        finally:
            sock.close()

    def _done(self, transfer: str) -> list:
        """The signed message that ends a transfer at its producer."""
        return seal(self._key, b"done", msgspec.msgpack.encode({"transfer": transfer}))

    def _start(self, spec: RecvSpec) -> _Load:
        import zmq

        sock = self._socket(spec.host, spec.port + self.peer_offset, self._answer_bytes(spec) + MAX_MESSAGE)
        sock.send_multipart(flags=zmq.NOBLOCK, msg_parts=seal(self._key, b"pull", msgspec.msgpack.encode({
            "transfer": spec.transfer_id, "engine": spec.engine_id, "layout": self.layout,
            "first": spec.first_block, "count": len(spec.block_ids), "tokens": spec.num_tokens,
            **self._pull_fields(spec)})))
        return _Load(spec, sock, time.monotonic() + self.timeout_s)

    def _answer_bytes(self, spec: RecvSpec) -> int:
        """The most an answer to a pull of ``spec`` may take (past its header): the blocks' K and V."""
        like = self.caches[0]
        return len(self.caches) * like[:, 0].numel() * like.element_size() * len(spec.block_ids)

    def _pull_fields(self, spec: RecvSpec) -> dict:
        """What else a pull asks for (none here)."""
        return {}

    def _receive(self, load: _Load) -> Optional[str]:
        """Take a pull's answer; why it could not be, None once its blocks
        are in, or ``READING`` while they move (``_progress``)."""
        message = unseal(self._key, load.socket.recv_multipart(copy=False))  # the payload stays where it arrived
        if message is None:
            return "an answer not signed with this deployment's internal key (the producer's key differs?)"
        kind, body, extras = message
        if kind == b"error" and not extras:
            return body.decode(errors="replace")[:200]
        if kind != b"ok" or len(extras) != 1:
            return "a malformed answer"
        header = msgspec.msgpack.decode(body)
        if not isinstance(header, dict) or header.get("transfer") != load.spec.transfer_id:
            return "an answer for another transfer"
        if header.get("digest") != load.spec.token_digest:
            return "the producer's blocks hold other tokens"
        return self._take(load, header, extras[0])

    def _take(self, load: _Load, header: dict, payload_frame: Any) -> Optional[str]:
        """Write the blocks a valid answer carries; why it could not be, or None."""
        spec, caches = load.spec, self.caches
        like = caches[0]
        shape = [len(caches), like.shape[0], len(spec.block_ids), *like.shape[2:]]
        if header.get("shape") != shape or header.get("dtype") != dtype_name(like.dtype):
            log.debug("request %s: the producer sent blocks of shape %s %s, not %s %s", spec.request_id,
                      header.get("shape"), header.get("dtype"), shape, dtype_name(like.dtype))
            return "blocks of another KV layout"
        payload = payload_frame.buffer
        if payload.nbytes != like.element_size() * int(torch.Size(shape).numel()):
            return "a truncated payload"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only bytes: only read
            data = torch.frombuffer(payload, dtype=torch.uint8).view(*shape[:-1], shape[-1] * like.element_size())
        problem = layers_problem(gathered_layers(data), like.dtype, header.get("checksum"))
        if problem is not None:
            return problem
        ids = torch.tensor(spec.block_ids, dtype=torch.long, device=like.device)
        for layer, cache in enumerate(caches):  # as bytes: any cache dtype
            cache.view(torch.uint8).index_copy_(1, ids, data[layer].to(like.device))
        return None

    def _progress(self, load: _Load, now: float) -> Optional[str]:
        """A ``READING`` load's state: ``READING`` while its blocks move,
        None once they are in, or why they could not be (none here: the
        blocks come in the answer)."""
        raise NotImplementedError

    def _end(self, load: _Load, error: Optional[str]) -> None:
        import zmq

        try:  # the producer frees its copy (after a failure too)
            load.socket.send_multipart(self._done(load.spec.transfer_id), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # it never connected: its deadline frees the blocks
        finally:
            load.socket.close()
            self._report(load.spec, error)

    def _report(self, spec: RecvSpec, error: Optional[str]) -> None:
        with self._lock:
            (self._finished_recving if error is None else self._failed_recving).append(spec.request_id)
        if error is not None:
            log.warning("request %s: its KV could not be fetched from %s:%d (%s); it computes its prompt",
                        spec.request_id, spec.host, spec.port, error)
