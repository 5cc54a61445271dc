"""KV-cache events (``kv_events``): vLLM's wire format decoded by a
subscriber with vLLM's types, the PUB frames and sequence numbers, replay
from the ROUTER socket, and (engine) a subscriber's reconstruction of the
cached block set equal to the pool's after evictions and a reset; what a
subscriber may learn: loopback by default, token ids only when asked for,
CURVE subscribers only when configured."""

import random
import time
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

from appliance.engine.kv_cache.block_pool import KVCacheEvent as PoolEvent
from appliance.server.kv_events import END_SEQ, KVEventPublisher, external_hash, offset_endpoint
from appliance.server.local import free_port


# A subscriber's own copy of vLLM's types (vllm.distributed.kv_events), as its example subscriber has them.
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class VEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(VEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(VEvent):
    pass


class VKVEventBatch(VEventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(type=VKVEventBatch)


def subscriber(endpoint: str, topic: str = "", curve: Optional[tuple[bytes, bytes, bytes]] = None) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    if curve is not None:
        sub.curve_publickey, sub.curve_secretkey, sub.curve_serverkey = curve
    sub.connect(endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    return sub


def receive(sub: zmq.Socket, n: int, timeout_s: float = 10.0) -> list[tuple[bytes, int, Any]]:
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        assert time.monotonic() < deadline, f"got {len(out)} of {n} batches"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            out.append((topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return out


def connected(pub: KVEventPublisher, sub: zmq.Socket) -> int:
    """Publish probes until the subscriber hears one (PUB drops what is sent
    before a subscriber joins); the sequence number the next batch gets."""
    deadline = time.monotonic() + 10
    while True:
        pub.publish([PoolEvent("AllBlocksCleared")])
        if sub.poll(100):
            _, seq, _ = sub.recv_multipart()
            while sub.poll(50):
                _, seq, _ = sub.recv_multipart()
            return int.from_bytes(seq, "big") + 1
        assert time.monotonic() < deadline, "the subscriber never connected"


def test_batches_decode_with_vllms_types_and_count_from_zero():
    port = free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", topic="kv", data_parallel_rank=0, medium="CPU",
                           include_token_ids=True)
    sub = subscriber(f"tcp://127.0.0.1:{port}", "kv")
    try:
        first = connected(pub, sub)
        h1, h2 = bytes(range(32)), bytes(range(1, 33))
        pub.publish([PoolEvent("BlockStored", (h1,), None, (1, 2, 3, 4), 4),
                     PoolEvent("BlockStored", (h2,), h1, (5, 6, 7, 8), 4)])
        pub.publish([PoolEvent("BlockRemoved", (h2,))])
        pub.publish([])  # a step without events sends nothing
        (topic, seq, batch), (_, seq2, batch2) = receive(sub, 2)
        assert topic == b"kv" and seq == first and seq2 == first + 1 and first >= 1
        stored = batch.events
        assert isinstance(stored[0], BlockStored) and stored[0].block_hashes == [int.from_bytes(h1[-8:], "big")]
        assert stored[1].parent_block_hash == external_hash(h1) and stored[1].token_ids == [5, 6, 7, 8]
        assert stored[0].block_size == 4 and stored[0].lora_id is None and stored[0].medium == "CPU"
        assert isinstance(batch2.events[0], BlockRemoved) and batch2.events[0].block_hashes == [external_hash(h2)]
        assert batch.data_parallel_rank == 0 and batch.ts > 0
    finally:
        pub.close()
        sub.close(linger=0)


def test_a_subscriber_that_missed_batches_replays_them():
    port, replay_port = free_port(), free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", buffer_steps=5)
    sub = subscriber(f"tcp://127.0.0.1:{port}")
    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        first = connected(pub, sub)
        for i in range(8):
            pub.publish([PoolEvent("BlockRemoved", (i,))])
        got = receive(sub, 8)
        assert [s for _, s, _ in got] == list(range(first, first + 8))
        # drop the middle, then ask for it back: the buffer holds the last 5 batches
        replay.send_multipart([b"", (first + 4).to_bytes(8, "big")])
        answers = []
        while True:
            assert replay.poll(5000), "no replay answer"
            _, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                assert payload == b""
                break
            answers.append((int.from_bytes(seq, "big"), DECODER.decode(payload).events[0].block_hashes))
        assert answers == [(first + i, [i]) for i in range(4, 8)]
    finally:
        pub.close()
        sub.close(linger=0)
        replay.close(linger=0)


def test_token_ids_are_published_only_when_asked_for():
    """By default a stored block's event carries its hash and parent, not the
    tokens (they decode to the prompt)."""
    port = free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}")
    sub = subscriber(f"tcp://127.0.0.1:{port}")
    try:
        connected(pub, sub)
        pub.publish([PoolEvent("BlockStored", (b"\x01" * 32,), None, (1, 2, 3, 4), 4)])
        stored = receive(sub, 1)[0][2].events[0]
        assert stored.token_ids == [] and stored.block_hashes == [external_hash(b"\x01" * 32)]
    finally:
        pub.close()
        sub.close(linger=0)


def _host_address() -> Optional[str]:
    """One of this machine's non-loopback IPv4 addresses, or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_by_default_only_this_machine_can_subscribe():
    """The default endpoints bind loopback: a subscriber that comes in on
    the machine's network address gets nothing, one on loopback everything
    (the default hosts, on free ports)."""
    from appliance.config.compose import resolve

    address = _host_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to subscribe from")
    ev = resolve(["+profile=cpu", "kv_events=zmq"]).cfg.kv_events
    hosts = [e.removeprefix("tcp://").rpartition(":")[0] for e in (ev.endpoint, ev.replay_endpoint)]
    assert hosts == ["127.0.0.1", "127.0.0.1"] and not ev.include_token_ids
    port, replay_port = free_port(), free_port()
    pub = KVEventPublisher(f"tcp://{hosts[0]}:{port}", f"tcp://{hosts[1]}:{replay_port}")
    outside, inside = subscriber(f"tcp://{address}:{port}"), subscriber(f"tcp://127.0.0.1:{port}")
    replay = zmq.Context.instance().socket(zmq.DEALER)
    try:
        connected(pub, inside)
        pub.publish([PoolEvent("BlockRemoved", (1,))])
        assert receive(inside, 1) and not outside.poll(1000)
        replay.connect(f"tcp://{address}:{replay_port}")
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        assert not replay.poll(1000)
    finally:
        pub.close()
        for sock in (outside, inside, replay):
            sock.close(linger=0)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    """A publisher's certificate, a router's (authorized) and an intruder's (not)."""
    import zmq.auth

    root = tmp_path_factory.mktemp("curve")
    for folder in ("publisher", "authorized", "intruder"):
        (root / folder).mkdir()
    zmq.auth.create_certificates(str(root / "publisher"), "publisher")
    zmq.auth.create_certificates(str(root / "authorized"), "router")
    zmq.auth.create_certificates(str(root / "intruder"), "intruder")
    return root


def test_with_curve_only_authorized_subscribers_hear_anything(certificates):
    import zmq.auth

    from appliance.server.router_events import curve_client_keys

    root = certificates
    port, replay_port = free_port(), free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}",
                           curve=(str(root / "publisher" / "publisher.key_secret"), str(root / "authorized")))
    server = str(root / "publisher" / "publisher.key")
    router = curve_client_keys(str(root / "authorized" / "router.key_secret"), server)
    intruder = curve_client_keys(str(root / "intruder" / "intruder.key_secret"), server)
    allowed = subscriber(f"tcp://127.0.0.1:{port}", curve=router)
    refused = [subscriber(f"tcp://127.0.0.1:{port}", curve=intruder), subscriber(f"tcp://127.0.0.1:{port}")]
    try:
        first = connected(pub, allowed)
        pub.publish([PoolEvent("BlockRemoved", (7,))])
        assert receive(allowed, 1)[0][1] == first
        assert not any(s.poll(500) for s in refused)

        def replay(curve):
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
            sock.connect(f"tcp://127.0.0.1:{replay_port}")
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            answered = sock.poll(2000)
            sock.close()
            return answered

        assert replay(router) and not replay(intruder) and not replay(None)
        assert zmq.auth.load_certificate(server)[1] is None  # what the router holds of the publisher: public only
    finally:
        pub.close()
        for s in (allowed, *refused):
            s.close(linger=0)


def test_a_certificate_that_cannot_be_used_is_a_clear_error(certificates):
    with pytest.raises(OSError, match="holds no secret key"):
        KVEventPublisher(f"tcp://127.0.0.1:{free_port()}",
                         curve=(str(certificates / "publisher" / "publisher.key"), str(certificates / "authorized")))
    with pytest.raises(OSError, match="curve_authorized_keys=.* is not a folder"):
        KVEventPublisher(f"tcp://127.0.0.1:{free_port()}",
                         curve=(str(certificates / "publisher" / "publisher.key_secret"), str(certificates / "none")))


def test_a_router_index_without_token_ids_matches_nothing_and_says_so(caplog):
    from appliance.server.kv_events import BlockStored as WireStored
    from appliance.server.router_events import EventSubscriber, PrefixIndex

    index = PrefixIndex()
    sub = EventSubscriber("tcp://127.0.0.1:1", index)
    with caplog.at_level("WARNING", logger="appliance.router"):
        sub._receive(0, VKVEventBatch(0.0, [WireStored([11, 12], None, [], 4, None, "CPU")]), None)
        sub._receive(1, VKVEventBatch(0.0, [WireStored([13], None, [], 4, None, "CPU")]), None)
    assert index.tokenless == 3 and len(index) == 0 and index.match([1, 2, 3, 4]) == 0
    assert sum("carry no token ids" in r.getMessage() for r in caplog.records) == 1
    index.apply([WireStored([11], None, [1, 2, 3, 4], 4, None, "CPU")])
    assert index.match([1, 2, 3, 4, 5]) == 4


def test_data_parallel_ranks_bind_port_plus_rank():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv-dp1"
    assert external_hash(-1) == (1 << 64) - 1


def test_a_port_in_use_is_a_clear_error():
    port = free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(OSError, match="kv_events: cannot bind"):
            KVEventPublisher(f"tcp://127.0.0.1:{port}")
    finally:
        pub.close()


def test_a_subscriber_rebuilds_the_pools_cached_blocks():
    """A random workload with evictions (a small pool) and a reset of the
    prefix cache; the subscriber skips every fifth batch on purpose and
    fills the gaps from the replay socket. The hashes it holds at the end
    are the pool's cached ones, exactly."""
    from appliance import LLM, SamplingParams

    port, replay_port = free_port(), free_port()
    llm = LLM(overrides=["+profile=cpu", "model=tiny_random", "cache.block_size=4", "cache.num_blocks=48",
                         "scheduler.max_num_seqs=4", "kv_events=zmq", f"kv_events.endpoint=tcp://127.0.0.1:{port}",
                         f"kv_events.replay_endpoint=tcp://127.0.0.1:{replay_port}"])
    sub = subscriber(f"tcp://127.0.0.1:{port}")
    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.connect(f"tcp://127.0.0.1:{replay_port}")
    time.sleep(0.3)  # let the subscription reach the publisher
    cached: set[int] = set()
    state = {"next": 0}
    seen = {BlockStored: 0, BlockRemoved: 0, AllBlocksCleared: 0}

    def apply(seq: int, batch: Any) -> None:
        assert seq == state["next"]
        for e in batch.events:
            seen[type(e)] += 1
            if isinstance(e, BlockStored):
                cached.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                cached.difference_update(e.block_hashes)
            else:
                cached.clear()
        state["next"] = seq + 1

    def fill_gap() -> None:
        replay.send_multipart([b"", state["next"].to_bytes(8, "big")])
        while True:
            assert replay.poll(5000), "no replay answer"
            _, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                return
            if int.from_bytes(seq, "big") >= state["next"]:
                apply(int.from_bytes(seq, "big"), DECODER.decode(payload))

    def drain(quiet_s: float = 0.5) -> None:
        while sub.poll(int(quiet_s * 1000)):
            _, seq_b, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq % 5 == 4:
                continue  # dropped on purpose
            if seq > state["next"]:
                fill_gap()
            if seq == state["next"]:
                apply(seq, DECODER.decode(payload))
        fill_gap()  # whatever is still missing at the end

    rng = random.Random(0)
    shared = [rng.randrange(5, 500) for _ in range(12)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    pool = llm.engine.scheduler.kv.pool
    for round_ in range(3):
        prompts = [shared[:rng.randrange(4, 12)] + [rng.randrange(5, 500) for _ in range(rng.randrange(1, 14))]
                   for _ in range(10)]
        llm.generate(prompts, params, use_tqdm=False)
        if round_ == 1:
            assert llm.engine.reset_prefix_cache()
        drain()
        assert cached == {external_hash(h) for h in pool.cached_blocks[0]}
    assert state["next"] > 10 and llm.engine.scheduler.kv.stats.hits > 0
    assert seen[BlockRemoved] > 0 and seen[AllBlocksCleared] == 1  # evictions happened, and the reset
    llm.engine.kv_events.close()
    sub.close(linger=0)
    replay.close(linger=0)


@pytest.mark.parametrize("overrides,message", [
    (["kv_events.topic=kv"], "has no effect with kv_events.enabled=false"),
    (["kv_events=zmq", "kv_events.endpoint=localhost:5557"], "must be a ZeroMQ endpoint"),
    (["kv_events=zmq", "kv_events.endpoint=tcp://*"], "needs a port"),
    (["kv_events=zmq", "kv_events.replay_endpoint=tcp://127.0.0.1:5557"], "must differ from kv_events.endpoint"),
    (["kv_events=zmq", "kv_events.buffer_steps=0"], "must be at least 1"),
    (["kv_events=zmq", "cache.enable_prefix_caching=false"], "needs cache.enable_prefix_caching=true"),
    (["kv_events.include_token_ids=true"], "has no effect with kv_events.enabled=false"),
    (["kv_events=zmq", "kv_events.include_token_ids=true", "server.tenant_isolation=true"],
     "hands every tenant's prompts"),
    (["kv_events=zmq", "kv_events.token_ids_with_tenants=true"], "has no effect without kv_events.include_token_ids"),
    (["kv_events=zmq", "kv_events.endpoint=tcp://*:5557"], "tcp://*:5557 is reachable from other machines"),
    (["kv_events=zmq", "kv_events.replay_endpoint=tcp://10.0.0.5:5558"], "is reachable from other machines"),
    (["kv_events=zmq", "kv_events.curve_authorized_keys=/keys"], "CURVE needs both"),
    (["kv_events=zmq", "kv_events.allow_unauthenticated=true"], "has no effect: every endpoint is local"),
    (["router.kv_events_client_key_file=/k"], "CURVE subscriptions need both"),
])
def test_kv_events_config_problems(overrides, message):
    problems = _problems(overrides)
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize("overrides", [
    ["kv_events=zmq", "kv_events.endpoint=tcp://*:5557", "kv_events.allow_unauthenticated=true"],
    ["kv_events=zmq", "kv_events.endpoint=tcp://*:5557", "kv_events.curve_secret_key_file=/k/p.key_secret",
     "kv_events.curve_authorized_keys=/k/authorized"],
    ["kv_events=zmq", "kv_events.endpoint=ipc:///tmp/kv", "kv_events.replay_endpoint='tcp://[::1]:5558'"],
    ["kv_events=zmq", "kv_events.include_token_ids=true", "server.tenant_isolation=true",
     "kv_events.token_ids_with_tenants=true"],
])
def test_kv_events_exposure_that_is_asked_for_is_allowed(overrides):
    assert _problems(overrides) == []


def _problems(overrides):
    from appliance.config.compose import resolve
    from appliance.config.validate import validate

    return validate(resolve(["+profile=cpu", *overrides], check=False).cfg)
