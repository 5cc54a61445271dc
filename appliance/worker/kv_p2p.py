"""Disaggregated prefill's worker side (``kv_transfer.connector=p2p``; the
flow and the scheduler side: ``engine/kv_p2p.py``), over ZeroMQ/TCP.

A producer binds a ROUTER socket. Its server thread holds the transfers the
scheduler side registered as requests finished (``SendSpec``: blocks, the
tokens whose KV they hold, a deadline). A consumer's puller thread sends, on
a DEALER socket per load:

    [b"pull", msgpack {transfer, engine, layout, blocks, tokens}]

``blocks`` are remote block ids of that transfer, and ``tokens`` is how many
of its tokens the consumer takes. The server answers

    [b"ok", msgpack {digest, shape, dtype}, payload]

``digest`` is that of the transfer's first ``tokens`` token ids. The payload
is the blocks' K and V of every layer, ``[layers, 2, blocks, block_size,
kv_heads, head_dim]`` in the cache dtype. Otherwise it answers
``[b"error", reason]``.

The consumer checks the digest against its own tokens and the shape against
its cache. It writes the blocks, then sends ``[b"done", msgpack {transfer}]``
(after a failed load too), and the producer frees the transfer's blocks.
Without a ``done``, they are freed at the deadline.

A pull for a transfer that is not registered yet (its response can reach
the consumer before the producer's next step hands the registration over)
waits for it, up to the consumer's timeout. An unknown or expired transfer,
another engine id (the producer restarted), another KV layout, or blocks
outside the transfer are refused. Both threads keep going whatever one
message does; a consumer's failed load is reported (``failed_recving``)
and the request computes its prompt.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import msgspec
import torch

from appliance.engine.kv_connector import KVConnectorOutput
from appliance.engine.kv_p2p import P2PMetadata, RecvSpec, SendSpec, token_digest

log = logging.getLogger("appliance.kv_p2p")

POLL_MS = 20


@dataclass
class _Send:
    spec: SendSpec
    deadline: float


@dataclass
class _Load:
    spec: RecvSpec
    socket: Any
    deadline: float


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class P2PWorker:
    def __init__(self, role: str, engine_id: str, layout: str, bind_host: str, port: int, timeout_s: float):
        import zmq

        self.engine_id, self.layout, self.timeout_s = engine_id, layout, timeout_s
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._caches: Optional[list[torch.Tensor]] = None
        self._sends: dict[str, _Send] = {}  # transfer id -> what it holds (producer)
        self._known: set[str] = set()  # requests whose instructions arrived (a failed step hands them over again)
        self._finished_sending: list[str] = []
        self._finished_recving: list[str] = []
        self._failed_recving: list[str] = []
        self._recvs: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._threads = []
        if role in ("producer", "both"):
            self._server = self._ctx.socket(zmq.ROUTER)
            self._server.setsockopt(zmq.LINGER, 0)
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

    # -- the model runner's calls ------------------------------------------------------
    def start_load_kv(self, meta: Optional[P2PMetadata], kv_caches: list[torch.Tensor]) -> None:
        """Register the step's finished prefills for their consumers and start
        the step's loads (in the background; ``get_finished`` says when)."""
        self._caches = kv_caches
        if meta is None:
            return
        with self._lock:
            for spec in meta.sends:
                if spec.transfer_id not in self._sends:
                    self._sends[spec.transfer_id] = _Send(spec, time.monotonic() + spec.timeout_s)
        for spec in meta.recvs:
            if spec.request_id not in self._known:
                self._known.add(spec.request_id)
                self._recvs.put(spec)

    def save(self, meta: Optional[P2PMetadata], kv_caches: list[torch.Tensor]) -> None:
        """Nothing: a producer's blocks are read when their consumer asks."""

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            out = KVConnectorOutput(finished_recving=self._finished_recving, failed_recving=self._failed_recving,
                                    finished_sending=self._finished_sending)
            self._finished_recving, self._failed_recving, self._finished_sending = [], [], []
        self._known.difference_update(out.finished_recving, out.failed_recving)
        return out

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        self._ctx.destroy(linger=0)

    # -- producer -------------------------------------------------------------------------
    def _serve(self) -> None:
        import zmq

        sock = self._server
        waiting: list[tuple[float, list]] = []  # (give up at, frames) of pulls for transfers not registered yet
        while not self._stop.is_set():
            try:
                if sock.poll(POLL_MS, zmq.POLLIN):
                    frames = sock.recv_multipart(copy=True)
                    if not self._answer(sock, frames):
                        waiting.append((time.monotonic() + self.timeout_s, frames))
                if waiting:
                    now = time.monotonic()
                    still = []
                    for give_up, frames in waiting:
                        if self._answer(sock, frames, final=now >= give_up) is False:
                            still.append((give_up, frames))
                    waiting = still
                self._expire()
            except Exception:  # one bad message never stops the server
                log.exception("the KV transfer server failed on a message")

    def _answer(self, sock: Any, frames: list, final: bool = False) -> Optional[bool]:
        """Answer one message: True when answered, False for a pull whose
        transfer is not registered yet (unless ``final``)."""
        if len(frames) != 3 or frames[1] not in (b"pull", b"done"):
            if len(frames) >= 1:
                sock.send_multipart([frames[0], b"error", b"malformed message"])
            return True
        ident, kind, body = frames
        try:
            msg = msgspec.msgpack.decode(body)
            transfer = msg["transfer"]
            if not isinstance(transfer, str):
                raise TypeError("transfer must be a string")
        except Exception as e:
            sock.send_multipart([ident, b"error", f"malformed message: {e}".encode()])
            return True
        with self._lock:
            send = self._sends.get(transfer)
            if kind == b"done":
                if send is not None:
                    del self._sends[transfer]
                    self._finished_sending.append(send.spec.request_id)
                return True
        if send is None:
            if not final and msg.get("engine") == self.engine_id:
                return False
            sock.send_multipart([ident, b"error", b"unknown or expired transfer (or another engine)"])
            return True
        sock.send_multipart([ident, *self._blocks_of(send.spec, msg)])
        return True

    def _blocks_of(self, spec: SendSpec, msg: dict) -> list:
        """The reply to a pull: the blocks it names, or why not."""
        blocks, tokens = msg.get("blocks"), msg.get("tokens")
        if msg.get("engine") != self.engine_id:
            return [b"error", b"another engine (the producer restarted)"]
        if msg.get("layout") != self.layout:
            return [b"error", b"another KV layout (model, dtype or block shape differ)"]
        if (not isinstance(blocks, list) or not blocks or not set(blocks) <= set(spec.block_ids)
                or not isinstance(tokens, int) or not 0 < tokens <= len(spec.token_ids)):
            return [b"error", b"blocks or tokens outside the transfer"]
        caches = self._caches
        ids = torch.tensor(blocks, dtype=torch.long)
        data = torch.stack([c.index_select(1, ids) for c in caches]).contiguous()
        header = msgspec.msgpack.encode({"digest": token_digest(spec.token_ids[:tokens]), "shape": list(data.shape),
                                         "dtype": _dtype_name(data.dtype)})
        return [b"ok", header, data.view(torch.uint8).numpy().tobytes()]

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for tid in [t for t, s in self._sends.items() if s.deadline <= now]:
                send = self._sends.pop(tid)
                self._finished_sending.append(send.spec.request_id)
                log.warning("no consumer fetched the KV of request %s within %g s; its blocks are freed",
                            send.spec.request_id, send.spec.timeout_s)

    # -- consumer ---------------------------------------------------------------------------
    def _pull(self) -> None:
        import zmq

        poller = zmq.Poller()
        loads: dict[Any, _Load] = {}
        while not self._stop.is_set():
            try:
                specs = []
                if not loads:
                    try:
                        specs.append(self._recvs.get(timeout=POLL_MS / 1000))
                    except queue.Empty:
                        continue
                while not self._recvs.empty():
                    specs.append(self._recvs.get_nowait())
                for spec in specs:
                    try:
                        load = self._start(spec)
                    except Exception as e:  # an address ZeroMQ cannot use
                        self._report(spec, f"{type(e).__name__}: {e}")
                        continue
                    loads[load.socket] = load
                    poller.register(load.socket, zmq.POLLIN)
                ready = dict(poller.poll(POLL_MS)) if loads else {}
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
                    self._end(load, error)
            except Exception:
                log.exception("the KV transfer puller failed")

    def _start(self, spec: RecvSpec) -> _Load:
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        host = f"[{spec.host}]" if ":" in spec.host else spec.host
        sock.connect(f"tcp://{host}:{spec.port}")
        sock.send_multipart(flags=zmq.NOBLOCK, msg_parts=[b"pull", msgspec.msgpack.encode({
            "transfer": spec.transfer_id, "engine": spec.engine_id, "layout": self.layout,
            "blocks": spec.remote_block_ids, "tokens": spec.num_tokens})])
        return _Load(spec, sock, time.monotonic() + self.timeout_s)

    def _receive(self, load: _Load) -> Optional[str]:
        """Write a pull's answer into the blocks; why it could not be, or None."""
        frames = load.socket.recv_multipart(copy=True)
        if frames[0] == b"error" and len(frames) == 2:
            return frames[1].decode(errors="replace")
        if frames[0] != b"ok" or len(frames) != 3:
            return "a malformed answer"
        header = msgspec.msgpack.decode(frames[1])
        spec, caches = load.spec, self._caches
        if header.get("digest") != spec.token_digest:
            return "the producer's blocks hold other tokens"
        like = caches[0]
        shape = [len(caches), like.shape[0], len(spec.block_ids), *like.shape[2:]]
        if header.get("shape") != shape or header.get("dtype") != _dtype_name(like.dtype):
            return f"blocks of shape {header.get('shape')} {header.get('dtype')}, not {shape} {_dtype_name(like.dtype)}"
        payload = frames[2]
        if len(payload) != like.element_size() * int(torch.Size(shape).numel()):
            return "a truncated payload"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only bytes: only read
            data = torch.frombuffer(payload, dtype=torch.uint8).view(like.dtype).view(shape)
        ids = torch.tensor(spec.block_ids, dtype=torch.long)
        for layer, cache in enumerate(caches):
            cache.index_copy_(1, ids, data[layer])
        return None

    def _end(self, load: _Load, error: Optional[str]) -> None:
        import zmq

        try:  # the producer frees its copy (after a failure too)
            load.socket.send_multipart([b"done", msgspec.msgpack.encode({"transfer": load.spec.transfer_id})],
                                       flags=zmq.NOBLOCK)
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
