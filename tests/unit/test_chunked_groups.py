"""Chunked local attention's KV-cache groups (Llama 4's): a chunked group gives back a finished chunk's blocks,
a prefix hit needs only the cached blocks of the chunk it ends in, the engine's most blocks are the plan's; and
Llama 4's checkpoint facts, validation and plan."""

import pytest

from appliance.config.compose import resolve
from appliance.config.execution import attention_needs
from appliance.config.hf_facts import hf_facts
from appliance.config.kv_groups import kv_layout
from appliance.config.plan import make_plan
from appliance.config.schema import ModelConfig
from appliance.engine.kv_cache.manager import KVCacheGroupSpec, KVCacheManager
from appliance.errors import ConfigError
from tests.unit.engine_helpers import make_req
from tests.unit.test_kv_groups import run

FULL, C8 = KVCacheGroupSpec(), KVCacheGroupSpec(attention_chunk=8)


def test_a_chunked_group_gives_back_a_finished_chunks_blocks():
    kv = KVCacheManager(40, 4, groups=(FULL, C8))
    req = make_req("a", range(1, 7), max_tokens=64)  # 6 tokens: inside the first chunk
    run(kv, req, 6)
    for t in range(100, 130):
        req.append_output_token(t)
        run(kv, req, 1)
        table = kv.groups[1].req_to_blocks["a"]
        chunk_start = (req.num_computed_tokens - 1) // 8 * 8  # the chunk the last token computed read
        assert all(b.is_null for b in table[: chunk_start // 4]) and not any(b.is_null for b in table[chunk_start // 4:])
        full, chunked = kv.get_block_ids("a")
        assert len(full) == len(chunked) and 0 not in full
    # 36 tokens: the full group holds 9 blocks, the chunked one its current chunk's (32..35: one block)
    assert kv.num_free_blocks == 39 - 9 - 1
    kv.free(req)
    assert kv.num_free_blocks == 39
    kv.check_integrity()


def test_a_hit_needs_only_the_blocks_of_the_chunk_it_ends_in():
    kv = KVCacheManager(60, 4, groups=(FULL, C8))
    a = make_req("a", range(1, 25), max_tokens=64)
    run(kv, a, 24)
    for t in range(100, 108):
        a.append_output_token(t)
        run(kv, a, 1)  # 32 tokens: the chunked group gave back its first chunks' blocks, each still cached
    assert kv.get_block_ids("a")[1][:6] == [0] * 6
    b = make_req("b", list(range(1, 21)) + [7, 7, 7])  # 23 tokens: a hit of at most 5 blocks
    hits, n = kv.get_computed_blocks(b)
    # the first token after 20 attends back to 16: the chunked group serves block 4 only
    assert n == 20 and len(hits[0]) == 5 and [x.is_null for x in hits[1]] == [True] * 4 + [False]
    assert kv.allocate_slots(b, 3, n, hits) is not None
    kv.check_integrity()
    kv.free(b)
    kv.pool.evict_cached(hits[1][4])  # the chunk's block gone: the hit falls back to the chunk's start
    c = make_req("c", list(range(1, 21)) + [9] * 3)
    hits, n = kv.get_computed_blocks(c)
    assert n == 16 and len(hits[0]) == 4 and [x.is_null for x in hits[1]] == [True] * 4


def test_the_engine_holds_at_most_the_plans_blocks():
    m = ModelConfig(num_layers=2, attention_chunk_size=8, layer_types=["chunked_attention", "full_attention"])
    layout = kv_layout(m, 64)
    assert [g.describe() for g in layout.groups] == ["full attention", "chunked local attention 8"]
    assert kv_layout(m, 8).groups[0].attention_chunk is None  # a chunk as long as the sequences never ends
    kv = KVCacheManager(200, 4, groups=(FULL, C8))
    for step in (1, 3, 5):  # prefill in steps of ``step`` tokens, then decode: never past the plan's count
        kv_req = make_req(f"r{step}", range(100 * step, 100 * step + 40), max_tokens=8)
        most = 0
        while kv_req.num_computed_tokens < 40:
            run(kv, kv_req, min(step, 40 - kv_req.num_computed_tokens))
            most = max(most, sum(1 for b in kv.groups[1].req_to_blocks[kv_req.request_id] if not b.is_null))
        plan = layout.blocks_per_request(40, 4, step)[1]
        assert most <= plan == kv.groups[1].most_blocks(40, step)
        assert most == plan or step == 1  # the bound is reached where a step crosses a chunk's end
        kv.free(kv_req)
    with pytest.raises(ValueError, match="not whole blocks"):
        KVCacheManager(20, 16, groups=(FULL, C8))
    with pytest.raises(ValueError, match="not both"):
        KVCacheGroupSpec(sliding_window=8, attention_chunk=8)


HUB_LLAMA4 = {  # Llama 4 Scout's text config as the Hub writes it (no layer_types; every layer sparse)
    "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "num_hidden_layers": 8,
    "hidden_size": 64, "intermediate_size": 32, "intermediate_size_mlp": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 65536,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "num_local_experts": 16, "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 2, "attention_chunk_size": 8192, "attn_temperature_tuning": 4,
    "floor_scale": 8192, "attn_scale": 0.1, "use_qk_norm": True,
}


def test_llama4_facts_read_as_transformers_defaults_them():
    facts, problems = hf_facts(HUB_LLAMA4)
    got = {f.key: f.value for f in facts}
    assert not problems
    assert got["nope_layers"] == [3, 7] and got["attention_chunk_size"] == 8192
    assert got["layer_types"] == ["chunked_attention"] * 3 + ["full_attention"] + ["chunked_attention"] * 3 + [
        "full_attention"]
    assert (got["attn_temperature_floor_scale"], got["attn_temperature_scale"]) == (8192, 0.1)
    assert (got["intermediate_size"], got["moe_intermediate_size"], got["shared_expert_intermediate_size"]) == (
        96, 32, 32)
    assert (got["decoder_sparse_step"], got["mlp_only_layers"], got["norm_topk_prob"]) == (2, [], False)
    assert got["qk_norm"] is True and got["sliding_window"] is None
    odd = hf_facts({**HUB_LLAMA4, "moe_layers": [0, 5], "no_rope_layers": [1, 0] * 4, "attn_temperature_tuning": False,
                    "attention_chunk_size": None})[0]
    got = {f.key: f.value for f in odd}
    assert (got["decoder_sparse_step"], got["mlp_only_layers"]) == (1, [1, 2, 3, 4, 6, 7])
    assert got["nope_layers"] == [1, 3, 5, 7] and got["layer_types"] == ["full_attention"] * 8
    assert got["attn_temperature_floor_scale"] is None and got["attention_chunk_size"] is None


LLAMA4 = ["+profile=cpu", "model=tiny_random", "model.architecture=Llama4ForCausalLM", "model.qk_norm=true",
          "model.attention_chunk_size=16", "model.layer_types=[chunked_attention,full_attention]",
          "model.nope_layers=[1]", "model.num_experts=4", "model.num_experts_per_tok=1",
          "model.moe_intermediate_size=48", "model.shared_expert_intermediate_size=48", "model.norm_topk_prob=false"]


@pytest.mark.parametrize("override,message", [
    (["cache.block_size=32"], "model.attention_chunk_size=16 is not a multiple of cache.block_size=32"),
    (["model.attention_chunk_size=null"], "chunked_attention layers but model.attention_chunk_size is null"),
    (["model.nope_layers=[2]"], "layers [2] are outside 0..1"),
    (["model.attn_temperature_scale=0.1"], "go together"),
    (["model.shared_expert_intermediate_size=8"], "as wide as their experts"),
    (["model.norm_topk_prob=true"], "never renormalized"),
    (["parallel=tp2", "hardware.num_devices=2"], "no tensor-parallel implementation"),
])
def test_llama4_refuses_what_it_cannot_run(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve(LLAMA4 + override)


@pytest.mark.parametrize("override,message", [
    (["model.attention_chunk_size=64"], "model.attention_chunk_size=64 is Llama 4's"),
    (["model.nope_layers=[0]"], "model.nope_layers=[0] is Llama 4's"),
    (["model.attn_temperature_floor_scale=8", "model.attn_temperature_scale=0.1"], "is Llama 4's"),
    (["model.layer_types=[chunked_attention,full_attention]"], "does not build chunked local attention"),
    (["model.architecture=Llama4ForConditionalGeneration"], "needs an image encoder"),
])
def test_other_architectures_refuse_llama4s_keys(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve(["+profile=cpu", "model=tiny_random"] + override)


def test_the_plan_shows_what_chunks_save_and_backends_must_chunk():
    base = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=1", "model.num_layers=32",
            "model.max_position_embeddings=32768", "model.max_model_len=32768"]
    kinds = ",".join((["chunked_attention"] * 3 + ["full_attention"]) * 8)
    plain = resolve(base).cfg
    chunked = resolve(base + LLAMA4[2:] + [f"model.layer_types=[{kinds}]", "model.attention_chunk_size=8192",
                                             "model.nope_layers=[3,7,11,15,19,23,27,31]"]).cfg
    p, q = make_plan(plain), make_plan(chunked)
    assert [g["attention"] for g in q.kv_cache_groups] == ["full attention"] + ["chunked local attention 8192"] * 3
    # a request holds its chunk and a step's tokens beside it in each chunked group, every block in the full one
    assert q.kv_cache_groups[1]["blocks_per_request"] == -(-(8191 + 2048) // 16)
    assert q.max_concurrency_at_max_len == round(q.num_kv_blocks / (2048 + 3 * 640), 2)
    assert q.max_concurrency_at_max_len > 2 * q.max_concurrency_as_full_attention
    assert q.kv_read_at_max_len * 32 == p.kv_read_at_max_len * (8 + 24 // 4)  # a chunked layer reads 8192 of 32768
    assert attention_needs(chunked) == ("chunked",) and attention_needs(plain) == ()
    assert "chunked local attention 8192 in 24 of 32 layers, no rope in 8 of 32 layers" in q.architecture
