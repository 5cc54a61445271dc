"""The hardening suite's sockets: hostile bytes at the ZeroMQ sockets the
appliance binds or reads (a producer's KV transfer server, a consumer's
puller facing a hostile producer, the KV events replay socket, the router's
event subscription). Each keeps serving, answers nothing but signed errors
to what is not signed, and a well-behaved peer is served unchanged after
the barrage."""

import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.engine.kv_p2p import seal, unseal
from appliance.server.kv_events import END_SEQ, KVEventPublisher
from appliance.server.local import free_port
from tests.integration.server_helpers import FakeProducer
from tests.unit.test_kv_events import connected, receive, subscriber
from tests.unit.test_kv_p2p import KEY, _consumer, _decode, _prefill, _producer, _same, _settle
from tests.unit.test_kv_p2p import reference  # noqa: F401  (a fixture)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
FIELDS = st.dictionaries(st.sampled_from(["transfer", "engine", "layout", "first", "count", "tokens", "metadata"]),
                         st.one_of(st.integers(-2**40, 2**40), st.text(max_size=40), st.booleans(), st.none(),
                                   st.lists(st.integers(-5, 5), max_size=4)), max_size=7)
BODIES = st.one_of(st.binary(max_size=300), FIELDS.map(msgspec.msgpack.encode))
KINDS = st.one_of(st.sampled_from([b"pull", b"done", b"ok", b"error", b""]), st.binary(max_size=12))


@st.composite
def messages(draw):
    """Frames a hostile peer may send: unsigned, badly signed, or signed with
    the deployment's key over nonsense (an insider's bug)."""
    kind, body = draw(KINDS), draw(BODIES)
    how = draw(st.sampled_from(["raw", "bad mac", "other key", "signed"]))
    if how == "raw":
        return [kind, body, *draw(st.lists(st.binary(max_size=64), max_size=3))]
    if how == "bad mac":
        return [kind, body, draw(st.binary(min_size=32, max_size=32))]
    return seal(b"another-deployments-key" if how == "other key" else KEY.encode(), kind, body)


@pytest.fixture(scope="module")
def pair():
    return _producer(), _consumer("kv_transfer.p2p.timeout_s=2")


@pytest.fixture(scope="module")
def producer_socket(pair):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{pair[0].resolved.cfg.kv_transfer.p2p.port}")
    yield sock
    sock.close()


@FUZZ
@given(frames=messages())
def test_fuzz_the_producers_server_answers_only_signed_errors(producer_socket, frames):
    producer_socket.send_multipart(frames)
    if not producer_socket.poll(2000):  # a signed done of an unknown transfer: nothing to answer
        assert unseal(KEY.encode(), frames) is not None and frames[0] == b"done"
        return
    answer = unseal(KEY.encode(), producer_socket.recv_multipart())
    assert answer is not None and answer[0] == b"error", answer


def test_after_the_fuzz_the_producer_serves_its_consumer(pair, reference):
    producer, consumer = pair
    kv = producer.engine.scheduler.kv
    _same(_decode(consumer, _prefill(producer)), reference)
    _settle(producer, lambda: not producer.engine.has_kv_transfers(), timeout_s=5)
    kv.check_integrity()


@st.composite
def answers(draw):
    """A hostile producer's answer to a pull: as ``messages``, plus signed
    ``ok`` headers of plausible fields and a payload of any size."""
    if draw(st.booleans()):
        return draw(messages())
    header = draw(st.fixed_dictionaries({}, optional={
        "transfer": st.text(max_size=40), "digest": st.text(max_size=64), "checksum": st.text(max_size=64),
        "shape": st.lists(st.integers(-3, 64), max_size=6), "dtype": st.sampled_from(["float32", "bfloat16", "x"])}))
    return seal(KEY.encode(), b"ok", msgspec.msgpack.encode(header), draw(st.binary(max_size=4096)))


def test_fuzz_a_hostile_producer_never_changes_a_consumers_tokens(pair, reference):
    """Whatever a producer answers, the consumer's load fails and the prompt
    is computed, with the reference's tokens; its puller keeps going."""
    _, consumer = pair
    current: list = []
    hostile = FakeProducer(lambda pull: current[-1])
    params = {"do_remote_prefill": True, "remote_engine_id": "hostile", "remote_host": "127.0.0.1",
              "remote_port": hostile.port, "remote_request_id": "0" * 32,
              "remote_block_ids": list(range(40)), "remote_num_tokens": len(reference.prompt_token_ids)}
    connector = consumer.engine.scheduler.connector

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(answer=answers())
    def one(answer):
        current.append(answer)
        failed = connector.failed_loads
        _same(_decode(consumer, params), reference)
        assert connector.failed_loads == failed + 1

    try:
        one()
    finally:
        hostile.stop()
    assert hostile.pulls >= 25
    consumer.engine.scheduler.kv.check_integrity()


@pytest.fixture(scope="module")
def replay_publisher():
    port, replay_port = free_port(), free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", buffer_steps=4)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{replay_port}")
    yield pub, port, sock
    sock.close()
    pub.close()


@FUZZ
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_fuzz_the_replay_socket_always_ends_its_answer(replay_publisher, frames):
    _, _, sock = replay_publisher
    sock.send_multipart(frames)
    deadline = time.monotonic() + 5
    while True:
        assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), "no end of replay"
        if sock.recv_multipart()[-2] == END_SEQ:
            return


def test_after_the_fuzz_the_publisher_still_publishes_and_replays(replay_publisher):
    from appliance.engine.kv_cache.block_pool import KVCacheEvent as PoolEvent

    pub, port, sock = replay_publisher
    sub = subscriber(f"tcp://127.0.0.1:{port}")
    try:
        first = connected(pub, sub)
        pub.publish([PoolEvent("BlockRemoved", (9,))])
        assert receive(sub, 1)[0][1] == first
        sock.send_multipart([b"", first.to_bytes(8, "big")])
        assert sock.poll(5000) and int.from_bytes(sock.recv_multipart()[-2], "big") == first
    finally:
        sub.close(linger=0)


def test_fuzz_the_routers_subscription_keeps_its_index():
    """Hostile batches on an instance's event socket: undecodable ones are
    skipped, the subscriber keeps running, and a real batch still lands."""
    from appliance.server.kv_events import BlockStored, KVEventBatch
    from appliance.server.router_events import EventSubscriber, PrefixIndex

    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    index = PrefixIndex()
    sub = EventSubscriber(f"tcp://127.0.0.1:{port}", index)
    sub.start()
    try:
        time.sleep(0.3)

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(frames=st.lists(st.binary(max_size=80), min_size=1, max_size=4))
        def one(frames):
            pub.send_multipart(frames)

        one()
        good = msgspec.msgpack.encode(KVEventBatch(0.0, [BlockStored([5], None, [1, 2, 3, 4], 4, None, "CPU")]))
        deadline = time.monotonic() + 5
        while index.match([1, 2, 3, 4]) != 4:
            assert time.monotonic() < deadline and sub.is_alive()
            pub.send_multipart([b"", (2**40).to_bytes(8, "big"), good])
            time.sleep(0.05)
    finally:
        sub.stop()
        sub.join(5)
        pub.close(linger=0)
