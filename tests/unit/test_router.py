"""`appliance route`'s parts without a network: the prefix index built from
KV events, the load read from /metrics, each policy's choice, and the
config's refusals. Instances on loopback: tests/integration/test_router.py."""

import pytest

from appliance.config.compose import resolve
from appliance.errors import ConfigError
from appliance.server.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from appliance.server.router import PrefixIndex, Router, parse_load


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
        Router(["http://a"], "pd")
    with pytest.raises(ValueError, match="needs router.kv_events"):
        Router(["http://a", "http://b"], "kv_aware", kv_events=["tcp://127.0.0.1:1"])


@pytest.mark.parametrize("extra,message", [
    (["router.policy=pd"], "router.policy=pd (disaggregated prefill through the router) is not built yet"),
    (["router.policy=random"], "router.policy=random is unknown"),
    (["router.instances=[localhost:8000]"], "is not an http:// or https:// base URL"),
    (["router.policy=kv_aware", "router.instances=[http://a:1,http://b:2]", "router.kv_events=[tcp://a:3]"],
     "needs one KV events endpoint per instance"),
    (["router.kv_events=[tcp://a:3]"], "router.kv_events has no effect with router.policy=round_robin"),
    (["router.port=0"], "router.port=0 must be in 1..65535"),
    (["router.health_interval_s=0"], "router.health_interval_s=0.0 must be positive"),
])
def test_config_refuses_impossible_routers(extra, message):
    with pytest.raises(ConfigError) as e:
        resolve(["+profile=cpu", *extra])
    assert message in str(e.value)
