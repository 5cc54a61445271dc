"""`appliance route` over two appliance instances on loopback: a multi-turn
chat workload's prefix-cache hit rate under kv_aware against one instance
serving everything and against round_robin, answers unchanged through the
router (whole and streamed; Messages, Responses and /tokenize too, a
stored response found where it is), an instance that dies taken out of the
rotation (its requests in flight answered with OpenAI errors), and
disaggregated prefill (pd) between a producer and a consumer."""

import json
import os
import subprocess
import sys
import time

import httpx
import msgspec
import pytest

from appliance.engine.kv_p2p import seal, token_digest
from appliance.server.auth import INTERNAL_KEY_ENV
from appliance.server.local import LocalServer, free_port, free_port_run
from appliance.worker.kv_checksum import kv_digest
from tests.integration.server_helpers import REPO, FakeProducer, ServerProcess, metric, post_signed
from tests.unit.test_kv_p2p import KEY

TINY = ["model=tiny_random", "cache.kv_cache_memory_gib=0.05"]
DEV = ["server.dev_mode=true"]  # /reset_prefix_cache between the workloads
CONVERSATIONS, TURNS = 5, 4  # an odd count: round robin moves each conversation to the other instance every turn


class RouterProcess(LocalServer):
    def __init__(self, *overrides, env=None):
        super().__init__(["+profile=cpu", *TINY, *overrides, "router.health_interval_s=0.5"], timeout_s=120,
                         cwd=REPO, verb="route", env=env)


@pytest.fixture(scope="module")
def instances():
    ports = [free_port(), free_port()]
    servers = []
    try:
        for p in ports:
            servers.append(ServerProcess(*TINY, *DEV, "kv_events=zmq", f"kv_events.endpoint=tcp://127.0.0.1:{p}",
                                         "kv_events.replay_endpoint=null", "kv_events.include_token_ids=true"))
        yield servers, [f"tcp://127.0.0.1:{p}" for p in ports]
    finally:
        for s in servers:
            s.stop()


def _hits(servers):
    """(prefix-cache hit tokens, query tokens) summed over the instances."""
    h = q = 0.0
    for s in servers:
        text = httpx.get(f"{s.url}/metrics").text
        h += metric(text, "appliance:prefix_cache_hits_total")
        q += metric(text, "appliance:prefix_cache_queries_total")
    return h, q


def _chat_workload(url, servers):
    """Multi-turn conversations, their turns interleaved; the hit rate they got."""
    for s in servers:
        assert httpx.post(f"{s.url}/reset_prefix_cache").status_code == 200
    h0, q0 = _hits(servers)
    convs = [[{"role": "system", "content": f"Conversation {c}. " + " ".join(f"fact {c}-{i}" for i in range(40))}]
             for c in range(CONVERSATIONS)]
    with httpx.Client(timeout=120) as client:
        for turn in range(TURNS):
            for c, msgs in enumerate(convs):
                msgs.append({"role": "user", "content": f"Question {turn} about conversation {c}?"})
                r = client.post(f"{url}/v1/chat/completions",
                                json={"model": "tiny-random-llama", "messages": msgs, "max_tokens": 6, "temperature": 0})
                assert r.status_code == 200, r.text
                msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        time.sleep(0.3)
    h1, q1 = _hits(servers)
    return (h1 - h0) / (q1 - q0)


def test_kv_aware_keeps_conversations_where_their_prefix_is(instances):
    servers, endpoints = instances
    urls = [s.url for s in servers]
    rates = {}
    for name, overrides, used in (
            ("one instance", [f"router.instances=[{urls[0]}]"], servers[:1]),
            ("kv_aware", ["router.policy=kv_aware", f"router.instances=[{','.join(urls)}]",
                          f"router.kv_events=[{','.join(endpoints)}]"], servers),
            ("round_robin", [f"router.instances=[{','.join(urls)}]"], servers)):
        router = RouterProcess(*overrides)
        try:
            rates[name] = _chat_workload(router.url, used)
            counts = httpx.get(f"{router.url}/metrics").text
        finally:
            router.stop()
        if name != "one instance":
            per = [metric(counts, "appliance_router_requests_total", instance=u) for u in urls]
            assert sum(per) == CONVERSATIONS * TURNS and min(per) > 0, (name, per)
    print("prefix-cache hit rates:", {k: round(v, 3) for k, v in rates.items()})
    assert rates["kv_aware"] >= 0.9 * rates["one instance"]
    assert rates["round_robin"] < rates["kv_aware"]


