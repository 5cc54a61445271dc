"""Disaggregated prefill (kv_transfer=p2p): a producer's prefill is fetched
by a consumer over ZeroMQ/TCP, which runs only the last prompt token and
decodes the same tokens and logprobs as an engine that did everything; the
consumer's other requests run while it waits; a fetch that fails (another
engine, other tokens, nobody listening) is computed instead; aborted fetches
and unfetched prefills give their blocks back; hostile messages do not stop
the producer; the request fields and the config refuse what cannot run."""

import dataclasses
import time

import msgspec
import pytest
import zmq

from appliance import LLM, SamplingParams
from appliance.config.compose import resolve
from appliance.config.plan import make_plan
from appliance.engine.kv_p2p import kv_transfer_problem
from appliance.engine.request import RequestStatus
from appliance.errors import ConfigError
from appliance.worker.executor import free_port

PROMPT = " ".join(str(i) for i in range(200))
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
BASE = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05", "model.dtype=float32"]


def _producer(*extra):
    return LLM(overrides=[*BASE, "kv_transfer=p2p", "kv_transfer.role=producer", f"kv_transfer.p2p.port={free_port()}",
                          *extra])


def _consumer(*extra):
    return LLM(overrides=[*BASE, "kv_transfer=p2p", "kv_transfer.role=consumer", *extra])


@pytest.fixture(scope="module")
def pair():
    return _producer(), _consumer("kv_transfer.p2p.timeout_s=2")


@pytest.fixture(scope="module")
def reference():
    return LLM(overrides=BASE).generate([PROMPT], GREEDY, use_tqdm=False)[0]


