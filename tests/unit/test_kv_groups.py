"""KV-cache groups: a sliding window's group gives back the blocks behind
its window, prefix hits follow every group's rules, the layout of layers
over groups and cache tensors, and what the plan and validation read from
it (in the style of vLLM's tests/v1/core/test_single_type_kv_cache_manager.py)."""

import pytest

from appliance.config.compose import resolve
from appliance.config.kv_groups import kv_layout
from appliance.config.plan import make_plan
from appliance.config.schema import ModelConfig
from appliance.engine.kv_cache.manager import KVCacheGroupSpec, KVCacheManager
from appliance.errors import ConfigError
from tests.unit.engine_helpers import make_req, make_scheduler

FULL, W8 = KVCacheGroupSpec(), KVCacheGroupSpec(sliding_window=8)


def ids(blocks):
    return [b.block_id for b in blocks]


def run(kv, req, n):
    """Allocate and compute ``n`` more tokens of ``req`` (its hits first when it has none yet)."""
    hits, num_hit = kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else (None, 0)
    assert kv.allocate_slots(req, n - num_hit, num_hit, hits) is not None
    req.num_computed_tokens += n
    kv.check_integrity()
    return num_hit


def test_a_sliding_window_gives_back_the_blocks_behind_it():
    kv = KVCacheManager(20, 4, groups=(W8,))
    req = make_req("a", range(1, 17), max_tokens=64)  # 16 tokens: 4 blocks
    run(kv, req, 16)
    assert ids(kv.groups[0].req_to_blocks["a"]) == [1, 2, 3, 4]
    for t in range(17, 40):  # decode: the next token attends back to 7 tokens before it
        req.append_output_token(t)
        run(kv, req, 1)
        table = kv.groups[0].req_to_blocks["a"]
        oldest_key = req.num_computed_tokens - 1 - 7  # the last token computed read back to it
        assert all(b.is_null for b in table[: oldest_key // 4]) and not any(b.is_null for b in table[oldest_key // 4:])
    assert kv.num_free_blocks == 19 - 3  # however long it grows: the window's blocks and the one it straddles
    kv.free(req)
    assert kv.num_free_blocks == 19
    kv.check_integrity()


def test_full_and_sliding_groups_share_one_pool():
    kv = KVCacheManager(20, 4, groups=(FULL, W8))
    req = make_req("a", range(1, 17), max_tokens=64)
    run(kv, req, 16)
    full, sliding = kv.get_block_ids("a")
    assert len(full) == len(sliding) == 4 and not set(full) & set(sliding)
    for t in range(17, 33):
        req.append_output_token(t)
        run(kv, req, 1)
    full, sliding = kv.get_block_ids("a")
    assert len(full) == 8 and sliding[:6] == [0] * 6 and 0 not in sliding[6:]
    assert kv.num_free_blocks == 19 - 8 - 2


def test_a_hit_is_what_every_group_can_serve():
    """A sliding window needs only the blocks inside its window at the hit's
    end: a later request hits the whole prefix though the earlier one gave
    its first blocks back; with the window's blocks evicted it hits less."""
    kv = KVCacheManager(40, 4, groups=(FULL, W8))
    a = make_req("a", range(1, 25), max_tokens=64)  # 24 tokens: 6 blocks
    run(kv, a, 24)
    for t in range(100, 108):
        a.append_output_token(t)
        run(kv, a, 1)  # the sliding group gives back its first blocks
    assert kv.get_block_ids("a")[1][:3] == [0, 0, 0]
    b = make_req("b", list(range(1, 25)) + [7, 7, 7])
    hits, n = kv.get_computed_blocks(b)
    assert n == 24  # 6 blocks: the sliding group serves the last two (the 7 keys before position 24)
    assert [x.is_null for x in hits[1]] == [True] * 4 + [False] * 2 and len(hits[0]) == 6
    assert kv.allocate_slots(b, 3, n, hits) is not None
    kv.check_integrity()
    # the sliding group's last two blocks evicted: its window is whole at 4 blocks (given back, still cached)
    for block in hits[1][4:6]:
        kv.pool.evict_cached(block)
    c = make_req("c", list(range(1, 25)) + [9] * 5)
    hits, n = kv.get_computed_blocks(c)
    assert n == 16 and len(hits[0]) == len(hits[1]) == 4 and [x.is_null for x in hits[1]] == [True, True, False, False]


def test_hits_in_the_free_queue_are_taken_before_any_group_draws_new_blocks():
    """A hit of one group that sits in the free queue (no holder) must not be
    handed out as another group's new block in the same allocation."""
    kv = KVCacheManager(7, 4, groups=(FULL, KVCacheGroupSpec(sliding_window=5)))  # 6 usable blocks
    a = make_req("a", range(1, 13))  # 3 blocks a group: every block
    run(kv, a, 12)
    kv.free(a)  # all six cached and free; the sliding group's last block heads the queue
    b = make_req("b", range(1, 14))
    hits, n = kv.get_computed_blocks(b)
    assert n == 12 and ids(hits[1])[2] == kv.pool.free_block_ids()[0]
    new = kv.allocate_slots(b, 1, n, hits)
    assert new is not None and ids(hits[1])[2] not in ids(new[0])
    held = [i for g in kv.get_block_ids("b") for i in g if i]
    assert len(held) == len(set(held)) == 6  # no block in two places
    kv.check_integrity()


def test_a_prompt_the_pool_can_never_hold_is_refused():
    s = make_scheduler(num_blocks=5, block_size=4)  # 4 usable blocks: 16 tokens
    with pytest.raises(ValueError, match="prompt of 20 tokens needs 6 KV cache blocks to run; the cache has 4"):
        s.add_request(make_req("a", range(1, 21)))
    s.add_request(make_req("b", range(1, 12)))  # 12 slots: fits


def test_the_layout_groups_layers_of_a_kind_and_shares_tensors():
    m = ModelConfig(num_layers=6, sliding_window=128,
                    layer_types=["sliding_attention"] * 5 + ["full_attention"])
    layout = kv_layout(m, 4096)
    assert layout.group_size == 1 and [g.sliding_window for g in layout.groups] == [None] + [128] * 5
    assert layout.placement()[5] == (0, 0) and layout.placement()[0] == (1, 0)
    m = ModelConfig(num_layers=4, sliding_window=128,
                    layer_types=["sliding_attention", "full_attention"] * 2)
    layout = kv_layout(m, 4096)
    assert layout.group_size == 2 and [g.layers for g in layout.groups] == [(1, 3), (0, 2)]
    # a window as long as the sequences never slides: one group, a tensor per layer
    assert kv_layout(m, 128).groups[0].sliding_window is None and kv_layout(m, 128).group_size == 4
    assert kv_layout(ModelConfig(num_layers=3, sliding_window=64), 4096).groups[0].layers == (0, 1, 2)


def test_the_plan_counts_each_groups_blocks_and_what_sliding_saves():
    base = ["+profile=cpu", "cache.kv_cache_memory_gib=1", "model.max_model_len=8192"]
    plain = make_plan(resolve(base).cfg)
    half = make_plan(resolve(base + ["model.sliding_window=1024",
                                     f"model.layer_types=[{','.join(['sliding_attention', 'full_attention'] * 15)}]"]).cfg)
    assert [g["attention"] for g in half.kv_cache_groups] == ["full attention", "sliding window 1024"]
    assert half.kv_cache_groups[0]["blocks_per_request"] == 512 and half.kv_cache_groups[1]["blocks_per_request"] < 512
    # half the layers hold a window: a block costs half the bytes, and a request holds fewer of them
    assert half.kv_bytes_per_token * 2 == plain.kv_bytes_per_token
    assert half.max_concurrency_as_full_attention == plain.max_concurrency_at_max_len
    window_blocks = half.kv_cache_groups[1]["blocks_per_request"]  # its window and a 2048-token chunk beside it
    assert window_blocks == -(-(1023 + 2048) // 16) + 1
    assert half.max_concurrency_at_max_len == round(half.num_kv_blocks / (512 + window_blocks), 2)
    assert half.max_concurrency_at_max_len > 1.4 * plain.max_concurrency_at_max_len
    # a decode step at max_model_len reads each sliding layer's window only (K and V: 2 x 3 heads x 64 x 2 bytes)
    assert plain.kv_read_at_max_len == 30 * 8192 * 768 and half.kv_read_at_max_len == 15 * (8192 + 1024) * 768


@pytest.mark.parametrize("override,message", [
    (["model.layer_types=[sliding_attention]"], "model.layer_types has 1 entries for 30 layers"),
    ([f"model.layer_types=[{','.join(['sliding_attention'] * 30)}]"], "model.sliding_window is null"),
    (["model.sliding_window=64", f"model.layer_types=[{','.join(['local'] * 30)}]"], "['local'] not built"),
    (["model.sliding_window=64", "kv_events.enabled=true",
      f"model.layer_types=[{','.join(['sliding_attention', 'full_attention'] * 15)}]"], "with 2 KV-cache groups"),
    (["model.sliding_window=64", "kv_transfer=offload"], "kv_transfer.connector=offload with sliding-window"),
    (["model.sliding_window=64", "speculative=draft_model", "speculative.draft_model=smollm2-135m-instruct"],
     "draft_model with sliding-window layers"),
])
def test_unbuilt_uses_of_windows_are_refused(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve(["+profile=cpu"] + override)
