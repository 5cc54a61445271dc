"""KVCacheManager.can_allocate (the one copy of the block arithmetic) and the
scheduler's per-step _Budget."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.engine.kv_cache.manager import KVCacheManager, cdiv
from appliance.engine.scheduler import _Budget
from tests.unit.engine_helpers import make_req, make_scheduler, null_step


def _free_cached_prefix(kv, tokens):
    """Prefill a request over ``tokens`` and free it: its full blocks stay
    cached, sitting in the free queue (ref_cnt 0)."""
    req = make_req("prefix-owner", tokens)
    assert kv.allocate_slots(req, req.num_tokens) is not None
    kv.free(req)


# -- can_allocate ---------------------------------------------------------------
def test_cache_hits_in_the_free_queue_count_as_taken():
    kv = KVCacheManager(6, 4)  # 5 usable blocks
    _free_cached_prefix(kv, range(1, 10))  # blocks 1, 2 cached (full), 3 not
    filler = make_req("filler", range(100, 108))
    assert kv.allocate_slots(filler, 8) is not None  # takes 4, 5 from the head of the queue
    req = make_req("c", list(range(1, 9)) + [50, 51, 52, 53, 54])  # 13 tokens: hits 1, 2 + 2 new blocks
    hits, num_hit_tokens = kv.get_computed_blocks(req)
    assert [b.block_id for b in hits[0]] == [1, 2] and all(b.ref_cnt == 0 for b in hits[0])
    assert kv.num_free_blocks == 3  # 3, 2, 1: two of them are the hits themselves
    num_new = req.num_tokens - num_hit_tokens
    # The arithmetic the scheduler used to duplicate ignored that touching the
    # hits takes them out of the free queue, and said this fits.
    old_says_fits = cdiv(num_new, kv.block_size) - len(kv.groups[0].req_to_blocks.get("c", [])) <= kv.num_free_blocks
    assert old_says_fits
    assert not kv.can_allocate(req, num_new, num_hit_tokens, hits)
    assert kv.allocate_slots(req, num_new, num_hit_tokens, hits) is None
    assert not kv.holds("c")
    # One block fewer and it does fit: 2 hits touched, 1 new from the 1 left.
    assert kv.can_allocate(req, num_new - 4, num_hit_tokens, hits)
    assert [b.block_id for b in kv.allocate_slots(req, num_new - 4, num_hit_tokens, hits)[0]] == [3]
    kv.check_integrity()


def test_held_cache_hits_cost_no_free_block():
    kv = KVCacheManager(6, 4)  # 5 usable blocks
    a = make_req("a", range(1, 10))
    assert kv.allocate_slots(a, 9) is not None  # blocks 1, 2 (cached), 3; 4, 5 free
    b = make_req("b", list(range(1, 9)) + [60, 61, 62, 63])  # 12 tokens
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits[0]] == [1, 2] and [h.ref_cnt for h in hits[0]] == [1, 1]
    # 4 tokens + 4 lookahead: 4 blocks, 2 of them hits held by a: both free blocks, exactly.
    assert kv.can_allocate(b, 4, n, hits, num_lookahead_tokens=4)
    assert not kv.can_allocate(b, 4, n, hits, num_lookahead_tokens=5)
    assert kv.allocate_slots(b, 4, n, hits, num_lookahead_tokens=5) is None
    assert [x.block_id for x in kv.allocate_slots(b, 4, n, hits, num_lookahead_tokens=4)[0]] == [4, 5]
    kv.check_integrity()


def test_uncache_blocks_forgets_hashes_from_a_block_on():
    kv = KVCacheManager(6, 4)
    a = make_req("a", range(1, 13))
    assert kv.allocate_slots(a, 12) is not None  # 3 full blocks, all cached
    kv.uncache_blocks("a", 1)
    assert [b.block_hash is not None for b in kv.groups[0].req_to_blocks["a"]] == [True, False, False]
    assert kv.get_computed_blocks(make_req("b", range(1, 14)))[1] == 4
    kv.check_integrity()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 20), st.integers(0, 6), st.integers(0, 3)),
        st.tuples(st.just("decode"), st.integers(0, 20), st.integers(0, 3)),
        st.tuples(st.just("free"), st.integers(0, 20)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(2, 14), block_size=st.sampled_from([1, 2, 4]), caching=st.booleans())
def test_can_allocate_is_true_exactly_when_allocate_slots_succeeds(ops, num_blocks, block_size, caching):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    live = []
    for i, op in enumerate(ops):
        if op[0] == "add":
            _, prefix, plen, cut, lookahead = op
            tokens = ([prefix + 1] * plen + list(range(100 + 50 * i, 130 + 50 * i)))[: plen + 3]
            req = make_req(f"r{i}", tokens)
            hits, n = kv.get_computed_blocks(req)
            args = (req, max(1, req.num_tokens - n - cut), n, hits, lookahead)
        elif op[0] == "decode" and live:
            req = live[op[1] % len(live)]
            req.append_output_token(7)
            args = (req, req.num_tokens - req.num_computed_tokens, 0, None, op[2])
        elif op[0] == "free" and live:
            kv.free(live.pop(op[1] % len(live)))
            kv.check_integrity()
            continue
        else:
            continue
        expected = kv.can_allocate(*args)
        blocks = kv.allocate_slots(*args)
        assert expected == (blocks is not None)
        if blocks is not None:
            req.num_computed_tokens += args[1] + args[2]
            if req not in live:
                live.append(req)
        kv.check_integrity()


# -- the scheduler asks can_allocate before preempting ---------------------------
def test_priority_preempts_enough_for_hits_in_the_free_queue():
    s = make_scheduler(num_blocks=8, block_size=4, budget=64, policy="priority")  # 7 usable blocks
    s.add_request(make_req("f", range(1, 9), max_tokens=1, priority=0, arrival=0.0))  # blocks 1, 2
    s.add_request(make_req("low", range(100, 112), max_tokens=20, priority=5, arrival=1.0))  # blocks 3, 4, 5
    null_step(s)  # f finished: its cached blocks 1, 2 are back in the free queue
    assert "f" not in s.requests and s.kv.num_free_blocks == 4
    s.add_request(make_req("high", list(range(1, 9)) + list(range(50, 58)), priority=0, arrival=2.0))
    out, _ = null_step(s)
    # low's decode took block 6, leaving 7, 2, 1 free; high hits 1, 2 and needs
    # 2 new blocks, which fit only once low is preempted (not by the old count
    # of 2 needed <= 3 free).
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 8}
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("high", 8)]
    assert s.requests["high"].num_cached_tokens == 8
    s.kv.check_integrity()


# -- _Budget ----------------------------------------------------------------------
def budget(tokens=16, partial=1, long_partial=1, threshold=0):
    return _Budget(tokens=tokens, partial_slots=partial, long_partial_slots=long_partial, long_threshold=threshold)


def test_cap_by_long_threshold_and_tokens_left():
    assert budget(tokens=16).cap(40) == 16
    assert budget(tokens=16, threshold=6).cap(40) == 6
    assert budget(tokens=4, threshold=6).cap(40) == 4
    assert budget(tokens=16, threshold=6).cap(3) == 3


def test_partial_prefill_slots():
    b = budget(tokens=64, partial=2, long_partial=1, threshold=8)
    long_a, long_b, short = make_req("a", range(20)), make_req("b", range(20)), make_req("c", range(6))
    assert b.is_long(long_a) and not b.is_long(short)
    assert b.admits(long_a, 8)
    b.take(long_a, 8)
    assert (b.partial_slots, b.long_partial_slots, b.tokens) == (1, 0, 56)
    assert not b.admits(long_b, 8)  # the one long slot is taken
    assert b.admits(long_b, 20)  # finishing the prompt needs no slot
    assert b.admits(short, 5)
    b.take(short, 5)  # 5 of 6: unfinished, takes the last slot
    assert (b.partial_slots, b.long_partial_slots) == (0, 0)
    assert not b.admits(make_req("d", range(6)), 5) and b.admits(make_req("e", range(6)), 6)
    b.take(make_req("e", range(6)), 6)  # completes: no slot taken
    assert (b.partial_slots, b.tokens) == (0, 45)


def test_preempt_returns_tokens_but_not_the_partial_slot():
    b = budget(tokens=32, partial=1)
    a, c = make_req("a", range(20)), make_req("c", range(3))
    b.take(a, 10)
    b.new_block_ids["a"] = [4, 5]
    b.preempt(a)
    assert (b.tokens, b.partial_slots, b.num_scheduled, b.new_block_ids) == (32, 0, {}, {})
    b.preempt(c)  # never scheduled this step: only recorded
    assert b.tokens == 32 and b.preempted == [a, c]


def test_a_prompt_its_cache_hits_finish_needs_no_partial_prefill_slot():
    """With the one partial-prefill slot held by a long prompt, a prompt whose
    prefix hits leave one token to compute finishes its prefill this step, so
    it is admitted (it was judged before its hits counted, and skipped)."""
    s = make_scheduler(num_blocks=32, block_size=4, budget=24, long_prefill_token_threshold=16,
                       max_num_partial_prefills=1, max_long_partial_prefills=1)
    prompt = list(range(1, 10))  # 9 tokens: two full blocks to cache
    s.add_request(make_req("first", prompt, max_tokens=1, arrival=0.0))
    while s.has_unfinished_requests():
        null_step(s)
    s.add_request(make_req("long", range(100, 140), max_tokens=1, arrival=1.0))
    again = make_req("again", prompt, max_tokens=1, arrival=2.0)
    s.add_request(again)
    out, _ = null_step(s)
    assert out.num_scheduled_tokens == {"long": 16, "again": 1}
    assert again.num_cached_tokens == 8