def _prefill(producer, prompt=PROMPT):
    params = dataclasses.replace(GREEDY, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return producer.generate([prompt], params, use_tqdm=False)[0].kv_transfer_params


def _decode(consumer, kv_params, prompt=PROMPT, fresh=True):
    """The consumer's answer; ``fresh``: its pool forgets what earlier tests cached."""
    if fresh:
        assert consumer.engine.reset_prefix_cache()
    return consumer.generate([prompt], dataclasses.replace(GREEDY, kv_transfer_params=kv_params), use_tqdm=False)[0]


def _same(a, b):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert [lp.top for lp in a.outputs[0].logprobs] == [lp.top for lp in b.outputs[0].logprobs]


def _settle(llm, until, timeout_s=10.0):
    """Step an idle engine (as the server's loop does) until ``until()``."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "the engine did not settle"
        llm.engine.step()
        time.sleep(0.01)


def test_a_consumer_decodes_a_producers_prefill(pair, reference):
    producer, consumer = pair
    kv = producer.engine.scheduler.kv
    free = kv.num_free_blocks
    params = _prefill(producer)
    n = len(reference.prompt_token_ids)
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == n
    assert len(params["remote_block_ids"]) == -(-n // kv.block_size)
    assert kv.num_free_blocks < free  # held for the consumer
    loaded = consumer.engine.scheduler.connector.loaded_tokens
    out = _decode(consumer, params)
    _same(out, reference)
    assert out.num_cached_tokens == n - 1  # only the last prompt token ran here
    assert consumer.engine.scheduler.connector.loaded_tokens - loaded == n - 1
    _settle(producer, lambda: not producer.engine.has_kv_transfers())
    assert kv.num_free_blocks == free  # released once fetched
    kv.check_integrity()
    consumer.engine.scheduler.kv.check_integrity()


def test_the_consumers_pool_hits_come_first(pair, reference):
    """Blocks the consumer already caches are not fetched again."""
    producer, consumer = pair
    head = " ".join(str(i) for i in range(120))
    assert consumer.engine.reset_prefix_cache()
    consumer.generate([head], GREEDY, use_tqdm=False)
    loaded = consumer.engine.scheduler.connector.loaded_tokens
    out = _decode(consumer, _prefill(producer), fresh=False)
    _same(out, reference)
    hits = len(consumer.tokenizer.encode(head)) // consumer.engine.block_size * consumer.engine.block_size
    assert consumer.engine.scheduler.connector.loaded_tokens - loaded == len(reference.prompt_token_ids) - 1 - hits


def test_other_requests_run_while_one_waits_for_its_kv(pair, reference):
    """The producer has not yet handed its transfer to its worker (no step
    since the prefill ended): the consumer's fetch waits, its other request
    runs to the end meanwhile, then the fetch completes."""
    producer, consumer = pair
    params = dataclasses.replace(GREEDY, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    producer.engine.add_request("held", reference.prompt_token_ids, params)
    kv_params = None
    while kv_params is None:
        kv_params = next((d.kv_transfer_params for d in producer.engine.step() if d.finished), None)
    assert producer.engine.has_unfinished_requests()  # the registration is due with the next step
    core = consumer.engine
    assert core.reset_prefix_cache()
    core.add_request("remote", reference.prompt_token_ids, dataclasses.replace(GREEDY, kv_transfer_params=kv_params))
    core.add_request("local", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    finished = set()
    for _ in range(40):
        finished |= {d.request_id for d in core.step() if d.finished}
        time.sleep(0.005)
    assert finished == {"local"}
    assert core.scheduler.requests["remote"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    producer.engine.step()  # hands the transfer over; the waiting fetch is answered
    tokens = []
    deadline = time.monotonic() + 10
    while "remote" not in finished:
        assert time.monotonic() < deadline
        for d in core.step():
            if d.request_id == "remote":
                tokens += d.new_token_ids
                finished |= {"remote"} if d.finished else set()
    assert tokens == reference.outputs[0].token_ids
    assert core.scheduler.connector.failed_loads == 0


@pytest.mark.parametrize("spoil", ["engine", "tokens", "port"])
def test_a_fetch_that_fails_computes_the_prompt(pair, reference, spoil):
    producer, consumer = pair
    params = _prefill(producer)
    prompt = PROMPT
    if spoil == "engine":  # the producer restarted
        params["remote_engine_id"] = "0" * 32
    elif spoil == "tokens":  # the KV of another prompt
        prompt = PROMPT.replace("17", "71")
    else:  # nobody listens there
        params["remote_port"] = free_port()
    failed = consumer.engine.scheduler.connector.failed_loads
    out = _decode(consumer, params, prompt)
    assert consumer.engine.scheduler.connector.failed_loads == failed + 1
    if spoil != "tokens":
        _same(out, reference)
    else:
        assert out.outputs[0].finish_reason == "length"
    consumer.engine.scheduler.kv.check_integrity()
    if spoil != "port":  # released by the failed fetch too (unfetched, it would wait for its timeout)
        _settle(producer, lambda: not producer.engine.has_kv_transfers())


def test_an_aborted_fetch_frees_its_blocks_when_it_ends():
    consumer = _consumer("kv_transfer.p2p.timeout_s=0.5")
    core = consumer.engine
    kv = core.scheduler.kv
    free = kv.num_free_blocks
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1",
              "remote_port": free_port(), "remote_request_id": "t", "remote_block_ids": list(range(40)),
              "remote_num_tokens": 600}
    core.add_request("r", [3 + i % 500 for i in range(600)], dataclasses.replace(GREEDY, kv_transfer_params=params))
    core.step()
    assert core.scheduler.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    held = free - kv.num_free_blocks
    assert held == -(-599 // kv.block_size)
    core.abort(["r"])
    assert kv.num_free_blocks == free - held  # the fetch may still write into them
    _settle(consumer, lambda: kv.num_free_blocks == free)
    assert not core.has_kv_transfers()
    kv.check_integrity()


def test_an_unfetched_prefill_is_freed_after_the_timeout():
    producer = _producer("kv_transfer.p2p.timeout_s=0.3")
    kv = producer.engine.scheduler.kv
    free = kv.num_free_blocks
    assert _prefill(producer) is not None
    assert kv.num_free_blocks < free
    _settle(producer, lambda: kv.num_free_blocks == free)
    assert not producer.engine.has_kv_transfers()


def test_hostile_messages_do_not_stop_the_producer(pair, reference):
    producer, consumer = pair
    params = _prefill(producer)
    producer.engine.step()  # the transfer is registered
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{params['remote_port']}")

    def ask(*frames):
        sock.send_multipart(list(frames))
        assert sock.poll(5000)
        return sock.recv_multipart()

    pull = {"transfer": params["remote_request_id"], "engine": params["remote_engine_id"], "layout": "?",
            "blocks": params["remote_block_ids"], "tokens": 10}
    assert ask(b"garbage")[0] == b"error"
    assert ask(b"pull", b"\xc1not msgpack")[0] == b"error"
    assert ask(b"pull", msgspec.msgpack.encode({"transfer": 5}))[0] == b"error"
    assert ask(b"pull", msgspec.msgpack.encode(pull)) == [b"error", b"another KV layout (model, dtype or block shape differ)"]
    layout = producer.engine.runner.kv_connector.layout
    outside = {**pull, "layout": layout, "blocks": [max(params["remote_block_ids"]) + 1]}
    assert ask(b"pull", msgspec.msgpack.encode(outside)) == [b"error", b"blocks or tokens outside the transfer"]
    sock.close()
    _same(_decode(consumer, params), reference)  # the transfer still serves its consumer


@pytest.mark.parametrize("kv_params,role,message", [
    ({"do_remote_decode": True}, "consumer", "this server is a consumer"),
    ({"do_remote_prefill": True}, "producer", "this server is a producer"),
    ({"do_remote_decode": "yes"}, "both", "must be booleans"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "both", "cannot both be true"),
    ({"do_remote_prefill": True, "remote_engine_id": "e"}, "both", "remote_host must be a string"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "h", "remote_port": 70000,
      "remote_request_id": "t", "remote_block_ids": [0], "remote_num_tokens": 4}, "both", "remote_port must be in"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "h", "remote_port": 1,
      "remote_request_id": "t", "remote_block_ids": [0, -1], "remote_num_tokens": 4}, "both", "remote_block_ids must"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "h", "remote_port": 1,
      "remote_request_id": "t", "remote_block_ids": [0], "remote_num_tokens": 40}, "both", "cannot hold"),
])
def test_kv_transfer_params_are_checked(kv_params, role, message):
    problem = kv_transfer_problem(SamplingParams(kv_transfer_params=kv_params), "p2p", role, 16)
    assert problem is not None and message in problem


def test_kv_transfer_params_need_the_p2p_connector():
    params = SamplingParams(kv_transfer_params={"do_remote_decode": True})
    assert "this server's KV connector is none" in kv_transfer_problem(params, None, "", 16)
    assert "is offload" in kv_transfer_problem(params, "offload", "both", 16)
    assert "n=1" in kv_transfer_problem(dataclasses.replace(params, n=2), "p2p", "both", 16)
    llm = LLM(overrides=BASE)
    with pytest.raises(ValueError, match="kv_transfer_params asks for disaggregated prefill"):
        llm.engine.add_request("r", [1, 2, 3], params)
    with pytest.raises(ValueError, match=r"one sequence per request \(n=1\)"):
        llm.generate([[1, 2, 3]], dataclasses.replace(params, n=2), use_tqdm=False)


@pytest.mark.parametrize("extra,message", [
    (["kv_transfer.connector=nixl"], "kv_transfer.connector=nixl (disaggregated prefill) is not built yet"),
    (["kv_transfer=p2p", "kv_transfer.p2p.port=0"], "kv_transfer.p2p.port=0 must be a TCP port"),
    (["kv_transfer=p2p", "kv_transfer.p2p.timeout_s=0"], "kv_transfer.p2p.timeout_s=0.0 must be positive"),
    (["kv_transfer=p2p", "kv_transfer.role=consumer", "kv_transfer.p2p.port=9000"],
     "kv_transfer.p2p.port=9000 has no effect with kv_transfer.role=consumer"),
    (["kv_transfer=p2p", "kv_transfer.offload.max_gib=2"], "kv_transfer.offload.max_gib=2.0 has no effect without "
                                                           "kv_transfer.connector=offload"),
    (["kv_transfer=p2p", "parallel=tp3"], "kv_transfer.connector=p2p with 3 rank(s)"),
    (["kv_transfer.p2p.timeout_s=5"], "kv_transfer.p2p.timeout_s=5.0 has no effect without kv_transfer.connector=p2p"),
])
def test_config_refuses_what_cannot_run(extra, message):
    with pytest.raises(ConfigError) as e:
        resolve(["+profile=cpu", *extra])
    assert message in str(e.value)


def test_plan_describes_the_roles():
    def words(*extra):
        return make_plan(resolve(["+profile=cpu", "kv_transfer=p2p", *extra]).cfg).kv_transfer

    producer = words("kv_transfer.role=producer", "kv_transfer.p2p.host=prefill-0")
    assert producer.startswith("p2p (disaggregated prefill): produces") and "prefill-0:14579" in producer
    assert "consumes" not in producer
    assert words("kv_transfer.role=consumer").startswith("p2p (disaggregated prefill): consumes")
    assert "produces" in words() and "consumes" in words()


def test_a_port_in_use_is_a_clear_error():
    port = free_port()
    _producer_on = [*BASE, "kv_transfer=p2p", f"kv_transfer.p2p.port={port}"]
    LLM(overrides=_producer_on)
    with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
        LLM(overrides=_producer_on)
