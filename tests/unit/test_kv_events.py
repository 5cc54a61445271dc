"""KV-cache events (``kv_events``): vLLM's wire format decoded by a
subscriber with vLLM's types, the PUB frames and sequence numbers, replay
from the ROUTER socket, and (engine) a subscriber's reconstruction of the
cached block set equal to the pool's after evictions and a reset."""

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


def subscriber(endpoint: str, topic: str = "") -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
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
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", topic="kv", data_parallel_rank=0, medium="CPU")
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
        assert cached == {external_hash(h) for h in pool.cached_block_hash_to_block}
    assert state["next"] > 10 and llm.engine.scheduler.kv.stats.hits > 0
    assert seen[BlockRemoved] > 0 and seen[AllBlocksCleared] == 1  # evictions happened, and the reset
    llm.engine.kv_events.close()
    sub.close(linger=0)
    replay.close(linger=0)


@pytest.mark.parametrize("overrides,message", [
    (["kv_events.topic=kv"], "has no effect with kv_events.enabled=false"),
    (["kv_events=zmq", "kv_events.endpoint=localhost:5557"], "must be a ZeroMQ endpoint"),
    (["kv_events=zmq", "kv_events.endpoint=tcp://*"], "needs a port"),
    (["kv_events=zmq", "kv_events.replay_endpoint=tcp://*:5557"], "must differ from kv_events.endpoint"),
    (["kv_events=zmq", "kv_events.buffer_steps=0"], "must be at least 1"),
    (["kv_events=zmq", "cache.enable_prefix_caching=false"], "needs cache.enable_prefix_caching=true"),
])
def test_kv_events_config_problems(overrides, message):
    from appliance.config.compose import resolve
    from appliance.config.validate import validate

    problems = validate(resolve(["+profile=cpu", *overrides], check=False).cfg)
    assert any(message in p for p in problems), problems
