"""The offload KV connector (kv_transfer=offload): full blocks saved to a
disk tier as they fill; a prefix that left the block pool, or the process,
loads from the tier instead of being recomputed, with the same tokens and
logprobs; the tier stays under its size limit, least recently used first;
an unreadable file is dropped and its request recomputed; a file damaged
on disk, another block's file under a block's name, another model's file
copied in or a file of the older format is rejected before it enters the
cache (logged, removed, counted on /metrics) and its request recomputed;
other layouts never share a folder; the config refuses what is not built."""

import json
import logging
import struct

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.config.compose import resolve
from appliance.config.plan import make_plan
from appliance.engine.outputs import StepStats
from appliance.engine.kv_connector import OffloadMetadata
from appliance.errors import ConfigError
from appliance.server.metrics import Metrics
from appliance.worker.kv_offload import MAGIC, KVLoadError, OffloadWorker

PROMPT = " ".join(str(i) for i in range(200))
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)


def _overrides(path, *extra):
    return ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05", "model.dtype=float32",
            "kv_transfer=offload", f"kv_transfer.offload.path={path}", *extra]


def _settle(llm):
    """Every queued write done and reported (the worker reports at each step)."""
    llm.engine.runner.kv_connector.flush()
    llm.generate(["x"], SamplingParams(max_tokens=1), use_tqdm=False)


def _same(a, b):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert [lp.top for lp in a.outputs[0].logprobs] == [lp.top for lp in b.outputs[0].logprobs]


@pytest.mark.parametrize("backend", ["cpu_native", "torch_sdpa"])  # saves after the step, or layer by layer
def test_a_prefix_that_left_the_pool_loads_from_the_tier(tmp_path, backend):
    llm = LLM(overrides=_overrides(tmp_path, f"attention.backend={backend}"))
    connector, worker = llm.engine.scheduler.connector, llm.engine.runner.kv_connector
    cold = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    _settle(llm)
    n_prompt = len(cold.prompt_token_ids)
    bs = llm.engine.block_size
    assert len(connector.available) >= (n_prompt - 1) // bs and not connector.pending
    assert llm.engine.reset_prefix_cache()  # the pool forgets; the tier does not
    warm = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    expected = (n_prompt - 1) // bs * bs  # whole blocks, never the last token
    assert connector.hit_tokens == expected and warm.num_cached_tokens == expected
    _same(cold, warm)  # K/V stored exactly: the same bits as computing them
    assert worker.get_finished().dropped == []


def test_the_tier_outlives_the_process(tmp_path):
    first = LLM(overrides=_overrides(tmp_path))
    cold = first.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    _settle(first)
    again = LLM(overrides=_overrides(tmp_path))  # a restart: a new pool, the same folder
    connector = again.engine.scheduler.connector
    assert connector.available == first.engine.scheduler.connector.available
    warm = again.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert connector.hit_tokens > 0 and warm.num_cached_tokens == connector.hit_tokens
    _same(cold, warm)


def test_another_layout_never_reads_the_tier(tmp_path):
    first = LLM(overrides=_overrides(tmp_path))
    first.generate([PROMPT], GREEDY, use_tqdm=False)
    _settle(first)
    other = LLM(overrides=_overrides(tmp_path, "cache.kv_cache_dtype=bfloat16"))
    assert other.engine.scheduler.connector.folder != first.engine.scheduler.connector.folder
    assert not other.engine.scheduler.connector.available
    other.generate([PROMPT], GREEDY, use_tqdm=False)
    assert other.engine.scheduler.connector.hit_tokens == 0


def test_the_tier_keeps_under_its_limit_least_recently_used_first(tmp_path):
    probe = LLM(overrides=_overrides(tmp_path / "probe"))
    probe.generate([PROMPT], GREEDY, use_tqdm=False)
    _settle(probe)
    block_bytes = max(p.stat().st_size for p in probe.engine.scheduler.connector.folder.iterdir())
    limit = 5 * block_bytes
    llm = LLM(overrides=_overrides(tmp_path / "small", f"kv_transfer.offload.max_gib={limit / (1 << 30)!r}"))
    connector, worker = llm.engine.scheduler.connector, llm.engine.runner.kv_connector
    llm.generate([PROMPT], GREEDY, use_tqdm=False)
    _settle(llm)
    files = list(connector.folder.iterdir())
    assert len(files) == 5 and sum(p.stat().st_size for p in files) <= limit
    assert len(connector.available) == 5
    # the prompt's first blocks were written first, so they left first: no prefix from the start remains
    assert llm.engine.reset_prefix_cache()
    llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert connector.hit_tokens == 0
    assert worker._bytes <= limit


