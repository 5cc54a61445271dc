"""`appliance route`'s parts without a network: the prefix index built from
KV events, the load read from /metrics, each policy's choice, and the
config's refusals. Instances on loopback: tests/integration/test_router.py."""

import asyncio
import json
import time

import httpx
import pytest

from appliance.config.compose import resolve
from appliance.errors import ConfigError
from appliance.engine.kv_cache.block_pool import KVCacheEvent as PoolEvent
from appliance.server.auth import SIGNATURE_HEADER, verify_request
from appliance.server.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventPublisher
from appliance.server.local import free_port
from appliance.server.router import Router, parse_load
from appliance.server.router_events import EventSubscriber, PrefixIndex

KEY = b"a-test-internal-key-0123456789"


def _stored(hashes, parent, tokens, bs=4):
    return BlockStored(hashes, parent, tokens, bs, None, "CPU")


def test_the_index_follows_stored_removed_and_cleared_blocks():
    idx = PrefixIndex()
    assert idx.match([1, 2, 3, 4]) == 0  # no block size known yet: nothing matches
    idx.apply([_stored([11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8]), _stored([13], 12, [9, 9, 9, 9])])
    assert idx.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 0]) == 12
    assert idx.match([1, 2, 3, 4, 5, 6, 7, 0, 9]) == 4  # the second block differs
    assert idx.match([9, 9, 9, 9]) == 0  # the same tokens under another parent are another block
    idx.apply([BlockRemoved([12], "CPU")])
    assert idx.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9]) == 4  # the chain breaks where a block left
    idx.apply([AllBlocksCleared()])
    assert len(idx) == 0 and idx.match([1, 2, 3, 4]) == 0