def test_answers_pass_through_and_a_dead_instance_leaves_the_rotation(instances):
    servers, _ = instances
    extra = ServerProcess(*TINY)
    router = None
    try:
        urls = [servers[0].url, extra.url]
        router = RouterProcess(f"router.instances=[{','.join(urls)}]")
        body = {"model": "tiny-random-llama", "prompt": "Hello there", "max_tokens": 5, "temperature": 0}
        direct = httpx.post(f"{servers[0].url}/v1/completions", json=body, timeout=60).json()
        routed = [httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).json() for _ in range(2)]
        assert all(r["choices"][0]["text"] == direct["choices"][0]["text"] for r in routed)
        with httpx.stream("POST", f"{router.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 2
        _other_endpoints_pass_through(router.url, servers[0].url)
        extra.stop()  # dies: connections refused, then /health fails
        for _ in range(4):
            r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == direct["choices"][0]["text"]
        time.sleep(1.2)
        health = httpx.get(f"{router.url}/health").json()
        assert health["healthy"] == [servers[0].url]
        assert metric(httpx.get(f"{router.url}/metrics").text, "appliance_router_instance_healthy",
                      instance=extra.url) == 0
    finally:
        if router is not None:
            router.stop()
        extra.stop()


def _other_endpoints_pass_through(url, instance):
    """Messages and /tokenize answered; a stored response read, continued and deleted where it is stored."""
    model = "tiny-random-llama"
    msg = httpx.post(f"{url}/v1/messages", json={"model": model, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "Hi"}]}, timeout=60)
    assert msg.status_code == 200 and msg.json()["type"] == "message"
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "Hello there"}, timeout=60).json()["tokens"]
    assert tokens == httpx.post(f"{instance}/tokenize", json={"prompt": "Hello there"}, timeout=60).json()["tokens"]
    first = httpx.post(f"{url}/v1/responses", json={"model": model, "input": "Hi", "max_output_tokens": 4},
                       timeout=60).json()
    for _ in range(2):  # round robin alternates: each continuation still goes where the first is stored
        r = httpx.post(f"{url}/v1/responses", json={"model": model, "input": "More", "max_output_tokens": 4,
                                                    "previous_response_id": first["id"]}, timeout=60)
        assert r.status_code == 200, r.text
    assert httpx.get(f"{url}/v1/responses/{first['id']}", timeout=60).json()["id"] == first["id"]
    assert httpx.delete(f"{url}/v1/responses/{first['id']}", timeout=60).json()["deleted"] is True
    assert httpx.get(f"{url}/v1/responses/{first['id']}", timeout=60).status_code == 404


def _keyless_answer(digest: str):
    """A producer without the deployment's key: well-formed blocks of the
    right tokens' digest for the transfer asked for, signed with a key of its own."""
    def answer(pull: bytes) -> list:
        payload = bytes(4096)
        header = {"transfer": msgspec.msgpack.decode(pull)["transfer"], "digest": digest, "shape": [],
                  "dtype": "float32", "checksum": kv_digest(payload)}
        return seal(b"not-the-deployments-key", b"ok", msgspec.msgpack.encode(header), payload)
    return answer


