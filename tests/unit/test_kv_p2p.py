"""Disaggregated prefill (kv_transfer=p2p): a producer's prefill is fetched
by a consumer over ZeroMQ/TCP, which runs only the last prompt token and
decodes the same tokens and logprobs as an engine that did everything; the
consumer's other requests run while it waits; a fetch that fails (another
engine, other tokens, nobody listening) is computed instead; aborted fetches
and unfetched prefills give their blocks back; hostile messages do not stop
the producer; messages not signed with the deployment's internal key, and
blocks that fail their checksum or hold NaN, are refused and computed
instead; the request fields and the config refuse what cannot run."""

import dataclasses
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import torch
import zmq

from appliance import LLM, SamplingParams
from appliance.config.compose import resolve
from appliance.config.plan import make_plan
from appliance.engine.kv_p2p import kv_transfer_problem, kv_transfer_trust_problem, seal, unseal
from appliance.engine.request import RequestStatus
from appliance.errors import ConfigError
from appliance.server.local import free_port_run
from appliance.worker.rank_group import free_port

PROMPT = " ".join(str(i) for i in range(200))
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
KEY = "a-test-internal-key-0123456789"  # the deployment's internal key: producers and consumers sign with it
KEY_BYTES = KEY.encode()
BASE = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05", "model.dtype=float32",
        f"server.internal_key={KEY}"]


def _producer(*extra, connector="p2p"):
    return LLM(overrides=[*BASE, f"kv_transfer={connector}", "kv_transfer.role=producer",
                          f"kv_transfer.p2p.port={free_port_run(1)}", *extra])


def _consumer(*extra, connector="p2p"):
    return LLM(overrides=[*BASE, f"kv_transfer={connector}", "kv_transfer.role=consumer", *extra])


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
    """The same tokens and top logprobs. The consumer computes only the last
    prompt token (one query row against the fetched K/V) where the reference
    computes it inside a prefill tile: the same sums in another order, so the
    logprobs agree to float32 rounding rather than bit for bit."""
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-5)


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


def test_a_drafting_consumer_catches_its_draft_up_over_the_fetched_prompt(pair, reference):
    """The producer sends the target's KV only: a consumer drafting with a
    draft model runs the draft over the fetched prompt before it drafts
    (its draft K/V at those slots is not the draft's own otherwise). With
    the target as its own draft every draft is then accepted, and the
    tokens are the reference's."""
    from tests.unit.test_spec_draft import SELF

    producer, _ = pair
    drafting = _consumer(*SELF)
    out = _decode(drafting, _prefill(producer))
    _same(out, reference)
    assert out.num_cached_tokens == len(reference.prompt_token_ids) - 1
    stats = drafting.engine.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens


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


def _failed_fetch(pair, reference, spoil):
    """A fetch spoiled by ``spoil`` fails and the consumer computes the
    prompt; the producer's port, and the parameters it returned."""
    producer, consumer = pair
    params = _prefill(producer)
    prompt, port = PROMPT, params["remote_port"]
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
    return port, params


