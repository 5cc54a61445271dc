"""The router's view of its instances' KV caches: each instance's KV
cache events (``kv_events``), subscribed over ZeroMQ (``EventSubscriber``,
with CurveZMQ where the instances require it: ``curve_client_keys``, and
the replay endpoint to fill a gap in the sequence numbers), kept in a
``PrefixIndex`` of block hashes per instance that ``kv_aware`` routing
matches a prompt against."""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

log = logging.getLogger("appliance.router")

REPLAY_TIMEOUT_MS = 2000


class PrefixIndex:
    """The blocks one instance holds, from its KV events: (parent hash,
    block tokens) -> hash, and back, so removals find their key."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, int] = {}
        self._key_of: dict[int, tuple] = {}
        self.block_size = 0
        self.tokenless = 0  # stored blocks whose events carried no token ids (nothing to match them by)
        self._lock = threading.Lock()

    def apply(self, events: list[Any]) -> None:
        with self._lock:
            for ev in events:
                kind = type(ev).__name__
                if kind == "BlockStored":
                    bs = ev.block_size
                    self.block_size = bs
                    if len(ev.token_ids) != bs * len(ev.block_hashes):  # kv_events.include_token_ids=false
                        self.tokenless += len(ev.block_hashes)
                        continue
                    parent = ev.parent_block_hash
                    for i, h in enumerate(ev.block_hashes):
                        key = (parent, tuple(ev.token_ids[i * bs:(i + 1) * bs]))
                        self._by_key[key] = h
                        self._key_of[h] = key
                        parent = h
                elif kind == "BlockRemoved":
                    for h in ev.block_hashes:
                        gone = self._key_of.pop(h, None)
                        if gone is not None and self._by_key.get(gone) == h:
                            del self._by_key[gone]
                elif kind == "AllBlocksCleared":
                    self._by_key.clear()
                    self._key_of.clear()

    def clear(self) -> None:
        with self._lock:
            self._by_key.clear()
            self._key_of.clear()

    def __len__(self) -> int:
        return len(self._key_of)

    def match(self, tokens: list[int]) -> int:
        """Tokens of the longest prefix of ``tokens`` this instance holds (whole blocks)."""
        bs = self.block_size
        if not bs:
            return 0
        parent, n = None, 0
        with self._lock:
            for i in range(len(tokens) // bs):
                h = self._by_key.get((parent, tuple(tokens[i * bs:(i + 1) * bs])))
                if h is None:
                    break
                parent, n = h, n + 1
        return n * bs


class EventSubscriber(threading.Thread):
    """Reads one instance's KV event batches (ZeroMQ SUB) into its index.

    Batches carry consecutive sequence numbers. With the instance's replay
    endpoint (``router.kv_events_replay``), batches the subscription missed
    (a gap, or those sent before it joined) are asked for again and applied
    in order first; without it, or past what the instance still keeps, they
    are counted in ``missed`` and the index may be stale until the blocks
    change again. A sequence that starts below the last one seen is a
    restarted instance, whose pool is empty: the index is cleared (a restart
    the router notices only after the new sequence passed the old one reads
    as a gap)."""

    def __init__(self, endpoint: str, index: PrefixIndex, topic: str = "", replay_endpoint: Optional[str] = None,
                 curve: Optional[tuple[bytes, bytes, bytes]] = None):
        super().__init__(name=f"kv-events {endpoint}", daemon=True)
        self.endpoint, self.index, self.topic, self.replay_endpoint = endpoint, index, topic, replay_endpoint
        self.curve = curve  # (the router's public and secret key, the instances' publisher key), or None
        self.batches = 0
        self.replayed = 0  # batches applied from the replay endpoint
        self.missed = 0  # batches never seen
        self.restarts = 0
        self._next: Optional[int] = None  # the sequence number expected next
        self._stop_event = threading.Event()

    def run(self) -> None:
        import msgspec
        import zmq

        from appliance.server.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        ctx: Any = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        self._curve_client(sock)
        sock.connect(self.endpoint)
        sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop_event.is_set():
                if not poller.poll(200):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                try:
                    batch = decoder.decode(frames[2])
                except msgspec.DecodeError:
                    log.warning("undecodable KV event batch from %s", self.endpoint)
                    continue
                self._receive(int.from_bytes(frames[1], "big"), batch, decoder)
        finally:
            sock.close()

    def _receive(self, seq: int, batch: Any, decoder: Any) -> None:
        expected = self._next if self._next is not None else 0
        if self._next is not None and seq < self._next:  # the instance restarted: its pool is empty
            self.index.clear()
            self.restarts += 1
            expected = 0
        if seq > expected:
            got = self._replay(expected, seq, decoder) if self.replay_endpoint else 0
            self.replayed += got
            if got < seq - expected:
                self.missed += seq - expected - got
                log.warning("missed %d KV event batch(es) of %s; its prefix index may be stale",
                            seq - expected - got, self.endpoint)
        tokenless = self.index.tokenless
        self.index.apply(batch.events)
        if self.index.tokenless and not tokenless:
            log.warning("the KV events of %s carry no token ids (kv_events.include_token_ids=false there): kv_aware "
                        "cannot match prompts to its blocks", self.endpoint)
        self.batches += 1
        self._next = seq + 1

    def _curve_client(self, sock: Any) -> None:
        """With CURVE, ``sock`` connects as the router's certificate to the instances' publisher key."""
        if self.curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self.curve

    def _replay(self, first: int, end: int, decoder: Any) -> int:
        """Apply batches ``first``..``end - 1`` from the replay endpoint, in
        order, as far as they come without a gap; how many were applied."""
        import zmq

        sock: Any = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        applied = 0
        try:
            self._curve_client(sock)
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            while sock.poll(REPLAY_TIMEOUT_MS):
                frames = sock.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True) if len(frames) >= 2 else -1
                if seq < 0:
                    break
                if seq != first + applied or seq >= end:
                    continue  # past the gap, or after a gap of its own
                self.index.apply(decoder.decode(frames[-1]).events)
                applied += 1
        except Exception as e:  # an instance that cannot replay leaves the gap counted
            log.warning("replaying KV events from %s failed: %s", self.replay_endpoint, e)
        finally:
            sock.close()
        return applied

    def stop(self) -> None:
        self._stop_event.set()


def curve_client_keys(client_file: str, server_file: str) -> tuple[bytes, bytes, bytes]:
    """(public, secret, server public) key of a CURVE subscription: the
    router's certificate (a secret key file) and the publisher's public one."""
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(client_file)
        server = zmq.auth.load_certificate(server_file)[0]
    except (OSError, ValueError) as e:
        raise ValueError(f"router.kv_events_client_key_file / kv_events_server_key_file: cannot read them ({e})") \
            from None
    if secret is None:
        raise ValueError(f"router.kv_events_client_key_file={client_file} holds no secret key (the "
                         f"'<name>.key_secret' file zmq.auth.create_certificates writes)")
    return public, secret, server