def test_an_unreadable_block_is_dropped_and_its_request_recomputed(tmp_path):
    llm = LLM(overrides=_overrides(tmp_path))
    connector = llm.engine.scheduler.connector
    cold = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    _settle(llm)
    victim = sorted(connector.folder.iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated
    assert llm.engine.reset_prefix_cache()
    again = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].finish_reason == "length"  # not an error: recomputed
    _same(cold, again)
    _settle(llm)  # and written again, whole, as the request recomputed it
    assert victim.stat().st_size == max(p.stat().st_size for p in connector.folder.iterdir())
    assert bytes.fromhex(victim.stem) in connector.available


DAMAGE = ["flipped payload byte", "swapped file", "zeroed payload", "another model's file", "older format"]


def _header(raw: bytes) -> tuple[dict, int]:
    """A tier file's header, and where its payload starts."""
    (n,) = struct.unpack_from("<I", raw, len(MAGIC))
    return json.loads(raw[len(MAGIC) + 4 : len(MAGIC) + 4 + n]), len(MAGIC) + 4 + n


def _damage(kind: str, victim, donor, foreign) -> str:
    """``victim`` (a tier file) damaged as ``kind`` says (``donor``: another
    block's file of the tier; ``foreign``: the same block's file of another
    tier); what its rejection names."""
    raw = bytearray(victim.read_bytes())
    header, start = _header(raw)
    if kind == "flipped payload byte":
        raw[(start + len(raw)) // 2] ^= 0x10
        why = "does not match its checksum"
    elif kind == "zeroed payload":  # header and length intact
        raw[start:] = bytes(len(raw) - start)
        why = "does not match its checksum"
    elif kind == "swapped file":
        raw = donor.read_bytes()
        why = "its header names another block"
    elif kind == "another model's file":
        raw = foreign.read_bytes()
        why = "written for another model or KV layout"
    else:  # the format before checksums: its magic, then a header of the payload's shape and dtype only
        meta = json.dumps({"shape": header["shape"], "dtype": header["dtype"]}).encode()
        raw = b"APKV1\0" + struct.pack("<I", len(meta)) + meta + raw[start:]
        why = "not a tier file of this format version"
    victim.write_bytes(raw)
    return why


def _save(worker, caches, blocks):
    """``blocks`` ((block id, hash) pairs) of ``caches`` saved by ``worker``, written; its report."""
    worker.start_load_kv(OffloadMetadata(saves=blocks), caches)
    for layer, cache in enumerate(caches):
        worker.save_kv_layer(layer, cache)
    worker.wait_for_save()
    worker.flush()
    return worker.get_finished()


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_or_foreign_tier_file_never_enters_the_cache(tmp_path, caplog, kind):
    """The worker side: the file is rejected (KVLoadError, the step's requests
    recomputed), its block's slots are left as they were, it is removed,
    logged at warning naming the file and reported dropped and corrupt; a
    clean file beside it still loads exactly."""
    torch.manual_seed(0)
    caches = [torch.randn(2, 4, 16, 2, 16) for _ in range(2)]  # [K/V, blocks, block size, kv heads, head dim]
    a, b = bytes([0xAA]) * 32, bytes([0xBB]) * 32
    worker = OffloadWorker(tmp_path / "mine", "mine", 1 << 30)
    assert _save(worker, caches, [(1, a), (2, b)]).saved == [a, b]
    theirs = OffloadWorker(tmp_path / "theirs", "theirs", 1 << 30)  # the same block and bytes, another tier
    assert _save(theirs, caches, [(2, b)]).saved == [b]
    victim = worker.folder / (b.hex() + ".kv")
    why = _damage(kind, victim, worker.folder / (a.hex() + ".kv"), theirs.folder / victim.name)
    for cache in caches:
        cache[:, 3] = 7.0
    with caplog.at_level(logging.WARNING, logger="appliance.kv_offload"), pytest.raises(KVLoadError, match=why):
        worker.start_load_kv(OffloadMetadata(loads=[(3, b)]), caches)
    assert all(bool((cache[:, 3] == 7.0).all()) for cache in caches)  # not loaded
    assert not victim.exists()
    report = worker.get_finished()
    assert report.dropped == [b] and report.corrupt == 1
    [warning] = caplog.records
    assert warning.levelname == "WARNING" and str(victim) in warning.getMessage() and why in warning.getMessage()
    worker.start_load_kv(OffloadMetadata(loads=[(3, a)]), caches)
    assert all(torch.equal(cache[:, 3], cache[:, 1]) for cache in caches)
    assert worker.get_finished().corrupt == 0


def test_every_damaged_file_of_a_step_leaves_the_tier_at_once(tmp_path):
    """A step's loads after a rejected one are still checked, not copied: every
    damaged file of the step is removed and counted by the one failed step."""
    torch.manual_seed(0)
    caches = [torch.randn(2, 5, 16, 2, 16) for _ in range(2)]
    hashes = [bytes([i]) * 32 for i in (1, 2, 3)]
    worker = OffloadWorker(tmp_path, "mine", 1 << 30)
    _save(worker, caches, list(zip((1, 2, 3), hashes)))
    for h in (hashes[0], hashes[2]):
        _damage("zeroed payload", tmp_path / (h.hex() + ".kv"), None, None)
    before = [cache.clone() for cache in caches]
    with pytest.raises(KVLoadError, match="does not match its checksum"):
        worker.start_load_kv(OffloadMetadata(loads=list(zip((4, 0, 3), hashes))), caches)
    assert all(torch.equal(x, y) for x, y in zip(caches, before))  # the clean block between them not copied either
    report = worker.get_finished()
    # the reader threads reject the two files in either order
    assert sorted(report.dropped) == [hashes[0], hashes[2]] and report.corrupt == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [hashes[1].hex() + ".kv"]


@pytest.fixture(scope="module")
def warm_tier(tmp_path_factory):
    """An engine over a tier holding PROMPT's blocks, and PROMPT's clean run
    (each test below damages a file; its request's recompute writes it again)."""
    llm = LLM(overrides=_overrides(tmp_path_factory.mktemp("tier")))
    clean = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    _settle(llm)
    return llm, clean


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_or_foreign_tier_file_is_a_miss_recomputed_and_counted(warm_tier, tmp_path, caplog, kind):
    """After the pool forgot the prompt, one of its tier files damaged: the
    request's tokens and logprobs are the clean run's (the tier tried once,
    then the prompt computed), the file is logged and counted on /metrics,
    and the recompute writes the block again, whole."""
    llm, clean = warm_tier
    connector = llm.engine.scheduler.connector
    files = sorted(connector.folder.iterdir())
    victim, donor, foreign = files[3], files[4], None
    good = victim.read_bytes()
    if kind == "another model's file":  # the same tokens, so the same block hashes; other K/V
        other = LLM(overrides=_overrides(tmp_path, "model.rope_theta=20000.0"))
        other.generate([PROMPT], GREEDY, use_tqdm=False)
        _settle(other)
        foreign = other.engine.scheduler.connector.folder / victim.name
        assert foreign.read_bytes()[_header(good)[1]:] != good[_header(good)[1]:]
    why = _damage(kind, victim, donor, foreign)
    assert llm.engine.reset_prefix_cache()
    llm.engine.reset_stats()
    hits = connector.hit_tokens
    with caplog.at_level(logging.WARNING, logger="appliance.kv_offload"):
        again = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].finish_reason == "length"  # not an error: recomputed
    _same(clean, again)
    bs = llm.engine.block_size
    assert connector.hit_tokens - hits == (len(clean.prompt_token_ids) - 1) // bs * bs  # tried once
    [warning] = [r for r in caplog.records if r.name == "appliance.kv_offload"]
    assert warning.levelname == "WARNING" and str(victim) in warning.getMessage() and why in warning.getMessage()
    stats = llm.engine.stats()
    assert stats.kv_offload_corrupt_blocks == 1
    metrics = Metrics("tiny", "cpu", "hash", "deployment")
    metrics.on_core_stats(StepStats(), stats)
    assert metrics.registry.get_sample_value("appliance:kv_offload_corrupt_blocks_total", {
        "model_name": "tiny", "profile": "cpu", "config_hash": "hash", "deployment": "deployment", "engine": "0"}) == 1
    _settle(llm)
    assert victim.read_bytes() == good  # recomputed to the same bits, written again
    assert bytes.fromhex(victim.stem) in connector.available