def test_load_is_running_plus_waiting_over_the_engine_cores():
    text = ('appliance:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'appliance:num_requests_running{engine="1",model_name="m"} 1.0\n'
            'appliance:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'appliance:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n')
    assert parse_load(text) == 6.0


def test_policies_choose_as_they_say():
    rr = Router(["http://a", "http://b", "http://c"], "round_robin")
    assert [rr.choose().url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    rr.instances[1].healthy = False  # skipped until healthy again
    assert {rr.choose().url for _ in range(4)} == {"http://a", "http://c"}
    assert rr.choose(exclude=frozenset({"http://a", "http://c"})) is None

    ll = Router(["http://a", "http://b"], "least_load")
    ll.instances[0].load, ll.instances[1].load = 3, 1
    assert ll.choose().url == "http://b"
    ll.instances[1].in_flight = 5  # what this router has sent counts too
    assert ll.choose().url == "http://a"

    kv = Router(["http://a", "http://b"], "kv_aware", kv_events=["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"],
                kv_load_weight=4)
    fresh = [40, 41, 42, 43, 44]
    assert kv.choose(fresh).url == "http://a"  # nothing cached anywhere: the fewest blocks, then order
    kv.instances[1].index.apply([_stored([1, 2], None, [5, 6, 7, 8, 9, 10, 11, 12])])
    assert kv.choose(fresh).url == "http://a"  # no match: where less is cached
    kv.instances[0].index.apply([_stored([3, 4, 5], None, [20] * 12)])
    assert kv.choose(fresh).url == "http://b"
    assert kv.choose([5, 6, 7, 8] + [50] * 12).url == "http://b"  # 4 of 16 under the threshold: still b (fewer)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert kv.choose(prompt).url == "http://b"  # 8 cached tokens
    kv.instances[1].in_flight = 1
    assert kv.choose(prompt).url == "http://b"  # 8 - 4 > 0
    kv.instances[1].in_flight = 3
    assert kv.choose(prompt).url == "http://a"  # 8 - 12 < 0: the load outweighs the prefix


def test_a_router_needs_instances_and_a_built_policy():
    with pytest.raises(ValueError, match="router.instances is empty"):
        Router([], "round_robin")
    with pytest.raises(ValueError, match="is not built"):
        Router(["http://a"], "random")
    with pytest.raises(ValueError, match="router.prefill_instances: the producers' base URLs"):
        Router(["http://a"], "pd", internal_key=KEY)
    with pytest.raises(ValueError, match="router.policy=pd signs the requests .* needs the deployment's internal key"):
        Router(["http://a"], "pd", prefill_instances=["http://p"])
    with pytest.raises(ValueError, match="with router.policy=pd only"):
        Router(["http://a"], "round_robin", prefill_instances=["http://p"])
    with pytest.raises(ValueError, match="needs router.kv_events"):
        Router(["http://a", "http://b"], "kv_aware", kv_events=["tcp://127.0.0.1:1"])


@pytest.mark.parametrize("extra,message", [
    (["router.policy=pd", "router.instances=[http://a:1]"], "router.policy=pd needs router.prefill_instances"),
    (["router.prefill_instances=[http://p:1]"], "router.prefill_instances has no effect with router.policy=round_robin"),
    (["router.policy=pd", "router.instances=[http://a:1]", "router.prefill_instances=[p:1]"],
     "router.prefill_instances: p:1 is not an http:// or https:// base URL"),
    (["router.policy=random"], "router.policy=random is unknown"),
    (["router.instances=[localhost:8000]"], "is not an http:// or https:// base URL"),
    (["router.policy=kv_aware", "router.instances=[http://a:1,http://b:2]", "router.kv_events=[tcp://a:3]"],
     "needs one KV events endpoint per instance"),
    (["router.kv_events=[tcp://a:3]"], "router.kv_events has no effect with router.policy=round_robin"),
    (["router.policy=kv_aware", "router.instances=[http://a:1]", "router.kv_events=[tcp://a:3]",
      "router.kv_events_replay=[tcp://a:4,tcp://a:5]"], "router.kv_events_replay: one replay endpoint per entry"),
    (["router.port=0"], "router.port=0 must be in 1..65535"),
    (["router.health_interval_s=0"], "router.health_interval_s=0.0 must be positive"),
])
def test_config_refuses_impossible_routers(extra, message):
    with pytest.raises(ConfigError) as e:
        resolve(["+profile=cpu", *extra])
    assert message in str(e.value)


def _pd_router(answer):
    """A pd router whose producers answer with ``answer(request)`` (no network); the requests they got."""
    seen = []

    def handler(request):
        seen.append(request)
        return answer(request)

    router = Router(["http://consumer"], "pd", prefill_instances=["http://p0", "http://p1"], internal_key=KEY)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return router, seen


PRODUCED = {"do_remote_prefill": True, "remote_request_id": "t"}


def test_pd_prefills_on_a_producer_then_hands_its_kv_to_a_consumer():
    router, seen = _pd_router(lambda r: httpx.Response(200, json={"kv_transfer_params": PRODUCED}))
    body = {"prompt": "hello", "max_tokens": 20, "min_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    out = asyncio.run(router._prefill_first("/v1/completions", body, {"authorization": "Bearer k", "cookie": "c"}))
    assert out == {**body, "kv_transfer_params": PRODUCED}
    sent = json.loads(seen[0].content)
    assert sent == {"prompt": "hello", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    assert seen[0].headers["authorization"] == "Bearer k" and "cookie" not in seen[0].headers
    assert verify_request(KEY, seen[0].content, seen[0].headers[SIGNATURE_HEADER])  # the producer acts on it
    chat = {"messages": [], "max_completion_tokens": 9}
    asyncio.run(router._prefill_first("/v1/chat/completions", chat, {}))
    assert json.loads(seen[1].content)["max_completion_tokens"] == 1
    assert {seen[0].url.host, seen[1].url.host} == {"p0", "p1"}  # the producers in turn


@pytest.mark.parametrize("body", [{"prompt": ["a", "b"]}, {"prompt": "a", "n": 2}, {"prompt": "a", "prompt_logprobs": 1},
                                  {"prompt": "a", "echo": True, "logprobs": 0}])
def test_pd_leaves_whole_what_cannot_be_split(body):
    router, seen = _pd_router(lambda r: httpx.Response(200, json={"kv_transfer_params": PRODUCED}))
    assert asyncio.run(router._prefill_first("/v1/completions", body, {})) == body
    assert not seen


@pytest.mark.parametrize("answer", [lambda r: httpx.Response(503, json={}), lambda r: httpx.Response(200, json={}),
                                    lambda r: httpx.Response(200, content=b"not json")])
def test_a_failed_prefill_leaves_the_prompt_to_the_consumer(answer):
    router, seen = _pd_router(answer)
    body = {"prompt": "a"}
    assert asyncio.run(router._prefill_first("/v1/completions", body, {})) == body
    assert len(seen) == 1


def test_a_refused_prefill_tries_the_other_producer():
    def answer(request):
        if request.url.host == "p0":
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"kv_transfer_params": PRODUCED})

    router, seen = _pd_router(answer)
    for _ in range(2):  # one of the two goes to p0 first
        assert asyncio.run(router._prefill_first("/v1/completions", {"prompt": "a"}, {}))["kv_transfer_params"] \
            == PRODUCED
    assert not router.prefill[0].healthy and [r.url.host for r in seen].count("p0") == 1


@pytest.mark.parametrize("policy", ["round_robin", "pd"])
def test_a_clients_kv_transfer_params_never_reach_an_instance(policy):
    """Dropped under every policy; what reaches a consumer under pd is the
    producer's answer, signed; an instance request without them is not signed."""
    seen = []

    def handler(request):
        seen.append(request)
        return httpx.Response(200, json={"kv_transfer_params": PRODUCED})

    pd = {"prefill_instances": ["http://p0"], "internal_key": KEY} if policy == "pd" else {}
    router = Router(["http://consumer"], policy, **pd)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    poison = {"do_remote_prefill": True, "remote_host": "evil", "remote_port": 1}
    status, _, _ = asyncio.run(router.forward("/v1/completions", {"prompt": "a", "kv_transfer_params": poison}, {}))
    assert status == 200
    to_consumer = json.loads(seen[-1].content)
    if policy == "pd":
        assert to_consumer["kv_transfer_params"] == PRODUCED
        assert verify_request(KEY, seen[-1].content, seen[-1].headers[SIGNATURE_HEADER])
    else:
        assert "kv_transfer_params" not in to_consumer and SIGNATURE_HEADER not in seen[-1].headers


def _until(check, timeout_s=10.0, poke=None):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        if poke is not None:
            poke()
        time.sleep(0.05)


def test_the_router_replays_what_its_subscription_missed():
    """Batches published before the router subscribed come from the replay
    endpoint; an instance whose sequence starts over restarted: its index is
    cleared; without a replay endpoint the missed batches are counted."""
    port, replay_port = free_port(), free_port()
    endpoint, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
    h = [bytes([i]) * 32 for i in range(1, 5)]
    pub = KVEventPublisher(endpoint, replay, buffer_steps=100, include_token_ids=True)
    pub.publish([PoolEvent("BlockStored", (h[0],), None, (1, 2, 3, 4), 4)])
    pub.publish([PoolEvent("BlockStored", (h[1],), h[0], (5, 6, 7, 8), 4)])
    _until(pub._queue.empty)
    time.sleep(0.2)  # both sent, to nobody
    index, plain = PrefixIndex(), PrefixIndex()
    subs = [EventSubscriber(endpoint, index, replay_endpoint=replay), EventSubscriber(endpoint, plain)]
    for s in subs:
        s.start()
    try:
        third = [PoolEvent("BlockStored", (h[2],), h[1], (9, 10, 11, 12), 4)]
        _until(lambda: min(s.batches for s in subs) > 0, poke=lambda: pub.publish(third))
        assert index.match(list(range(1, 13))) == 12 and subs[0].replayed >= 2 and subs[0].missed == 0
        assert plain.match(list(range(1, 13))) == 0 and subs[1].missed >= 2  # it never saw the first two
        for _ in range(200):  # far past what the restarted instance sends before the router reconnects
            pub.publish([PoolEvent("BlockRemoved", (bytes([9]) * 32,))])
        _until(lambda: subs[0]._next > 200)
        pub.close()
        pub = KVEventPublisher(endpoint, replay, buffer_steps=100, include_token_ids=True)  # the instance restarted
        fresh = [PoolEvent("BlockStored", (h[3],), None, (13, 14, 15, 16), 4)]
        _until(lambda: subs[0].restarts == 1 and index.match([13, 14, 15, 16]) == 4, poke=lambda: pub.publish(fresh))
        assert index.match(list(range(1, 13))) == 0
    finally:
        for s in subs:
            s.stop()
        pub.close()