def test_pd_prefills_on_the_producer_and_decodes_on_the_consumer(instances):
    """1P1D through the router: the consumer fetches the producer's KV (all
    of the prompt but its last token counts as cached there) and answers as
    an instance that did everything, whole and streamed. Instances act on
    kv_transfer_params only from the router (signed with the deployment's
    internal key) or naming a trusted producer; the router drops a client's."""
    plain = instances[0][0]
    env = {**os.environ, INTERNAL_KEY_ENV: KEY}
    body = {"model": "tiny-random-llama", "prompt": [3 + i % 400 for i in range(150)], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    fake = FakeProducer(_keyless_answer(token_digest(body["prompt"][:149])))
    producer = ServerProcess(*TINY, "kv_transfer=p2p", "kv_transfer.role=producer",
                             f"kv_transfer.p2p.port={free_port_run(1)}", env=env)
    consumer = router = None
    try:
        consumer = ServerProcess(*TINY, *DEV, "kv_transfer=p2p", "kv_transfer.role=consumer",
                                 f"kv_transfer.p2p.trusted_producers=[127.0.0.1:{fake.port}]", env=env)
        router = RouterProcess("router.policy=pd", f"router.instances=[{consumer.url}]",
                               f"router.prefill_instances=[{producer.url}]", env=env)
        direct = httpx.post(f"{plain.url}/v1/completions", json=body, timeout=60).json()
        routed = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).json()
        assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
        usage = routed["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        assert routed["kv_transfer_params"] is None  # the consumer holds nothing for anyone
        with httpx.stream("POST", f"{router.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == direct["choices"][0]["text"]
        counts = httpx.get(f"{router.url}/metrics").text
        assert metric(counts, "appliance_router_requests_total", instance=producer.url) == 2

        # the producer's own answer carries the KV's whereabouts, to a request signed with the internal key only
        decode = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        own = post_signed(f"{producer.url}/v1/completions", decode, KEY, timeout=60).json()
        assert own["kv_transfer_params"]["remote_num_tokens"] == usage["prompt_tokens"]
        for unsigned in (httpx.post(f"{producer.url}/v1/completions", json=decode, timeout=60),
                         post_signed(f"{producer.url}/v1/completions", decode, "another-deployments-key", timeout=60),
                         httpx.post(f"{consumer.url}/v1/completions", timeout=60,
                                    json={**body, "kv_transfer_params": own["kv_transfer_params"]})):
            assert unsigned.status_code == 400 and unsigned.json()["error"]["param"] == "kv_transfer_params"
        bad = post_signed(f"{consumer.url}/v1/completions", key=KEY, timeout=60,
                          body={**body, "kv_transfer_params": {"do_remote_prefill": True, "remote_port": "x"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"
        assert httpx.post(f"{plain.url}/v1/completions",
                          json={**body, "kv_transfer_params": {"do_remote_decode": True}}).status_code == 400

        # a client's kv_transfer_params through the router are dropped, whatever they name
        poison = {"do_remote_prefill": True, "remote_engine_id": "fake", "remote_host": "127.0.0.1",
                  "remote_port": fake.port, "remote_request_id": "0" * 32, "remote_block_ids": list(range(10)),
                  "remote_num_tokens": 149}
        via = httpx.post(f"{router.url}/v1/completions", json={**body, "kv_transfer_params": poison}, timeout=60)
        assert via.status_code == 200 and via.json()["choices"][0]["text"] == direct["choices"][0]["text"]
        assert fake.pulls == 0
        # a producer the consumer trusts by address must still sign its answers: the prompt is computed instead,
        # and a later request sharing it gets the same tokens
        httpx.post(f"{consumer.url}/reset_prefix_cache", timeout=10)
        asked = httpx.post(f"{consumer.url}/v1/completions", json={**body, "kv_transfer_params": poison}, timeout=60)
        assert asked.status_code == 200 and fake.pulls == 1
        assert asked.json()["choices"][0]["text"] == direct["choices"][0]["text"]
        again = httpx.post(f"{consumer.url}/v1/completions", json=body, timeout=60).json()
        assert again["choices"][0]["text"] == direct["choices"][0]["text"]
    finally:
        fake.stop()
        for s in (router, consumer, producer):
            if s is not None:
                s.stop()


def test_route_needs_instances():
    r = subprocess.run([sys.executable, "-m", "appliance.cli", "route", "+profile=cpu"], cwd=REPO,
                       capture_output=True, text=True, env={**os.environ})
    assert r.returncode != 0 and "needs router.instances" in r.stderr