@pytest.mark.parametrize("extra,message", [
    (["kv_transfer.connector=lmcache"], "kv_transfer.connector=lmcache is unknown; built: offload, p2p, nixl"),
    (["kv_transfer=offload", "kv_transfer.role=producer"],
     "an offload tier saves and loads (role both); producer and consumer are disaggregated prefill's roles"),
    (["kv_transfer=offload", "kv_transfer.p2p.port=9000"], "kv_transfer.p2p.port=9000 has no effect without "
                                                           "kv_transfer.connector=p2p"),
    (["kv_transfer=offload", "kv_transfer.offload.max_gib=0"], "kv_transfer.offload.max_gib=0.0 must be positive"),
    (["kv_transfer=offload", "cache.prefix_caching_hash_algo=builtin"], "builtin hashes change per process"),
    (["kv_transfer=offload", "cache.enable_prefix_caching=false"], "it needs cache.enable_prefix_caching=true"),
    (["kv_transfer=offload", "parallel=tp3", "parallel.executor=ray"],
     "kv_transfer.connector=offload on parallel.executor=ray is not built yet"),
    (["kv_transfer=offload", "model=tiny_random_moe", "parallel=dp2_ep"],
     "with expert parallelism across engine cores is not built yet"),
    (["kv_transfer.offload.max_gib=2"], "kv_transfer.offload.max_gib=2.0 has no effect without"),
    (["kv_transfer=offload", "kv_transfer.offload.medium=nvme"], "kv_transfer.offload.medium=nvme must be one of"),
    (["kv_transfer=offload", "kv_transfer.offload.medium=host", "kv_transfer.offload.path=/tmp/x"],
     "kv_transfer.offload.path=/tmp/x has no effect with the tier in host memory"),
    (["kv_transfer.role=consumer"], "kv_transfer.role=consumer has no effect without a connector"),
])
def test_config_refuses_what_is_not_built(extra, message):
    with pytest.raises(ConfigError) as e:
        resolve(["+profile=cpu", *extra])
    assert message in str(e.value)


