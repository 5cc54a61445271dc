"""KV-cache events over ZeroMQ (``kv_events``), in vLLM's wire format, so a
subscriber written for vLLM (a KV-aware router) decodes them unchanged.

After every engine step the core hands the block pool's events to
``KVEventPublisher.publish``, which only queues them: a background thread
converts and encodes each step's events as one ``KVEventBatch`` and sends
it on a PUB socket as three frames, ``[topic, sequence number (8 bytes,
big-endian, from 0), msgpack payload]``, so a step never waits on the
network. The payload is msgspec's array-like encoding of
``KVEventBatch(ts, events, data_parallel_rank)``, each event tagged by its
class name: ``BlockStored(block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium)``, ``BlockRemoved(block_hashes, medium)``,
``AllBlocksCleared()``. Block hashes are 64-bit unsigned integers: the last
8 bytes (big-endian) of a SHA-256 block hash, as vLLM converts them, or a
builtin hash as unsigned.

The last ``buffer_steps`` batches are kept for replay: a ROUTER socket at
``replay_endpoint`` takes a request of one frame, the 8-byte sequence
number to start from, and answers each kept batch from there as ``[seq,
payload]``, then ``[-1 (8 bytes, signed), b""]`` to end. With data
parallelism, engine core ``r`` binds each endpoint's port + ``r``.

What a subscriber learns. ``BlockStored`` carries the blocks' token ids
(the prompts' text, as the model's tokenizer decodes them) only with
``kv_events.include_token_ids``; otherwise ``token_ids`` is empty and a
subscriber sees block hashes, their parent links, and when blocks are
stored and removed. Both sockets bind loopback by default; with
``kv_events.curve_*`` they are ZeroMQ CURVE servers (encrypted, and only
subscribers whose public certificate is in the authorized folder can
connect, the replay socket too).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Any, Optional, Union
from urllib.parse import urlsplit

import msgspec

log = logging.getLogger("appliance.engine")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """An event about the KV cache's blocks (tagged by class name on the wire)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = object()


def external_hash(block_hash: Any) -> int:
    """A block hash as the 64-bit unsigned integer subscribers see."""
    if isinstance(block_hash, (bytes, bytearray)):
        return int.from_bytes(block_hash[-8:], "big")
    return int(block_hash) & (1 << 64) - 1


