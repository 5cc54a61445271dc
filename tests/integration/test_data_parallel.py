"""Data parallelism behind one server (``parallel=dp2``): two engine cores,
each on its own share of the cores with its own KV and prefix cache; a
burst is spread over both, answers are those of one core, ``/metrics``
shows both ranks, a pinned request reaches its rank, and a core that dies
is restarted while the other keeps serving."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from appliance import LLM, SamplingParams
from appliance.errors import ConfigError
from appliance.server.local import free_port_run
from appliance.worker.placement import cpu_share
from tests.integration.server_helpers import ServerProcess, metric, post_signed
from tests.unit.test_kv_p2p import KEY

TINY = ["model=tiny_random", "cache.kv_cache_memory_gib=0.05", "model.dtype=float32"]
PROMPTS = ["Hello there", "The capital of France is", "1 2 3 4 5", "Once upon a time, in a land far away",
           "a", "Data parallel ranks", "def f(x):\n    return", "zzz zzz zzz zzz zzz"]


def complete(url, prompt, headers=None, **extra):
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                     "ignore_eos": True, **extra}, headers=headers, timeout=120)


def affinity(pid):
    with open(f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith("Cpus_allowed_list"))
    return line.split(":", 1)[1].strip()


def test_two_engine_cores_behind_one_server():
    llm = LLM(overrides=["+profile=cpu", *TINY])
    ref = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0,
                                                                          ignore_eos=True), use_tqdm=False)]
    del llm
    s = ServerProcess(*TINY, "parallel=dp2", "server.core_restart_backoff_s=0.5")
    try:
        pids = s.core_pids()
        assert len(pids) == 2
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) >= 2:  # each core pinned to its own share
            shares = {",".join(map(str, cpu_share(r, 2, allowed))) for r in range(2)}
            assert {affinity(p) for p in pids} == {_as_list(sh) for sh in shares}

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda p: complete(s.url, p), PROMPTS))
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        assert [r.json()["choices"][0]["text"] for r in answers] == ref
        text = httpx.get(f"{s.url}/metrics").text
        steps = [metric(text, "appliance:iteration_tokens_count", engine=str(e)) for e in (0, 1)]
        assert all(n > 0 for n in steps), steps  # both ranks took part of the burst
        served = [metric(text, "appliance:time_to_first_token_seconds_count", engine=str(e)) for e in (0, 1)]
        assert sum(served) == len(PROMPTS) and min(served) > 0  # each request's latency under the core it ran on
        prompt_tokens = sum(metric(text, "appliance:prefix_cache_queries_total", engine=str(e)) for e in (0, 1))

        # pinned by header, then by field: only that rank looks the prompt up
        before = [metric(text, "appliance:prefix_cache_queries_total", engine=str(e)) for e in (0, 1)]
        assert complete(s.url, PROMPTS[0], headers={"X-Data-Parallel-Rank": "1"}).status_code == 200
        assert complete(s.url, PROMPTS[0], data_parallel_rank=1).status_code == 200
        text = httpx.get(f"{s.url}/metrics").text
        after = [metric(text, "appliance:prefix_cache_queries_total", engine=str(e)) for e in (0, 1)]
        assert after[0] == before[0] and after[1] > before[1] and prompt_tokens > 0
        for headers, extra in [({"X-Data-Parallel-Rank": "2"}, {}), ({}, {"data_parallel_rank": -1}),
                               ({"X-Data-Parallel-Rank": "0"}, {"data_parallel_rank": 1})]:
            r = complete(s.url, "x", headers=headers, **extra)
            assert r.status_code == 400, r.text

        # one core dies: the other keeps serving, requests pinned to the dead one are told to retry
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.time() + 10
        dead_rank = None
        while dead_rank is None and time.time() < deadline:
            for rank in (0, 1):
                r = complete(s.url, "x", headers={"X-Data-Parallel-Rank": str(rank)}, max_tokens=1)
                if r.status_code == 503:
                    assert r.json()["error"]["code"] == "engine_restarting"
                    dead_rank = rank
        assert dead_rank is not None, "no rank reported restarting"
        assert httpx.get(f"{s.url}/ready").status_code == 200  # the other rank still serves
        for prompt in PROMPTS[:3]:
            assert complete(s.url, prompt).status_code == 200
        deadline = time.time() + 120
        while complete(s.url, "x", headers={"X-Data-Parallel-Rank": str(dead_rank)}, max_tokens=1).status_code != 200:
            assert time.time() < deadline, "the killed rank was not restarted"
            time.sleep(0.5)
        text = httpx.get(f"{s.url}/metrics").text
        assert metric(text, "appliance:engine_restarts_total", engine=str(dead_rank)) == 1
        assert metric(text, "appliance:engine_restarts_total", engine=str(1 - dead_rank)) == 0
        assert f"engine core {dead_rank} died" in s.output()
        pids = s.core_pids()
    finally:
        s.stop()
    deadline = time.time() + 10
    while [p for p in pids if os.path.exists(f"/proc/{p}")]:
        assert time.time() < deadline, "an engine core outlived the server"
        time.sleep(0.1)


def _as_list(cores: str) -> str:
    """'0,1,2' as the kernel writes an affinity list: '0-2'."""
    ids = [int(c) for c in cores.split(",")]
    runs, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(runs)


def test_the_offline_llm_refuses_data_parallelism():
    with pytest.raises(ConfigError, match="behind one server"):
        LLM(overrides=["+profile=cpu", *TINY, "parallel=dp2"])


def test_each_engine_core_publishes_kv_events_on_its_own_port():
    """kv_events with dp2: core r binds the endpoint's port + r, and its
    batches say its rank; a request pinned to a core shows up on its port."""
    import zmq

    from tests.unit.test_kv_events import DECODER, BlockStored

    port = free_port_run(2)
    s = ServerProcess(*TINY, "parallel=dp2", "kv_events=zmq", f"kv_events.endpoint=tcp://127.0.0.1:{port}",
                      "kv_events.replay_endpoint=null")
    subs = []
    try:
        for rank in (0, 1):
            sub = zmq.Context.instance().socket(zmq.SUB)
            sub.connect(f"tcp://127.0.0.1:{port + rank}")
            sub.setsockopt_string(zmq.SUBSCRIBE, "")
            subs.append(sub)
        time.sleep(0.3)
        for rank in (0, 1):
            prompt = f"{PROMPTS[3]} {PROMPTS[7]} rank {rank}"  # several full blocks
            assert complete(s.url, prompt, headers={"X-Data-Parallel-Rank": str(rank)}).status_code == 200
            assert subs[rank].poll(10_000), f"no events from engine core {rank}"
            batch = DECODER.decode(subs[rank].recv_multipart()[2])
            assert batch.data_parallel_rank == rank
            assert any(isinstance(e, BlockStored) for e in batch.events)
    finally:
        for sub in subs:
            sub.close(linger=0)
        s.stop()


LONG = " ".join(str(i) for i in range(120))  # several full blocks


def test_each_engine_core_keeps_its_own_part_of_the_offload_tier(tmp_path):
    """kv_transfer=offload with dp2: core r saves under ``core<r>`` of the
    tier's folder (half the size limit each); after the pool is reset, a
    prompt pinned to a core loads its prefix from that core's part, with
    the answer it had computed."""
    s = ServerProcess(*TINY, "parallel=dp2", "kv_transfer=offload", f"kv_transfer.offload.path={tmp_path}",
                      "server.dev_mode=true")
    try:
        cold = {}
        for rank in (0, 1):
            r = complete(s.url, f"{LONG} core {rank}", headers={"X-Data-Parallel-Rank": str(rank)})
            assert r.status_code == 200, r.text
            cold[rank] = r.json()
        deadline = time.monotonic() + 30
        while not all(list(tmp_path.glob(f"*/core{rank}/*.kv")) for rank in (0, 1)):
            assert time.monotonic() < deadline, sorted(str(p) for p in tmp_path.rglob("*"))
            time.sleep(0.2)
        for rank in (0, 1):  # a step on each core takes in the finished writes
            assert complete(s.url, "x", headers={"X-Data-Parallel-Rank": str(rank)}).status_code == 200
        assert httpx.post(f"{s.url}/reset_prefix_cache", timeout=30).status_code == 200
        for rank in (0, 1):
            warm = complete(s.url, f"{LONG} core {rank}", headers={"X-Data-Parallel-Rank": str(rank)}).json()
            assert warm["choices"][0]["text"] == cold[rank]["choices"][0]["text"]
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, warm["usage"]
    finally:
        s.stop()


def test_each_producer_core_listens_on_its_own_port():
    """kv_transfer=p2p producers with dp2: core r listens on p2p.port + r and
    says so in its answer; a consumer fetches from the core that prefilled,
    with the answer one engine gives."""
    port = free_port_run(2)
    key = f"server.internal_key={KEY}"
    producer = ServerProcess(*TINY, "parallel=dp2", "kv_transfer=p2p", "kv_transfer.role=producer",
                             f"kv_transfer.p2p.port={port}", key)
    try:  # the consumer trusts the producer's host, whichever core's port it names
        consumer = ServerProcess(*TINY, "kv_transfer=p2p", "kv_transfer.role=consumer", key,
                                 "kv_transfer.p2p.trusted_producers=[127.0.0.1]")
        try:
            for rank in (0, 1):
                body = {"prompt": f"{LONG} core {rank}", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                # the answer computed whole, by the other core (the consumer's pool never sees the prompt alone)
                plain = httpx.post(f"{producer.url}/v1/completions", headers={"X-Data-Parallel-Rank": str(1 - rank)},
                                   json=body, timeout=120).json()
                pre = post_signed(f"{producer.url}/v1/completions", headers={"X-Data-Parallel-Rank": str(rank)},
                                  body={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
                                  key=KEY, timeout=120).json()
                params = pre["kv_transfer_params"]
                assert params["remote_port"] == port + rank, params
                done = httpx.post(f"{consumer.url}/v1/completions", json={**body, "kv_transfer_params": params},
                                  timeout=120).json()
                assert done["choices"][0]["text"] == plain["choices"][0]["text"]
                assert done["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, done["usage"]
        finally:
            consumer.stop()
    finally:
        producer.stop()