@pytest.mark.parametrize("spoil", ["engine", "tokens", "port"])
def test_a_fetch_that_fails_computes_the_prompt(pair, reference, spoil):
    producer = pair[0]
    port, params = _failed_fetch(pair, reference, spoil)
    if spoil == "port":  # the producer never heard of it: release it as a consumer would
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(seal(KEY.encode(), b"done", msgspec.msgpack.encode({"transfer": params["remote_request_id"]})))
        sock.close(linger=1000)
    _settle(producer, lambda: not producer.engine.has_kv_transfers())  # released by the failed fetch too


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
    assert held == -(-600 // kv.block_size)  # the fetched 599 tokens and the last one's slot
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

    def ask(*frames, key=KEY_BYTES):
        """The producer's answer, its MAC checked (None: not signed with ``key``)."""
        sock.send_multipart(list(frames))
        assert sock.poll(5000)
        answer = unseal(key, sock.recv_multipart())
        return None if answer is None else [answer[0], answer[1], *answer[2]]

    def signed(kind, body, key=KEY_BYTES):
        return ask(*seal(key, kind, body))

    pull = {"transfer": params["remote_request_id"], "engine": params["remote_engine_id"], "layout": "?",
            "first": 0, "count": 2, "tokens": 10}
    unsigned = [b"error", b"a message not signed with this deployment's internal key"]
    layout = producer.engine.runner.kv_connector.layout
    good = msgspec.msgpack.encode({**pull, "layout": layout})
    assert ask(b"garbage") == unsigned
    assert ask(b"pull", good) == unsigned  # a well-formed pull without its MAC
    assert ask(b"pull", good, b"\0" * 32) == unsigned
    assert signed(b"pull", good, key=b"another-deployments-key") == unsigned
    assert signed(b"pull", b"\xc1not msgpack")[0] == b"error"
    assert signed(b"pull", msgspec.msgpack.encode({"transfer": 5}))[0] == b"error"
    assert signed(b"pull", msgspec.msgpack.encode(pull)) == [b"error", b"another KV layout (model, dtype or block "
                                                                       b"shape differ)"]
    n = len(params["remote_block_ids"])
    for outside in ({"first": n - 1, "count": 2}, {"first": -1, "count": 1}, {"count": [1]}, {"tokens": 10**6}):
        msg = msgspec.msgpack.encode({**pull, "layout": layout, **outside})
        assert signed(b"pull", msg) == [b"error", b"blocks or tokens outside the transfer"], outside
    ended = {**pull, "transfer": "0" * 32}  # never registered (or long ended): refused at once, not waited for
    assert signed(b"pull", msgspec.msgpack.encode({**ended, "engine": "other"}))[0] == b"error"
    assert signed(b"done", msgspec.msgpack.encode({"transfer": params["remote_request_id"]}),
                  key=b"another-deployments-key") == unsigned  # an unsigned done frees nothing
    sock.close()
    _same(_decode(consumer, params), reference)  # the transfer still serves its consumer


def _tamper(monkeypatch, producer, change):
    """The producer's answers changed by ``change(header, data)`` (the
    header as a dict, the blocks as uint8 bytes; in place), then signed with
    ``header.pop("key")`` if ``change`` puts one there, else the deployment's:
    a producer that holds the key but sends bad blocks, or one that does not."""
    worker = producer.engine.runner.kv_connector
    serve = worker._serve_blocks

    def tampered(*args):
        frames = serve(*args)
        header = msgspec.msgpack.decode(frames[1])
        data = torch.frombuffer(bytearray(frames[2]), dtype=torch.uint8) if len(frames[2]) else torch.empty(0)
        change(header, data)
        return seal(header.pop("key", KEY.encode()), b"ok", msgspec.msgpack.encode(header), data.numpy().tobytes())

    monkeypatch.setattr(worker, "_serve_blocks", tampered)


def _flip(header, data):
    data[len(data) // 2] ^= 0x10  # one bit of one K/V value


def _nan(header, data):  # checksummed as sent: only the values give it away
    from appliance.worker.kv_checksum import gathered_layers, layers_digest

    data.view(torch.float32)[7] = float("nan")
    header["checksum"] = layers_digest(gathered_layers(data.view(header["shape"][0], -1)))

SPOILED_BLOCKS = {
    "a flipped bit": (_flip, "blocks that do not match their checksum"),
    "a NaN": (_nan, "blocks holding NaN or infinite values"),
    "another key": (lambda h, d: h.update(key=b"another-deployments-key"), "not signed with this deployment's"),
    "another transfer": (lambda h, d: h.update(transfer="0" * 32), "an answer for another transfer"),
    "another shape": (lambda h, d: h.update(shape=[1, 2, 3]), "blocks of another KV layout"),
}


@pytest.mark.parametrize("spoil", list(SPOILED_BLOCKS))
def test_blocks_that_fail_their_checks_never_enter_the_cache(pair, reference, monkeypatch, caplog, spoil):
    """A producer's answer with a flipped bit, NaN values (correctly
    checksummed), another key's MAC, another transfer's header or another
    shape: the load fails, the consumer computes the prompt, and neither
    that request nor a later one sharing its prefix sees other tokens. The
    warning says why without the consumer's own KV layout."""
    producer, consumer = pair
    change, reason = SPOILED_BLOCKS[spoil]
    _tamper(monkeypatch, producer, change)
    params = _prefill(producer)
    failed = consumer.engine.scheduler.connector.failed_loads
    with caplog.at_level("WARNING", logger="appliance.kv_p2p"):
        _same(_decode(consumer, params), reference)
    assert consumer.engine.scheduler.connector.failed_loads == failed + 1
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert reason in warning
    like = consumer.engine.runner.kv_caches[0]
    assert str(list(like.shape[2:])) not in warning and str(list(like.shape[2:-1])) not in warning
    _same(_decode(consumer, _prefill(producer), fresh=False), reference)  # the prefix the failed load left
    _settle(producer, lambda: not producer.engine.has_kv_transfers())
    consumer.engine.scheduler.kv.check_integrity()


@pytest.mark.parametrize("kv_params,internal,trusted,refused", [
    ({"do_remote_decode": True}, True, [], None),
    ({"do_remote_decode": True}, False, ["127.0.0.1:9000"], "ask this server to hold KV for a consumer"),
    ({"do_remote_prefill": True, "remote_host": "10.0.0.5", "remote_port": 9000}, True, [], None),
    ({"do_remote_prefill": True, "remote_host": "10.0.0.5", "remote_port": 9000}, False, ["10.0.0.5:9000"], None),
    ({"do_remote_prefill": True, "remote_host": "10.0.0.5", "remote_port": 9001}, False, ["10.0.0.5"], None),
    ({"do_remote_prefill": True, "remote_host": "::1", "remote_port": 9000}, False, ["[::1]:9000"], None),
    ({"do_remote_prefill": True, "remote_host": "10.0.0.5", "remote_port": 9001}, False, ["10.0.0.5:9000"],
     "name producer 10.0.0.5:9001, which this server does not trust"),
    ({"do_remote_prefill": True, "remote_host": "evil.example", "remote_port": 9000}, False, [],
     "name producer evil.example:9000, which this server does not trust"),
])
def test_kv_transfer_params_come_from_the_router_or_name_a_trusted_producer(kv_params, internal, trusted, refused):
    problem = kv_transfer_trust_problem(kv_params, internal, trusted)
    assert problem is None if refused is None else refused in problem and "trusted_producers" in problem


def test_disaggregated_prefill_needs_the_internal_key(monkeypatch):
    monkeypatch.delenv("APPLIANCE_INTERNAL_KEY", raising=False)
    plain = [o for o in BASE if not o.startswith("server.internal_key")]
    with pytest.raises(ConfigError, match="kv_transfer.connector=p2p .* needs the deployment's internal key"):
        LLM(overrides=[*plain, "kv_transfer=p2p", "kv_transfer.role=consumer"])
    with pytest.raises(ConfigError, match="must hold at least 16 bytes"):
        LLM(overrides=[*plain, "kv_transfer=p2p", "kv_transfer.role=consumer", "server.internal_key=short"])


def test_a_transfer_is_served_until_released_and_never_again(pair, reference):
    """A failed step hands its registrations over again: a transfer already
    fetched stays ended (its blocks may be another request's by then)."""
    producer, consumer = pair
    params = _prefill(producer)
    worker = producer.engine.runner.kv_connector
    spec = worker._sends[params["remote_request_id"]].spec
    _same(_decode(consumer, params), reference)
    _settle(producer, lambda: not producer.engine.has_kv_transfers())
    from appliance.engine.kv_p2p import P2PMetadata
    worker.start_load_kv(P2PMetadata(sends=[spec]), producer.engine.runner.kv_caches)
    assert params["remote_request_id"] not in worker._sends
    failed = consumer.engine.scheduler.connector.failed_loads
    _decode(consumer, params)
    assert consumer.engine.scheduler.connector.failed_loads == failed + 1


def test_a_consumer_releases_what_it_will_not_fetch(pair, reference):
    """Its pool holds the whole prompt (a prompt of whole blocks plus one
    token): the producer is told at once instead of holding for timeout_s."""
    producer, consumer = pair
    bs = consumer.engine.block_size
    prompt = reference.prompt_token_ids[: 3 * bs + 1]
    assert consumer.engine.reset_prefix_cache()
    consumer.generate([prompt], GREEDY, use_tqdm=False)
    params = _prefill(producer, prompt)
    loaded = consumer.engine.scheduler.connector.loaded_tokens
    consumer.generate([prompt], dataclasses.replace(GREEDY, kv_transfer_params=params), use_tqdm=False)
    assert consumer.engine.scheduler.connector.loaded_tokens == loaded
    _settle(consumer, lambda: not consumer.engine.has_kv_transfers())
    _settle(producer, lambda: not producer.engine.has_kv_transfers(), timeout_s=5)  # far below timeout_s (120)


def test_fetched_requests_are_not_kept_waiting_behind_one_that_cannot_fit():
    """A decoding request preempted for blocks goes back to the front of the
    queue; requests whose remote KV arrived hold blocks behind it. They hold
    all they need (their last token's slot too) and run first."""
    from appliance.engine.kv_cache.manager import KVCacheManager
    from appliance.engine.kv_connector import KVConnectorOutput
    from appliance.engine.kv_p2p import P2PConnector
    from appliance.engine.request import Request
    from appliance.engine.scheduler import Scheduler

    bs = 4
    kv = KVCacheManager(13, bs, True, "sha256")  # 12 usable blocks
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64,
                      connector=P2PConnector("consumer", "e", "h", 1, bs, 60.0, 6))
    remote = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_host": "127.0.0.1", "remote_port": 9,
              "remote_request_id": "t", "remote_block_ids": list(range(5)), "remote_num_tokens": 17}
    for rid in ("L1", "L2"):
        sched.add_request(Request(rid, list(range(1, 18)), SamplingParams(max_tokens=4, kv_transfer_params=remote)))
    out = sched.schedule()  # both start their fetches: 5 blocks each (16 tokens and the last one's slot)
    assert not out.num_scheduled_tokens and len(out.kv_connector_metadata.recvs) == 2
    big = Request("R", list(range(100, 108)), SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add_request(big)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"R": 8}
    sched.update_from_output(out, {"R": [7]})
    while big.status == RequestStatus.RUNNING:  # R decodes until the pool is out: it preempts itself
        out = sched.schedule()
        if out.num_scheduled_tokens:
            sched.update_from_output(out, {"R": [7]})
    sched.update_from_connector_output(KVConnectorOutput(finished_recving=["L1", "L2"]))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"L1", "L2"} and out.num_scheduled_tokens["L1"] == 1
    kv.check_integrity()