def to_wire(events: list[Any], medium: str,
            include_token_ids: bool = False) -> list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]:
    """The block pool's events (``engine.kv_cache.block_pool.KVCacheEvent``)
    as the wire's; a stored block's token ids only with ``include_token_ids``."""
    out: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]] = []
    for e in events:
        if e.kind == "BlockStored":
            parent = None if e.parent_block_hash is None else external_hash(e.parent_block_hash)
            out.append(BlockStored([external_hash(h) for h in e.block_hashes], parent,
                                   list(e.token_ids) if include_token_ids else [], e.block_size, None, medium))
        elif e.kind == "BlockRemoved":
            out.append(BlockRemoved([external_hash(h) for h in e.block_hashes], medium))
        elif e.kind == "AllBlocksCleared":
            out.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV cache event {e.kind!r}")
    return out


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Engine core ``rank``'s endpoint: a tcp port plus ``rank``; an ipc or
    inproc name with ``-dp<rank>`` appended (rank 0 keeps the endpoint)."""
    if rank == 0:
        return endpoint
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp":
        host, _, port = parts.netloc.rpartition(":")
        return f"tcp://{host}:{int(port) + rank}"
    return f"{endpoint}-dp{rank}"


class KVEventPublisher:
    """Publishes each step's events from a background thread (see the module
    docstring). Binding happens in the constructor's thread of work, and a
    failure to bind (a port in use) raises here. A full queue
    (``max_queue_size`` steps not yet sent) drops the step's events and
    counts them (``dropped``): a subscriber sees the gap in the sequence."""

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000,
                 data_parallel_rank: int = 0, medium: str = "GPU", include_token_ids: bool = False,
                 curve: Optional[tuple[str, str]] = None):
        self.endpoint = offset_endpoint(endpoint, data_parallel_rank)
        self.replay_endpoint = None if replay_endpoint is None else offset_endpoint(replay_endpoint,
                                                                                    data_parallel_rank)
        self.topic = topic.encode()
        self.rank, self.medium, self.include_token_ids = data_parallel_rank, medium, include_token_ids
        self.curve = curve  # (this publisher's secret key file, the authorized subscribers' folder), or None
        self.hwm, self.buffer_steps = hwm, buffer_steps
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if isinstance(self._error, ValueError):  # a CURVE certificate or folder that cannot be used
            raise OSError(str(self._error))
        if self._error is not None:
            raise OSError(f"kv_events: cannot bind {self.endpoint} or {self.replay_endpoint}: {self._error}")

    def publish(self, events: list[Any]) -> None:
        """Queue one step's block pool events (nothing for a step without any)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("kv_events: the publisher's queue is full; %d steps' events dropped", self.dropped)

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        replay = auth = None
        try:
            auth = self._curve_server(ctx, pub)
            pub.setsockopt(zmq.SNDHWM, self.hwm)
            pub.bind(self.endpoint)
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                self._curve_server(ctx, replay, auth)
                replay.bind(self.replay_endpoint)
        except (zmq.ZMQError, OSError, ValueError) as e:
            self._error = e
            self._ready.set()
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            if auth is not None:
                auth.stop()
            ctx.term()
            return
        self._ready.set()
        encoder = msgspec.msgpack.Encoder()
        kept: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_steps)
        seq = 0
        try:
            while True:
                if replay is not None:
                    while replay.poll(0):
                        self._answer_replay(replay, kept)
                try:
                    item = self._queue.get(timeout=0.005)
                except queue.Empty:
                    continue
                if item is _STOP:
                    return
                ts, events = item
                payload = encoder.encode(KVEventBatch(ts, to_wire(events, self.medium, self.include_token_ids),
                                                      self.rank))
                pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                kept.append((seq, payload))
                seq += 1
        finally:
            pub.close(linger=100)
            if replay is not None:
                replay.close(linger=100)
            if auth is not None:
                auth.stop()
            ctx.term()

    def _curve_server(self, ctx: Any, sock: Any, auth: Any = None) -> Any:
        """Make ``sock`` a CURVE server with this publisher's certificate, only
        the authorized folder's subscribers let in (the ZAP authenticator
        started on ``ctx`` if ``auth`` is None); the authenticator, or None
        without CURVE."""
        if self.curve is None:
            return None
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        secret_file, authorized = self.curve
        try:
            public, secret = zmq.auth.load_certificate(secret_file)
        except (OSError, ValueError) as e:
            raise ValueError(f"kv_events.curve_secret_key_file={secret_file}: cannot read it ({e})") from None
        if secret is None:
            raise ValueError(f"kv_events.curve_secret_key_file={secret_file} holds no secret key (the "
                             f"'<name>.key_secret' file zmq.auth.create_certificates writes)")
        if not os.path.isdir(authorized):
            raise ValueError(f"kv_events.curve_authorized_keys={authorized} is not a folder")
        if auth is None:
            auth = ThreadAuthenticator(ctx)
            auth.start()
            auth.configure_curve(domain="*", location=authorized)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        return auth

    @staticmethod
    def _answer_replay(replay: Any, kept: deque) -> None:
        frames = replay.recv_multipart()
        client, start = frames[0], frames[-1]  # a REQ client's empty delimiter frame sits between them
        delimiter = [b""] if len(frames) > 2 else []
        if len(start) != 8:
            replay.send_multipart([client, *delimiter, END_SEQ, b""])
            return
        first = int.from_bytes(start, "big")
        for seq, payload in kept:
            if seq >= first:
                replay.send_multipart([client, *delimiter, seq.to_bytes(8, "big"), payload])
        replay.send_multipart([client, *delimiter, END_SEQ, b""])
