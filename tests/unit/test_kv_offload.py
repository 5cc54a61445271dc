"""The offload KV connector (kv_transfer=offload): full blocks saved to a
disk tier as they fill; a prefix that left the block pool, or the process,
loads from the tier instead of being recomputed, with the same tokens and
logprobs; the tier stays under its size limit, least recently used first;
an unreadable file is dropped and its request recomputed; other layouts
never share a folder; the config refuses what is not built."""

import pytest

from appliance import LLM, SamplingParams
from appliance.config.compose import resolve
from appliance.config.plan import make_plan
from appliance.errors import ConfigError

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
    again."""
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