def test_a_report_that_arrives_with_a_failed_step_is_not_lost(pair):
    """The worker side reported a transfer fetched, then the step failed:
    the core still frees the blocks it held."""
    producer, _ = pair
    _prefill(producer)
    core, kv = producer.engine, producer.engine.scheduler.kv
    (rid,) = core.scheduler.connector.sending
    held = kv.num_free_blocks
    runner = core.runner
    real = runner._execute

    def fail_after_the_report(so, out):
        real(so, out)
        out.kv_connector_output.finished_sending.append(rid)
        raise RuntimeError("the step failed after the connector's report")

    runner._execute = fail_after_the_report
    try:
        core.step()
    finally:
        runner._execute = real
    assert rid not in core.scheduler.connector.sending and kv.num_free_blocks > held
    kv.check_integrity()


def test_the_blocks_held_for_consumers_stay_under_half_the_pool():
    producer = _producer()
    kv, connector = producer.engine.scheduler.kv, producer.engine.scheduler.connector
    prompt = [3 + i % 500 for i in range(16 * kv.block_size)]
    held = 0
    while held + 16 <= connector.max_held_blocks:
        assert _prefill(producer, prompt) is not None
        held += 16
        prompt = [t + 1 if t < 500 else 3 for t in prompt]
    assert _prefill(producer, prompt) is None  # answered, without KV to fetch: a consumer computes the prompt
    assert sum(connector.sending.values()) == held


