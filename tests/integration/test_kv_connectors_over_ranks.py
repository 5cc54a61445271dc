"""KV connectors over an engine core's ranks (tensor-parallel ranks,
pipeline stages; ``parallel.executor=mp``), each rank moving its KV heads
of its layers.

The offload tier: each rank saves its part of every block in its own
folder and loads it back; a block is in the tier once every rank's part
is; a prefix loaded from the tier, in the same process or after a restart,
gives the tokens and logprobs of computing it; a part one rank cannot read,
or another rank's part under its name, fails the step on every rank, which
recomputes it, and is counted.

Disaggregated prefill: each consumer rank pulls its part from the
producer's rank of its number; the consumer decodes what an engine of the
same layout that did everything does; a producer of another layout is
refused and the consumer computes the prompt."""

import dataclasses
import time

import pytest

from appliance import LLM, SamplingParams
from appliance.engine.kv_connector import rank_folder, stored_hashes
from appliance.server.local import free_port_run
from appliance.worker.kv_nixl import nixl_api
from tests.unit.test_kv_p2p import KEY

NEEDS_NIXL = pytest.mark.skipif(nixl_api() is None, reason="NIXL is not installed (pip install nixl-cu12)")

PROMPT = " ".join(str(i) for i in range(200))
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
LAYOUTS = {"tp2": ["parallel.tensor_parallel_size=2"], "pp2": ["parallel.pipeline_parallel_size=2"]}


def _overrides(path, layout):
    return ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05", "model.dtype=float32",
            "kv_transfer=offload", f"kv_transfer.offload.path={path}", *LAYOUTS[layout]]


def _settle(llm):
    """Every rank's writes reported (the ranks report at each step)."""
    connector = llm.engine.scheduler.connector
    deadline = time.time() + 60
    while connector.pending:
        assert time.time() < deadline, "the ranks did not report their writes"
        llm.generate(["x"], SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.05)


def _same(a, b):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert [lp.top for lp in a.outputs[0].logprobs] == [lp.top for lp in b.outputs[0].logprobs]


def _close(a, b, atol=1e-5):
    """The same tokens, logprobs equal up to rounding: what computing the
    prompt's tail in another chunk gives (a BLAS may sum a GEMM of other
    rows in another order: bit-equal on some CPUs, not on others)."""
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=atol)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_keeps_its_part_and_the_prefix_loads(tmp_path, layout):
    llm = LLM(overrides=_overrides(tmp_path, layout))
    connector = llm.engine.scheduler.connector
    assert connector.ranks == 2
    cold = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    _settle(llm)
    blocks = (len(cold.prompt_token_ids) - 1) // llm.engine.block_size
    parts = [set(stored_hashes(rank_folder(connector.folder, r))) for r in range(2)]
    assert parts[0] == parts[1] == connector.available and len(connector.available) >= blocks
    assert llm.engine.reset_prefix_cache()
    warm = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert connector.hit_tokens == blocks * llm.engine.block_size == warm.num_cached_tokens
    _same(cold, warm)  # every rank's K/V stored exactly
    del llm

    again = LLM(overrides=_overrides(tmp_path, layout))  # a restart: the parts in every rank's folder
    assert again.engine.scheduler.connector.available == parts[0]
    restarted = again.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert restarted.num_cached_tokens == blocks * again.engine.block_size
    _same(cold, restarted)

    # one rank's part of a block unreadable: both ranks fail the step, and the prompt is computed from that block
    victim = rank_folder(connector.folder, 1) / sorted(p.name for p in rank_folder(connector.folder, 1).iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:100])
    assert again.engine.reset_prefix_cache()
    recomputed = again.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert recomputed.outputs[0].finish_reason == "length"  # not an error
    _close(cold, recomputed)
    _settle(again)  # every rank wrote its part again as the request recomputed it
    assert victim.stat().st_size == max(p.stat().st_size for p in victim.parent.iterdir())
    assert bytes.fromhex(victim.stem) in again.engine.scheduler.connector.available
    assert again.engine.stats().kv_offload_corrupt_blocks == 1

    # rank 0's part of a block under rank 1's name (the same shape, other KV heads or layers): rejected too
    name = sorted(p.name for p in rank_folder(connector.folder, 1).iterdir())[1]
    (rank_folder(connector.folder, 1) / name).write_bytes((rank_folder(connector.folder, 0) / name).read_bytes())
    assert again.engine.reset_prefix_cache()
    swapped = again.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert swapped.outputs[0].token_ids == cold.outputs[0].token_ids
    _settle(again)
    assert again.engine.stats().kv_offload_corrupt_blocks == 2


