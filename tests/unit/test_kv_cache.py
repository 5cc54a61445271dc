"""Block pool and prefix caching on tiny pools, with exact block ids
(in the style of vLLM's tests/v1/core/test_prefix_caching.py)."""

import os
import subprocess
import sys

import pytest

from appliance.engine.kv_cache.block_pool import BlockPool
from appliance.engine.kv_cache.hashing import cbor_dumps, get_hash_fn, hash_block_tokens, update_block_hashes
from appliance.engine.kv_cache.manager import KVCacheManager
from tests.unit.engine_helpers import make_req


def alloc(kv, req):
    hits, n = kv.get_computed_blocks(req)
    blocks = kv.allocate_slots(req, req.num_tokens - n, n, hits)
    assert blocks is not None
    req.num_computed_tokens = req.num_tokens
    kv.check_integrity()
    return hits, blocks


def ids(blocks):
    """Block ids of one group's list, or of a one-group cache's per-group tuple."""
    if isinstance(blocks, tuple):
        (blocks,) = blocks
    return [b.block_id for b in blocks]


def free_order(kv):
    return kv.pool.free_block_ids()


def test_null_block_and_initial_free_queue():
    kv = KVCacheManager(10, 4)
    assert kv.pool.null_block.block_id == 0
    assert free_order(kv) == list(range(1, 10))
    kv.check_integrity()


def test_a_block_is_made_when_first_handed_out_and_never_used_ones_go_first():
    """A pool of ten million blocks holds objects only for the blocks handed
    out; a freed block queues behind every block never used."""
    pool = BlockPool(10_000_000, 4)
    assert len(pool.blocks) == 1 and pool.num_free_blocks == 10_000_000 - 1
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (1, 2) and len(pool.blocks) == 3
    pool.free_blocks([a])
    assert pool.free_block_ids()[:2] == [3, 4] and pool.free_block_ids()[-1] == 1
    assert pool.num_free_blocks == 10_000_000 - 2 and pool.num_used_blocks == 1
    small = BlockPool(4, 4)
    x, y, z = small.get_new_blocks(3)
    small.free_blocks([z, x])
    assert small.free_block_ids() == [3, 1]
    assert [blk.block_id for blk in small.get_new_blocks(2)] == [3, 1]  # then the freed ones, LRU first
    with pytest.raises(ValueError, match="cannot allocate 1 blocks; 0 free"):
        small.get_new_blocks(1)


def test_prefill_caches_only_full_blocks():
    kv = KVCacheManager(10, 4)
    a = make_req("a", range(1, 11))  # 10 tokens: 2 full blocks + 2
    hits, blocks = alloc(kv, a)
    assert ids(hits) == [] and ids(blocks) == [1, 2, 3]
    assert len(kv.pool.cached_blocks[0]) == 2
    assert kv.pool.blocks[3].block_hash is None  # trailing partial block never cached


def test_shared_prefix_dedups_to_same_physical_blocks():
    kv = KVCacheManager(10, 4)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    alloc(kv, a)
    b = make_req("b", [1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97])
    hits, blocks = alloc(kv, b)
    assert ids(hits) == [1, 2] and ids(blocks) == [4]
    assert kv.get_block_ids("b") == ([1, 2, 4],)
    assert kv.pool.blocks[1].ref_cnt == 2 and kv.pool.blocks[2].ref_cnt == 2
    assert kv.stats.queries == 21 and kv.stats.hits == 8


def test_hit_is_capped_so_last_token_is_recomputed():
    kv = KVCacheManager(10, 4)
    alloc(kv, make_req("a", range(1, 9)))  # exactly 2 full blocks
    hits, n = kv.get_computed_blocks(make_req("b", range(1, 9)))
    assert ids(hits) == [1] and n == 4


