"""Disaggregated prefill over NIXL (kv_transfer=nixl): the consumer reads a
producer's prefill straight out of its KV cache through NIXL's UCX backend
(host memory here) and decodes what an engine that did everything does; it
adds a producer's agent once; a fetch that fails (another engine, other
tokens, nobody listening) is computed instead; a producer's answer that
does not fit this cache is refused before anything is read; a read that
does not end in time is aborted before its load is given up; a transfer it
will not fetch is released at its producer; the caches of
other dtypes move as they are; a machine without NIXL, or without a
backend asked for, is told so."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from appliance import LLM
from appliance.config.compose import resolve
from appliance.config.plan import make_plan
from appliance.errors import ConfigError
from appliance.worker import kv_nixl
from appliance.worker.kv_nixl import (HOLD_MARGIN_S, NixlWorker, _answer_problem, _geometry, agent_name, block_descs,
                                      block_runs, nixl_api)
from appliance.worker.kv_p2p import READING, _Load
from tests.unit.test_kv_p2p import (BASE, GREEDY, PROMPT, _consumer, _decode, _failed_fetch, _prefill, _producer,
                                    _same, _settle, _tamper)
from tests.unit.test_kv_p2p import reference  # noqa: F401  (a fixture)

NEEDS_NIXL = pytest.mark.skipif(nixl_api() is None, reason="NIXL is not installed (pip install nixl-cu12)")


@pytest.fixture(scope="module")
def pair():
    return _producer(connector="nixl"), _consumer("kv_transfer.p2p.timeout_s=3", connector="nixl")


@NEEDS_NIXL
def test_a_consumer_reads_a_producers_prefill(pair, reference):
    producer, consumer = pair
    kv = producer.engine.scheduler.kv
    free = kv.num_free_blocks
    params = _prefill(producer)
    n = len(reference.prompt_token_ids)
    assert params["remote_num_tokens"] == n and kv.num_free_blocks < free
    worker = consumer.engine.runner.kv_connector
    peer = agent_name(params["remote_engine_id"], 0)
    assert isinstance(worker, NixlWorker) and peer not in worker._remote
    loaded = consumer.engine.scheduler.connector.loaded_tokens
    out = _decode(consumer, params)
    _same(out, reference)
    assert out.num_cached_tokens == n - 1
    assert consumer.engine.scheduler.connector.loaded_tokens - loaded == n - 1
    assert peer in worker._remote  # read through the producer's agent
    _settle(producer, lambda: not producer.engine.has_kv_transfers())
    assert kv.num_free_blocks == free  # released once read
    consumer.engine.scheduler.kv.check_integrity()
    cpu = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - cpu < 0.5  # idle agents spin no progress thread (NIXL's took a whole core)

    # the next read from that producer asks for no metadata: its agent is known
    params = _prefill(producer)
    assert worker._pull_fields(SimpleNamespace(engine_id=params["remote_engine_id"])) == {"metadata": False}
    assert worker._pull_fields(SimpleNamespace(engine_id="another")) == {"metadata": True}
    _same(_decode(consumer, params), reference)


@NEEDS_NIXL
@pytest.mark.parametrize("spoil", ["engine", "tokens", "port"])
def test_a_fetch_that_fails_computes_the_prompt(pair, reference, spoil):
    _failed_fetch(pair, reference, spoil)


@NEEDS_NIXL
@pytest.mark.parametrize("spoil", ["checksum", "nan"])
def test_blocks_read_that_fail_their_checks_are_computed_instead(pair, reference, monkeypatch, spoil):
    """The blocks a consumer read must match the checksum its producer sent
    and hold no NaN (here a producer whose cache holds one: checksummed as it
    is): otherwise the load fails once the read is over, its blocks go back
    uncached, and the prompt is computed."""
    producer, consumer = pair
    if spoil == "checksum":
        _tamper(monkeypatch, producer, lambda header, metadata: header.update(checksum="0" * 64))
    params = _prefill(producer)
    at = (0, params["remote_block_ids"][1], 0, 0, 0)
    cache, kept = producer.engine.runner.kv_caches[1], producer.engine.runner.kv_caches[1][at].item()
    if spoil == "nan":
        cache[at] = float("nan")
    try:
        failed = consumer.engine.scheduler.connector.failed_loads
        _same(_decode(consumer, params), reference)
        assert consumer.engine.scheduler.connector.failed_loads == failed + 1
        again = _prefill(producer)
        _same(_decode(consumer, again, fresh=False), reference)
        held = producer.engine.runner.kv_connector._sends
        _settle(producer, lambda: params["remote_request_id"] not in held and again["remote_request_id"] not in held)
    finally:
        cache[at] = kept  # the producer's cached block as it was


@NEEDS_NIXL
@pytest.mark.parametrize("extra", [["model.dtype=bfloat16"], ["cache.kv_cache_dtype=fp8_e4m3"]])
def test_other_dtypes_move_as_they_are(extra):
    plain = LLM(overrides=[*BASE, *extra]).generate([PROMPT], GREEDY, use_tqdm=False)[0]
    producer, consumer = _producer(*extra, connector="nixl"), _consumer(*extra, connector="nixl")
    out = _decode(consumer, _prefill(producer))
    assert out.num_cached_tokens == len(plain.prompt_token_ids) - 1
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def _caches(blocks, layers=3, dtype=torch.float32):
    return [torch.randn(2, blocks, 4, 2, 8).to(dtype) for _ in range(layers)]


def test_descriptors_address_each_layers_k_and_v_of_the_blocks():
    caches = _caches(10)
    g = _geometry(caches)
    assert g["num_blocks"] == 10 and g["block_bytes"] == 4 * 2 * 8 * 4 and g["mem"] == "DRAM"
    runs = block_runs([3, 4, 5, 9, 1], [0, 1, 7, 8, 2])
    assert runs == [(3, 0, 2), (5, 7, 1), (9, 8, 1), (1, 2, 1)]
    d = block_descs(g["regions"], g["num_blocks"], g["block_bytes"], 0, [r[0] for r in runs], [r[2] for r in runs])
    assert d.shape == (3 * 2 * 4, 3) and d.dtype == np.uint64
    for i, (layer, kv, (first, _, count)) in enumerate((n, kv, r) for n in range(3) for kv in range(2) for r in runs):
        block = caches[layer][kv, first:first + count]
        assert (int(d[i, 0]), int(d[i, 1]), int(d[i, 2])) == (block.data_ptr(), block.nbytes, 0)


def test_caches_nixl_cannot_address_are_refused():
    with pytest.raises(ValueError, match="one contiguous tensor per layer"):
        _geometry([torch.zeros(4, 2, 10, 2, 8).transpose(0, 1)])


def _header(ours, count=2, **over):
    return {"agent": "e-0", "regions": [1000 * (i + 1) for i in range(len(ours["regions"]))], "num_blocks": 50,
            "block_bytes": ours["block_bytes"], "mem": "DRAM", "device": 0, "blocks": list(range(count)),
            "hold_s": 30.0, **over}


@pytest.mark.parametrize("over,message", [
    ({"agent": "other-0"}, "names NIXL agent 'other-0'"),
    ({"regions": [1, 2]}, "the producer's cache has 2 layers, not 3"),
    ({"regions": [1, 2, "3"]}, "has 3 layers, not 3"),  # an address that is not one
    ({"block_bytes": 7}, "the producer's blocks take 7 bytes"),
    ({"mem": "FILE"}, "a malformed answer"),
    ({"blocks": [0, 50]}, "the answer's blocks are not the transfer's"),
    ({"blocks": [0]}, "the answer's blocks are not the transfer's"),
    ({"blocks": [0, True]}, "the answer's blocks are not the transfer's"),
    ({"hold_s": HOLD_MARGIN_S / 2}, "too little to read them"),
    ({"hold_s": "long"}, "a malformed answer (its hold)"),
])
def test_answers_that_do_not_fit_this_cache_are_refused(over, message):
    ours = _geometry(_caches(10))
    assert _answer_problem(_header(ours), ours, "e-0", 2) is None
    assert message in _answer_problem(_header(ours, **over), ours, "e-0", 2)
    assert "not registered" in _answer_problem(_header(ours), None, "e-0", 2)


class _SlowAgent:
    """A NIXL agent whose read never ends and that cannot abort it at first."""

    def __init__(self, refusals):
        self.refusals, self.released = refusals, []

    def check_xfer_state(self, handle):
        return "PROC"

    def release_xfer_handle(self, handle):
        if self.refusals:
            self.refusals -= 1
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.released.append(handle)


def test_a_read_past_its_deadline_ends_only_once_aborted():
    """Its blocks go back to the pool only when nothing writes into them any more."""
    import threading

    worker = NixlWorker.__new__(NixlWorker)  # the read's bookkeeping alone: no agent, no sockets
    worker._agent, worker._agent_lock = _SlowAgent(refusals=1), threading.Lock()
    load = _Load(spec=SimpleNamespace(request_id="r"), socket=None, deadline=10.0, reading="handle")
    assert worker._progress(load, now=5.0) is READING  # moving, in time
    assert worker._progress(load, now=11.0) is READING  # late, but the abort was refused: it may still write
    assert load.reading == "handle" and worker._agent.released == []
    assert "did not end" in worker._progress(load, now=12.0)
    assert worker._agent.released == ["handle"] and load.reading is None


def test_a_nixl_consumer_tells_a_producer_what_it_will_not_fetch():
    """The puller's release of a transfer is p2p's message to the producer, from a NIXL consumer too (NIXL's
    release of a read handle is a method of its own, which once took its name: the puller's call raised)."""
    sent = []

    class _Socket:
        def send_multipart(self, frames, flags=0):
            sent.append(frames)

        def close(self):
            pass

    worker = NixlWorker.__new__(NixlWorker)  # the release alone: no agent, no sockets of its own
    worker._socket = lambda host, port, limit: _Socket()
    worker._done = lambda transfer: [transfer.encode()]
    worker._release("127.0.0.1", 5, "t-1")
    assert sent == [[b"t-1"]]


def test_without_nixl_the_connector_says_what_to_install(monkeypatch):
    monkeypatch.setattr(kv_nixl, "nixl_api", lambda: None)
    with pytest.raises(ConfigError, match="kv_transfer.connector=nixl needs NIXL: pip install nixl"):
        _consumer(connector="nixl")


@NEEDS_NIXL
def test_a_backend_nixl_cannot_start_is_named():
    with pytest.raises(ConfigError, match="kv_transfer.nixl.backends: NOPE cannot start here; NIXL's plugins: .*UCX"):
        _consumer("kv_transfer.nixl.backends=[UCX,NOPE]", connector="nixl")


def test_plan_says_how_the_blocks_move():
    words = make_plan(resolve(["+profile=cpu", "kv_transfer=nixl", "kv_transfer.role=consumer"]).cfg).kv_transfer
    assert words.startswith("nixl (disaggregated prefill): consumes") and "through NIXL (UCX)" in words


@pytest.mark.parametrize("extra,message", [
    (["kv_transfer=nixl", "kv_transfer.nixl.backends=[]"], "kv_transfer.nixl.backends=[] must name NIXL backends"),
    (["kv_transfer=p2p", "kv_transfer.nixl.backends=[LIBFABRIC]"],
     "kv_transfer.nixl.backends=['LIBFABRIC'] has no effect without kv_transfer.connector=nixl"),
    (["kv_transfer=nixl", "kv_transfer.role=consumer", "kv_transfer.p2p.port=9000"],
     "kv_transfer.p2p.port=9000 has no effect with kv_transfer.role=consumer"),
    (["kv_transfer=nixl", "parallel=tp3", "parallel.executor=ray"],
     "kv_transfer.connector=nixl on parallel.executor=ray is not built yet"),
])
def test_config_refuses_what_cannot_run(extra, message):
    with pytest.raises(ConfigError) as e:
        resolve(["+profile=cpu", *extra])
    assert message in str(e.value)