def test_plan_describes_the_tier(tmp_path):
    plan = make_plan(resolve(["+profile=cpu", "kv_transfer=offload", f"kv_transfer.offload.path={tmp_path}",
                              "kv_transfer.offload.max_gib=2"]).cfg)
    assert plan.kv_transfer.startswith(f"offload: full blocks saved to {tmp_path}") and "at most 2 GiB" in plan.kv_transfer
    assert make_plan(resolve(["+profile=cpu"]).cfg).kv_transfer == "off"
    # medium auto: host memory on a GPU profile
    gpu = make_plan(resolve(["+profile=h100_bf16", "kv_transfer=offload"]).cfg).kv_transfer
    assert gpu.startswith("offload: full blocks copied to host memory") and "gone at a restart" in gpu


def _host(*extra):
    return ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05", "model.dtype=float32",
            "kv_transfer=offload", "kv_transfer.offload.medium=host", *extra]


def test_a_tier_in_host_memory_loads_a_prefix_that_left_the_pool():
    from appliance.worker.kv_offload import HostTierWorker

    llm = LLM(overrides=_host())
    connector, worker = llm.engine.scheduler.connector, llm.engine.runner.kv_connector
    assert isinstance(worker, HostTierWorker) and connector.folder is None
    cold = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    _settle(llm)
    bs = llm.engine.block_size
    expected = (len(cold.prompt_token_ids) - 1) // bs * bs
    assert len(connector.available) >= expected // bs and not connector.pending
    assert llm.engine.reset_prefix_cache()
    warm = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert connector.hit_tokens == expected and warm.num_cached_tokens == expected
    _same(cold, warm)

    # the blocks gone from host memory under the scheduler's feet: the step is recomputed, not an error
    held = set(worker._blocks)
    worker._blocks.clear()
    assert llm.engine.reset_prefix_cache()
    hits = connector.hit_tokens
    again = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    _same(cold, again)
    assert connector.hit_tokens == hits + expected  # it tried the tier once, then computed the prompt
    _settle(llm)
    assert len(worker._blocks) >= expected // bs and set(worker._blocks) <= connector.available  # saved again
    assert connector.available - set(worker._blocks) <= held  # only what the test took away unseen


def test_a_tier_in_host_memory_keeps_under_its_limit_least_recently_used_first():
    probe = LLM(overrides=_host())
    probe.generate([PROMPT], GREEDY, use_tqdm=False)
    _settle(probe)
    block = next(iter(probe.engine.runner.kv_connector._blocks.values()))
    limit = 5 * block.numel() * block.element_size()
    llm = LLM(overrides=_host(f"kv_transfer.offload.max_gib={limit / (1 << 30)!r}"))
    connector, worker = llm.engine.scheduler.connector, llm.engine.runner.kv_connector
    llm.generate([PROMPT], GREEDY, use_tqdm=False)
    _settle(llm)
    assert len(worker._blocks) == len(connector.available) == 5 and worker._bytes <= limit
    assert llm.engine.reset_prefix_cache()  # the prompt's first blocks left first: no prefix from the start
    llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert connector.hit_tokens == 0