def test_each_rank_keeps_its_part_in_host_memory():
    """kv_transfer.offload.medium=host at tp2: each rank copies its part of
    every block into its own memory; the prefix loads from there after the
    pool forgot it, bit for bit."""
    llm = LLM(overrides=["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05", "model.dtype=float32",
                         "kv_transfer=offload", "kv_transfer.offload.medium=host", *LAYOUTS["tp2"]])
    connector = llm.engine.scheduler.connector
    assert connector.ranks == 2 and connector.folder is None
    cold = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    _settle(llm)
    blocks = (len(cold.prompt_token_ids) - 1) // llm.engine.block_size
    assert len(connector.available) >= blocks
    assert llm.engine.reset_prefix_cache()
    warm = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert connector.hit_tokens == blocks * llm.engine.block_size == warm.num_cached_tokens
    _same(cold, warm)


BASE = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05", "model.dtype=float32",
        f"server.internal_key={KEY}"]


@pytest.mark.parametrize("layout,kind", [  # the bounded run: each layout and each connector once
    pytest.param("tp2", "p2p", marks=pytest.mark.slow), ("pp2", "p2p"), pytest.param("tp2", "nixl", marks=NEEDS_NIXL),
    pytest.param("pp2", "nixl", marks=[NEEDS_NIXL, pytest.mark.slow]),
], ids=["tp2-p2p", "pp2-p2p", "tp2-nixl", "pp2-nixl"])
def test_each_consumer_rank_pulls_its_part_from_the_producers(layout, kind):
    """(``nixl``: each consumer rank reads its part out of the producer's
    rank of its number, through its own NIXL agent.)"""
    ref = LLM(overrides=[*BASE, *LAYOUTS[layout]]).generate([PROMPT], GREEDY, use_tqdm=False)[0]
    producer = LLM(overrides=[*BASE, *LAYOUTS[layout], f"kv_transfer={kind}", "kv_transfer.role=producer",
                              f"kv_transfer.p2p.port={free_port_run(2)}"])
    consumer = LLM(overrides=[*BASE, *LAYOUTS[layout], f"kv_transfer={kind}", "kv_transfer.role=consumer"])
    prefill = dataclasses.replace(GREEDY, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = producer.generate([PROMPT], prefill, use_tqdm=False)[0].kv_transfer_params
    assert params["do_remote_prefill"] and producer.engine.scheduler.connector.sending
    out = consumer.generate([PROMPT], dataclasses.replace(GREEDY, kv_transfer_params=params), use_tqdm=False)[0]
    connector = consumer.engine.scheduler.connector
    assert connector.loaded_tokens == len(out.prompt_token_ids) - 1 and connector.failed_loads == 0
    # the consumer computes only the last prompt token: the same sums in another order
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    for x, y in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-5)
    deadline = time.time() + 30  # both producer ranks heard their consumer rank's "done": the blocks go back
    while producer.engine.scheduler.connector.sending:
        assert time.time() < deadline, "the producer still holds the transfer"
        producer.engine.step()
        time.sleep(0.02)

    # a consumer of another layout: the producer's ranks refuse its pulls; it computes the prompt
    other = "pp2" if layout == "tp2" else "tp2"
    params = producer.generate([PROMPT], prefill, use_tqdm=False)[0].kv_transfer_params
    mismatched = LLM(overrides=[*BASE, *LAYOUTS[other], f"kv_transfer={kind}", "kv_transfer.role=consumer"])
    out = mismatched.generate([PROMPT], dataclasses.replace(GREEDY, kv_transfer_params=params), use_tqdm=False)[0]
    assert mismatched.engine.scheduler.connector.failed_loads == 1
    assert out.outputs[0].finish_reason == "length" and out.num_cached_tokens == 0