def test_cache_salt_isolates_identical_prompts():
    kv = KVCacheManager(10, 4)
    alloc(kv, make_req("a", range(1, 10), salt="tenant-1"))
    assert kv.get_computed_blocks(make_req("b", range(1, 10), salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(make_req("c", range(1, 10)))[1] == 0
    assert kv.get_computed_blocks(make_req("d", range(1, 10), salt="tenant-1"))[1] == 8


def test_free_appends_in_reverse_order_and_lru_eviction():
    kv = KVCacheManager(10, 4)
    a = make_req("a", range(1, 13))  # 3 full blocks
    alloc(kv, a)
    assert ids(kv.groups[0].req_to_blocks["a"]) == [1, 2, 3]
    kv.free(a)
    kv.check_integrity()
    # Never-used blocks first, then a's blocks last-first: block 3 is evicted before 1.
    assert free_order(kv) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    # The freed blocks stay cached until popped.
    assert len(kv.pool.cached_blocks[0]) == 3
    b = make_req("b", range(100, 128))  # 28 tokens: 7 blocks
    _, blocks = alloc(kv, b)
    assert ids(blocks) == [4, 5, 6, 7, 8, 9, 3]
    # Block 3 was evicted (its old hash dropped) and re-cached with b's tokens.
    hits, n = kv.get_computed_blocks(make_req("c", range(1, 13)))
    assert ids(hits) == [1, 2] and n == 8


def test_hit_on_free_cached_block_removes_it_from_queue_middle():
    kv = KVCacheManager(10, 4)
    a = make_req("a", range(1, 10))
    alloc(kv, a)
    kv.free(a)
    assert free_order(kv) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    b = make_req("b", range(1, 10))
    hits, blocks = alloc(kv, b)
    assert ids(hits) == [1, 2] and ids(blocks) == [4]
    assert free_order(kv) == [5, 6, 7, 8, 9, 3]


def test_allocation_failure_returns_none_and_changes_nothing():
    kv = KVCacheManager(5, 4)  # 4 usable blocks
    a = make_req("a", range(1, 13))
    alloc(kv, a)
    b = make_req("b", range(50, 60))
    assert kv.allocate_slots(b, 10) is None
    assert not kv.holds("b")
    kv.check_integrity()


def test_evictable_hits_count_against_free_blocks():
    kv = KVCacheManager(5, 4)  # blocks 1..4
    a = make_req("a", range(1, 10))  # 3 blocks, 2 cached
    alloc(kv, a)
    kv.free(a)
    b = make_req("b", list(range(1, 9)) + [70] * 9)  # hits 2 free blocks, needs 3 more
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, b.num_tokens - n, n, hits) is None  # 2 hits + 3 new > 4
    kv.check_integrity()


def test_reset_prefix_cache_refused_while_held():
    kv = KVCacheManager(10, 4)
    a = make_req("a", range(1, 10))
    alloc(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.pool.cached_blocks[0] == {}
    assert kv.get_computed_blocks(make_req("b", range(1, 10)))[1] == 0
    kv.check_integrity()


def test_hash_collision_never_serves_wrong_kv(monkeypatch):
    kv = KVCacheManager(10, 4)
    kv.hash_fn = lambda obj: b"same"  # every block collides
    alloc(kv, make_req("a", range(1, 10)))
    hits, n = kv.get_computed_blocks(make_req("b", range(20, 29)))
    assert n == 0 and ids(hits) == []


def test_decode_caches_block_when_it_fills():
    kv = KVCacheManager(10, 4)
    a = make_req("a", [1, 2, 3])
    alloc(kv, a)
    assert kv.pool.cached_blocks[0] == {}
    a.append_output_token(4)
    assert kv.allocate_slots(a, 1) == ([],)
    a.num_computed_tokens += 1
    assert len(kv.pool.cached_blocks[0]) == 1
    a.append_output_token(5)
    assert ids(kv.allocate_slots(a, 1)) == [2]
    kv.check_integrity()


def test_lookahead_slots_allocate_ahead():
    kv = KVCacheManager(10, 4)
    a = make_req("a", [1, 2, 3])
    assert ids(kv.allocate_slots(a, 3, num_lookahead_tokens=3)) == [1, 2]


def test_kv_events():
    kv = KVCacheManager(4, 2, enable_events=True)
    a = make_req("a", [1, 2, 3, 4, 5])
    alloc(kv, a)
    kv.free(a)
    alloc(kv, make_req("b", [9, 9, 9, 9, 9, 9]))
    kinds = [e.kind for e in kv.pool.take_events()]
    # a stores 2 full blocks; b evicts both (its 3 blocks are all the pool has) and stores 3.
    assert kinds == ["BlockStored"] * 2 + ["BlockRemoved", "BlockRemoved", "BlockStored"] + ["BlockStored"] * 2


def test_pool_rejects_tiny_sizes():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1, 4)


# -- hashing ------------------------------------------------------------------
def test_cbor_is_canonical():
    assert cbor_dumps((None, (1, 2), None)) == bytes([0x83, 0xF6, 0x82, 0x01, 0x02, 0xF6])
    assert cbor_dumps(1000) == bytes([0x19, 0x03, 0xE8])
    assert cbor_dumps(-1) == bytes([0x20])
    assert cbor_dumps("a") == b"\x61a"


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "builtin"])
def test_chained_hash_depends_on_parent_and_extra_keys(algo):
    fn = get_hash_fn(algo)
    h1 = hash_block_tokens(fn, None, [1, 2])
    assert h1 == hash_block_tokens(fn, None, [1, 2])
    assert h1 != hash_block_tokens(fn, h1, [1, 2])
    assert h1 != hash_block_tokens(fn, None, [1, 2], (("salt", "x"),))


def test_lora_and_multimodal_extra_keys():
    fn = get_hash_fn("sha256")
    a, b, c = make_req("a", range(8)), make_req("b", range(8)), make_req("c", range(8))
    b.lora_id = 3
    c.mm_hashes = [(5, 2, "img-abc")]
    ha, hb, hc = (update_block_hashes(r, 4, fn) for r in (a, b, c))
    assert ha[0] != hb[0] and ha[1] != hb[1]  # lora on every block
    assert ha[0] == hc[0] and ha[1] != hc[1]  # image covers tokens 5-6, block 1


def test_sha256_cbor_is_reproducible_across_processes():
    code = (
        "from appliance.engine.kv_cache.hashing import get_hash_fn, hash_block_tokens;"
        "print(hash_block_tokens(get_hash_fn('sha256_cbor'), None, [1, 2, 3], (('salt', 's'),)).hex())"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and len(outs.pop().strip()) == 64