def test_a_block_of_several_ranks_is_in_the_tier_once_every_part_is(tmp_path):
    """OffloadConnector(ranks=2): at start the blocks both ranks' folders
    hold; then a block counts once both ranks reported their part written,
    and a part either rank dropped takes the block out until both write it
    again; every rank's files that failed their checks count."""
    from appliance.engine.kv_connector import (BLOCK_SUFFIX, KVConnectorOutput, OffloadConnector, merge_rank_outputs,
                                               rank_folder)

    for rank, names in [(0, ["aa", "bb"]), (1, ["bb", "cc"])]:
        rank_folder(tmp_path, rank).mkdir()
        for name in names:
            (rank_folder(tmp_path, rank) / (name + BLOCK_SUFFIX)).write_bytes(b"x")
    c = OffloadConnector(tmp_path, 16, ranks=2)
    assert c.available == {bytes.fromhex("bb")}

    def report(*per_rank, dropped=()):
        c.update_connector_output(c.combine_ranks(merge_rank_outputs(
            [KVConnectorOutput(saved=list(s), dropped=list(dropped) if r == 0 else []) for r, s in enumerate(per_rank)])))

    c.pending |= {b"1", b"2"}
    report([b"1"], [])
    assert b"1" not in c.available and b"1" in c.pending  # rank 1's part not written yet
    report([b"2"], [b"1", b"2"])
    assert {b"1", b"2"} <= c.available and not c.pending
    report([], [], dropped=[b"2"])
    assert b"2" not in c.available
    report([], [b"2"])  # one part again is not the block
    assert b"2" not in c.available
    report([b"2"], [])
    assert b"2" in c.available
    c.update_connector_output(c.combine_ranks(merge_rank_outputs([KVConnectorOutput(corrupt=1),
                                                                  KVConnectorOutput(corrupt=2)])))
    assert c.corrupt_blocks == 3


def test_a_draft_model_catches_up_over_blocks_loaded_from_the_tier(tmp_path):
    """The tier holds the target's KV only: a prefix loaded from it has no
    draft K/V, so the draft model runs over it before drafting. With the
    target as its own draft every draft of the warm run is accepted."""
    from tests.unit.test_spec_draft import SELF

    llm = LLM(overrides=_overrides(tmp_path, *SELF))
    cold = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    _settle(llm)
    assert llm.engine.reset_prefix_cache()
    llm.engine.reset_stats()
    warm = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert warm.num_cached_tokens > 0
    _same(cold, warm)
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens


@pytest.mark.parametrize("backend,layer_by_layer", [("torch_sdpa", True), ("cpu_native", False)])
def test_the_worker_side_is_called_as_vllms_is(backend, layer_by_layer):
    """start_load_kv, then each layer's load wait before it and its save
    after it (the native forward runs the layers in one call: every wait
    before it, every save after it), wait_for_save, get_finished."""
    from appliance.engine.kv_connector import KVConnectorOutput
    from appliance.worker.kv_connector import KVConnectorWorker

    llm = LLM(overrides=["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05",
                         f"attention.backend={backend}"])
    runner, calls = llm.engine.runner, []

    class Recorder(KVConnectorWorker):
        def start_load_kv(self, meta, kv_caches):
            calls.append("start")

        def wait_for_layer_load(self, layer):
            calls.append(f"load {layer}")

        def save_kv_layer(self, layer, kv_cache):
            assert kv_cache is runner.kv_caches[layer]
            calls.append(f"save {layer}")

        def wait_for_save(self):
            calls.append("saved")

        def get_finished(self):
            calls.append("finished")
            return KVConnectorOutput()

    runner.kv_connector = Recorder()
    llm.generate(["hello"], SamplingParams(max_tokens=1), use_tqdm=False)
    n = len(runner.kv_caches)
    if layer_by_layer:
        layers = [c for i in range(n) for c in (f"load {i}", f"save {i}")]
    else:
        layers = [f"load {i}" for i in range(n)] + [f"save {i}" for i in range(n)]
    assert calls[:2 * n + 3] == ["start", *layers, "saved", "finished"]