@pytest.mark.parametrize("kv_params,role,message", [
    ({"do_remote_decode": True}, "consumer", "this server is a consumer"),
    ({"do_remote_prefill": True}, "producer", "this server is a producer"),
    ({"do_remote_decode": "yes"}, "both", "must be booleans"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "both", "cannot both be true"),
    ({"do_remote_decode": False}, "both", "asks for nothing"),
    ({"do_remote_decode": True, "do_remote_prefil": True}, "both", "unknown key(s) 'do_remote_prefil'"),
    ({"do_remote_decode": True, "remote_port": 5}, "both", "do_remote_decode with remote_port set"),
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
    params = SamplingParams(kv_transfer_params={"do_remote_decode": True, "remote_host": None})  # vLLM proxies' nulls
    assert "this server's KV connector is none" in kv_transfer_problem(params, None, "", 16)
    assert "is offload" in kv_transfer_problem(params, "offload", "both", 16)
    assert "n=1" in kv_transfer_problem(dataclasses.replace(params, n=2), "p2p", "both", 16)
    llm = LLM(overrides=BASE)
    with pytest.raises(ValueError, match="kv_transfer_params asks for disaggregated prefill"):
        llm.engine.add_request("r", [1, 2, 3], params)
    with pytest.raises(ValueError, match=r"one sequence per request \(n=1\)"):
        llm.generate([[1, 2, 3]], dataclasses.replace(params, n=2), use_tqdm=False)


@pytest.mark.parametrize("extra,message", [
    (["kv_transfer=p2p", "kv_transfer.p2p.port=0"], "kv_transfer.p2p.port=0 must be a TCP port"),
    (["kv_transfer=p2p", "kv_transfer.p2p.timeout_s=0"], "kv_transfer.p2p.timeout_s=0.0 must be positive"),
    (["kv_transfer=p2p", "kv_transfer.role=consumer", "kv_transfer.p2p.port=9000"],
     "kv_transfer.p2p.port=9000 has no effect with kv_transfer.role=consumer"),
    (["kv_transfer=p2p", "kv_transfer.offload.max_gib=2"], "kv_transfer.offload.max_gib=2.0 has no effect without "
                                                           "kv_transfer.connector=offload"),
    (["kv_transfer=p2p", "parallel=tp3", "parallel.executor=ray"],
     "kv_transfer.connector=p2p on parallel.executor=ray is not built yet"),
    (["kv_transfer=p2p", "kv_transfer.p2p.bind_host=0.0.0.0"], "consumers need an address to reach this producer"),
    (["kv_transfer.p2p.timeout_s=5"], "kv_transfer.p2p.timeout_s=5.0 has no effect without kv_transfer.connector=p2p"),
    (["kv_transfer=p2p", "kv_transfer.p2p.trusted_producers=[10.0.0.5:http]"],
     "kv_transfer.p2p.trusted_producers: '10.0.0.5:http' must be host:port"),
    (["kv_transfer=p2p", "kv_transfer.p2p.trusted_producers=['::1:9000']"], "'::1:9000' must be host:port"),
    (["kv_transfer=p2p", "kv_transfer.role=producer", "kv_transfer.p2p.trusted_producers=[h:1]"],
     "trusted_producers has no effect with kv_transfer.role=producer"),
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


@pytest.mark.parametrize("extra", [["model.dtype=bfloat16"], ["cache.kv_cache_dtype=fp8_e4m3"]])
def test_other_dtypes_move_as_they_are(extra):
    """bf16 activations and KV, and an fp8 KV cache: the blocks move in the
    cache's own dtype and the consumer answers as one engine does."""
    base = [*BASE, *extra]
    plain = LLM(overrides=base).generate([PROMPT], GREEDY, use_tqdm=False)[0]
    producer = LLM(overrides=[*base, "kv_transfer=p2p", "kv_transfer.role=producer",
                              f"kv_transfer.p2p.port={free_port_run(1)}"])
    consumer = LLM(overrides=[*base, "kv_transfer=p2p", "kv_transfer.role=consumer"])
    assert producer.engine.runner.kv_caches[0].dtype == consumer.engine.runner.kv_caches[0].dtype
    out = _decode(consumer, _prefill(producer))
    assert out.num_cached_tokens == len(plain.prompt_token_ids) - 1
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    for a, b in zip(out.outputs[0].logprobs, plain.outputs[0].logprobs):
        assert abs(a.logprob - b.logprob) < 0.05


def test_an_ipv6_producer(pair, reference):
    producer = _producer("kv_transfer.p2p.bind_host='::1'")
    params = _prefill(producer)
    assert params["remote_host"] == "::1"
    consumer = pair[1]
    out = _decode(consumer, params)
    _same(out, reference)
    assert out.num_cached_tokens == len(reference.prompt_token_ids) - 1


def test_a_port_in_use_is_a_clear_error():
    port = free_port_run(1)
    _producer_on = [*BASE, "kv_transfer=p2p", f"kv_transfer.p2p.port={port}"]
    LLM(overrides=_producer_on)
    with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
        LLM(overrides=_producer_on)


def test_a_worker_left_open_stops_its_threads_at_exit():
    """An engine nobody closed: as the interpreter exits, its transfer
    threads stop before the process unloads the transports' libraries (a
    thread inside NIXL's then aborts the process)."""
    script = textwrap.dedent(f"""
        from appliance.worker.kv_p2p import P2PWorker
        worker = P2PWorker("both", "engine", "layout", "127.0.0.1", {free_port()}, 1.0, b"{KEY}")
        close = worker.close
        def reporting_close():
            close()
            print("stopped:", not any(t.is_alive() for t in worker._threads), flush=True)
        worker.close = reporting_close
        print("running:", len(worker._threads), all(t.is_alive() for t in worker._threads), flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["running: 2 True", "stopped: True"]


def test_a_load_over_ranks_ends_when_every_rank_has():
    """P2PConnector(ranks=2): a load is finished when both ranks' parts are
    in, failed once both ended and either failed (never while a rank may
    still write into the blocks); a transfer ends when both ranks' have."""
    from appliance.engine.kv_connector import KVConnectorOutput, merge_rank_outputs
    from appliance.engine.kv_p2p import P2PConnector

    c = P2PConnector("both", "e", "127.0.0.1", 9000, 16, 5.0, 100, ranks=2)

    def whole(*per_rank):
        return c.combine_ranks(merge_rank_outputs([KVConnectorOutput(**o) for o in per_rank]))

    got = whole({"finished_recving": ["a"], "failed_recving": ["b"], "finished_sending": ["s"]}, {})
    assert (got.finished_recving, got.failed_recving, got.finished_sending) == ([], [], [])
    got = whole({}, {"finished_recving": ["a", "b"], "finished_sending": ["s"]})
    assert (got.finished_recving, got.failed_recving, got.finished_sending) == (["a"], ["b"], ["s"])


def test_the_connectors_registry_and_the_engines_protocol_agree(tmp_path):
    """Every KV connector's scheduler side has what the scheduler and the core call
    (``KVConnectorScheduler``), and the engine's disaggregated-prefill connectors are the registry's."""
    from appliance.config.kv_connectors import KV_CONNECTORS
    from appliance.engine.interfaces import KVConnectorScheduler
    from appliance.engine.kv_connector import OffloadConnector
    from appliance.engine.kv_p2p import DISAGGREGATED_PREFILL, P2PConnector

    assert isinstance(OffloadConnector(tmp_path, 16), KVConnectorScheduler)
    assert isinstance(P2PConnector("both", "e", "127.0.0.1", 9000, 16, 5.0, 100), KVConnectorScheduler)
    assert not isinstance(object(), KVConnectorScheduler)
    assert set(DISAGGREGATED_PREFILL) == {c.name for c in KV_CONNECTORS.values() if c.disaggregated}
    for c in KV_CONNECTORS.values():  # each row's roles are ones validation takes
        assert c.roles and set(c.roles) <= {"producer", "consumer", "both"} and c.sections
