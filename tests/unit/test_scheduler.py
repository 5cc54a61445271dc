"""Scheduler: one token budget, chunked prefill, preemption victims, priority."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.engine_helpers import EOS, make_req, make_scheduler, null_step


def test_chunked_prefill_of_prompt_longer_than_budget():
    s = make_scheduler(num_blocks=20, budget=8)
    s.add_request(make_req("a", range(1, 21), max_tokens=2))
    steps = []
    for _ in range(5):
        out, upd = null_step(s)
        steps.append((out.num_scheduled_tokens.get("a"), [u.new_token_ids for u in upd]))
    assert steps == [(8, [[]]), (8, [[]]), (4, [[7]]), (1, [[7]]), (None, [])]
    assert not s.has_unfinished_requests()
    s.kv.check_integrity()


def test_mixed_prefill_chunks_and_decodes_in_one_step():
    s = make_scheduler(num_blocks=20, budget=10)
    s.add_request(make_req("a", [1, 2, 3], max_tokens=10))
    null_step(s)  # a prefilled, sampled one token
    s.add_request(make_req("bb", range(10, 30), max_tokens=2))
    out, _ = null_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "bb": 9}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["bb"]
    assert [r.req_id for r in out.scheduled_cached_reqs] == ["a"]
    out, _ = null_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "bb": 9}


def test_no_chunking_when_disabled():
    s = make_scheduler(num_blocks=20, budget=8, enable_chunked_prefill=False)
    s.add_request(make_req("a", range(1, 6)))
    s.add_request(make_req("bb", range(10, 16)))
    out, _ = null_step(s)
    assert out.num_scheduled_tokens == {"a": 5}  # bb (6) does not fit in the remaining 3


def test_long_prefill_threshold_and_partial_prefill_limits():
    s = make_scheduler(num_blocks=40, budget=32, long_prefill_token_threshold=6, max_num_partial_prefills=2,
                       max_long_partial_prefills=1)
    s.add_request(make_req("a", range(1, 21)))  # long
    s.add_request(make_req("bb", range(30, 50)))  # long: must wait, one long partial at a time
    s.add_request(make_req("ccc", range(60, 64)))  # short, completes within the step
    out, _ = null_step(s)
    assert out.num_scheduled_tokens == {"a": 6, "ccc": 4}
    # bb was skipped, not dropped, and keeps its place ahead of later arrivals.
    assert [r.request_id for r in s.waiting] == ["bb"]


def test_fcfs_exact_victim_order():
    s = make_scheduler(num_blocks=5, block_size=4, budget=64)  # 4 blocks
    s.add_request(make_req("a", [1, 2, 3, 4], max_tokens=20))
    s.add_request(make_req("bb", [5, 6, 7, 8], max_tokens=20))
    s.add_request(make_req("ccc", [9, 10, 11, 12], max_tokens=20))
    null_step(s)  # 3 blocks used; each sampled a 5th token
    out, _ = null_step(s)  # a takes the last block; bb needs one: ccc (newest) is preempted
    assert out.preempted_req_ids == {"ccc"}
    assert out.num_scheduled_tokens == {"a": 1, "bb": 1}
    assert [r.request_id for r in s.running] == ["a", "bb"]
    assert [r.request_id for r in s.waiting] == ["ccc"]
    assert s.requests["ccc"].num_computed_tokens == 0 and s.requests["ccc"].num_preemptions == 1


def test_priority_preempts_largest_priority_then_newest():
    s = make_scheduler(num_blocks=5, block_size=4, budget=64, policy="priority")
    s.add_request(make_req("a", [1, 2, 3, 4], max_tokens=20, priority=1, arrival=1.0))
    s.add_request(make_req("b", [5, 6, 7, 8], max_tokens=20, priority=5, arrival=2.0))
    s.add_request(make_req("c", [9, 10, 11, 12], max_tokens=20, priority=0, arrival=3.0))
    null_step(s)
    out, _ = null_step(s)
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1, "c": 1}


def test_priority_preempts_at_max_num_seqs():
    s = make_scheduler(num_blocks=20, budget=64, max_seqs=1, policy="priority")
    s.add_request(make_req("low", [1, 2, 3], max_tokens=20, priority=5, arrival=1.0))
    null_step(s)
    s.add_request(make_req("high", [4, 5, 6], max_tokens=20, priority=0, arrival=2.0))
    out, _ = null_step(s)
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 3}
    assert [r.request_id for r in s.running] == ["high"]
    # Equal priority does not preempt.
    s.add_request(make_req("peer", [7, 8, 9], max_tokens=20, priority=0, arrival=3.0))
    out, _ = null_step(s)
    assert out.preempted_req_ids == set() and out.num_scheduled_tokens == {"high": 1}


def test_fcfs_does_not_preempt_at_max_num_seqs():
    s = make_scheduler(num_blocks=20, budget=64, max_seqs=1)
    s.add_request(make_req("a", [1, 2, 3], max_tokens=5))
    null_step(s)
    s.add_request(make_req("b", [4, 5, 6], max_tokens=5))
    out, _ = null_step(s)
    assert out.num_scheduled_tokens == {"a": 1}


def test_preempted_request_hits_its_own_blocks_on_resume():
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)  # 5 blocks
    s.add_request(make_req("a", range(1, 9), max_tokens=20))  # 2 blocks
    s.add_request(make_req("bb", range(20, 28), max_tokens=20))  # 2 blocks
    null_step(s)  # 4 blocks held, 1 free; both sampled token 9
    out, _ = null_step(s)  # a takes the free block for token 9; bb needs one: bb preempted
    assert out.preempted_req_ids == {"bb"}
    s.abort(["a"])
    out, _ = null_step(s)
    resumed = out.scheduled_new_reqs[0]
    assert resumed.req_id == "bb" and resumed.resumed
    assert resumed.num_computed_tokens == 8  # both full prompt blocks served from the cache
    assert out.num_scheduled_tokens == {"bb": 1}
    assert resumed.token_ids == list(range(20, 28)) + [7]


def test_a_longrope_sequence_growing_past_the_original_context_is_computed_again_once():
    """LongRoPE (long_rope_from=8): a prompt of 7 tokens decodes on short frequencies up to 8 tokens; the step that
    would take it to 9 sends it back instead, to compute all of them again on long ones (no preemption counted), its
    blocks hashed as a long prompt's: they serve a longer prompt of the same tokens, never a short one."""
    s = make_scheduler(num_blocks=20, block_size=4, budget=64, long_rope_from=8)
    s.add_request(make_req("a", range(1, 8), max_tokens=4))  # 7 tokens
    s.add_request(make_req("long", range(1, 10), max_tokens=1))  # 9 tokens: long from the start
    assert not s.requests["a"].long_rope and s.requests["long"].long_rope
    out, _ = null_step(s)
    assert out.num_scheduled_tokens == {"a": 7, "long": 9}
    short_hashes = list(s.requests["a"].block_hashes)
    out, _ = null_step(s)  # a feeds its 8th token: still within the context
    assert out.num_scheduled_tokens == {"a": 1}
    out, _ = null_step(s)  # its 9th would pass it: a goes back
    assert out.num_scheduled_tokens == {} and out.preempted_req_ids == {"a"} and s.num_preemptions == 0
    a = s.requests["a"]
    assert a.long_rope and a.num_computed_tokens == 0
    out, _ = null_step(s)
    resumed = out.scheduled_new_reqs[0]
    assert resumed.req_id == "a" and resumed.token_ids == [*range(1, 8), 7, 7]
    # long's first block (the same tokens, long frequencies too) serves it; its own short ones do not
    assert resumed.num_computed_tokens == 4 and out.num_scheduled_tokens == {"a": 5}
    assert a.block_hashes[0] != short_hashes[0]
    s.add_request(make_req("b", [*range(1, 8), 7, 7, 5], max_tokens=1))  # long: a's blocks serve it
    out, _ = null_step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    s.add_request(make_req("c", range(1, 8), max_tokens=1))  # short: the short blocks of a's first run serve it
    out, _ = null_step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4
    s.kv.check_integrity()


def test_stop_conditions():
    s = make_scheduler(num_blocks=20)
    s.add_request(make_req("eos", [1, 2], max_tokens=10, ignore_eos=False))
    s.add_request(make_req("min", [1, 2], max_tokens=10, ignore_eos=False, min_tokens=2))
    s.add_request(make_req("stoptok", [3, 4], max_tokens=10, stop_token_ids=[EOS]))
    out = s.schedule()
    upd = {u.request.request_id: u for u in s.update_from_output(out, {"eos": [EOS], "min": [EOS], "stoptok": [EOS]})}
    assert upd["eos"].finished and upd["eos"].request.finish_reason == "stop"
    assert not upd["min"].finished
    assert upd["stoptok"].finished and upd["stoptok"].request.stop_reason == EOS
    out, _ = null_step(s)
    out = s.schedule()
    assert s.update_from_output(out, {"min": [EOS]})[0].finished


def test_max_tokens_and_max_model_len_stop():
    s = make_scheduler(num_blocks=40, max_model_len=6)
    s.add_request(make_req("a", [1, 2, 3], max_tokens=100))
    for _ in range(3):
        out, upd = null_step(s)
    assert upd[0].finished and upd[0].request.finish_reason == "length" and upd[0].request.num_tokens == 6
    with pytest.raises(ValueError, match="max_model_len=6"):
        s.add_request(make_req("b", range(6)))


def test_stop_string_decided_by_caller_truncates():
    s = make_scheduler(num_blocks=20)
    s.add_request(make_req("a", [1, 2], max_tokens=10))
    out = s.schedule()
    upd = s.update_from_output(out, {"a": [5]}, stopped_by_caller={"a": (0, "stop_string")})
    assert upd[0].finished and upd[0].new_token_ids == [] and upd[0].request.output_token_ids == []


def test_abort_frees_everything():
    s = make_scheduler(num_blocks=20)
    for rid in ("a", "bb", "ccc"):
        s.add_request(make_req(rid, range(1, 10), max_tokens=50))
    null_step(s)
    s.add_request(make_req("dddd", range(1, 5)))
    s.abort(["a", "bb", "ccc", "dddd", "unknown"])
    assert not s.has_unfinished_requests()
    assert s.kv.pool.num_free_blocks == 19
    out = s.schedule()
    assert out.finished_req_ids == {"a", "bb", "ccc", "dddd"}
    s.kv.check_integrity()


def test_drafts_cut_by_the_budget_or_the_length_are_dropped():
    s = make_scheduler(num_blocks=30, budget=3, max_model_len=9)
    s.add_request(make_req("a", [1, 2, 3], max_tokens=20))
    null_step(s)
    req = s.requests["a"]
    req.spec_token_ids = [8, 9, 10, 11]
    out = s.schedule()  # a budget of 3: the last token and two drafts
    assert out.num_scheduled_tokens == {"a": 3} and out.scheduled_spec_decode_tokens == {"a": [8, 9]}
    s.update_from_output(out, {"a": [8, 9, 12]}, None, {"a": [1, 2, 3, 4]})
    assert req.num_tokens == 7 and req.num_computed_tokens == 6
    out = s.schedule()  # max_model_len 9: positions up to 7, so one draft
    assert out.num_scheduled_tokens == {"a": 2} and out.scheduled_spec_decode_tokens == {"a": [1]}


def test_accepted_tokens_stop_at_the_first_stop_condition():
    s = make_scheduler(num_blocks=20)
    s.add_request(make_req("a", [1, 2, 3], max_tokens=20, ignore_eos=False))
    s.add_request(make_req("b", [1, 2, 4], max_tokens=3))
    null_step(s)
    for rid in "ab":
        s.requests[rid].spec_token_ids = [5, 6, 7]
    out = s.schedule()
    assert s.num_kept(s.requests["a"], [5, EOS, 6, 7]) == 2 and s.num_kept(s.requests["b"], [5, 6, 7, 8]) == 2
    upd = {u.request.request_id: u for u in s.update_from_output(out, {"a": [5, EOS, 6, 7], "b": [5, 6, 7, 8]})}
    assert upd["a"].new_token_ids == [5, EOS] and upd["a"].request.finish_reason == "stop"
    assert upd["b"].new_token_ids == [5, 6] and upd["b"].request.finish_reason == "length"  # max_tokens=3


def test_speculative_tokens_rollback():
    s = make_scheduler(num_blocks=20)
    s.add_request(make_req("a", [1, 2, 3], max_tokens=20))
    null_step(s)
    req = s.requests["a"]
    req.spec_token_ids = [8, 9, 10]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_spec_decode_tokens == {"a": [8, 9, 10]}
    s.update_from_output(out, {"a": [8, 11]})  # one draft accepted, then a correction
    assert req.output_token_ids == [7, 8, 11]
    assert req.num_computed_tokens == 5 and req.num_tokens == 6


# -- property test ------------------------------------------------------------
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 3), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(0, 6)),
        st.tuples(st.just("abort"), st.integers(0, 40)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    budget=st.integers(4, 48),
    max_seqs=st.integers(1, 6),
    num_blocks=st.integers(9, 24),
    block_size=st.sampled_from([2, 4, 8]),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    threshold=st.sampled_from([0, 5]),
    spec_k=st.integers(0, 3),
    lookahead=st.integers(0, 2),
    seed=st.integers(0, 2 ** 16),
)
def test_random_workloads_keep_invariants(ops, budget, max_seqs, num_blocks, block_size, policy, caching, threshold,
                                          spec_k, lookahead, seed):
    """With spec_k > 0 requests that sampled get up to spec_k random drafts
    for their next step, and a random number of the drafts sent is
    accepted (the rest rolled back)."""
    max_model_len = 64
    s = make_scheduler(num_blocks=num_blocks, block_size=block_size, budget=budget, max_seqs=max_seqs,
                       max_model_len=max_model_len, caching=caching, policy=policy,
                       long_prefill_token_threshold=threshold, max_num_partial_prefills=2, max_long_partial_prefills=1,
                       num_lookahead_tokens=lookahead)
    added, n = [], 0
    finished = set()
    rng = random.Random(seed)

    def step():
        token = (len(finished) % 5) + 1
        out = s.schedule()
        sampled, drafts = {}, {}
        for rid in out.num_scheduled_tokens:
            req = s.requests[rid]
            assert req.num_computed_tokens <= max_model_len - 1  # positions stay below max_model_len - 1
            sent = out.scheduled_spec_decode_tokens.get(rid, [])
            if req.num_computed_tokens >= req.num_tokens:
                assert len(sent) == req.num_computed_tokens - req.num_tokens  # dropped drafts are not sent
                sampled[rid] = sent[: rng.randint(0, len(sent))] + [token]
                if spec_k:
                    drafts[rid] = [rng.randint(1, 9) for _ in range(rng.randint(0, spec_k))]
            else:
                assert not sent
        upd = s.update_from_output(out, sampled, None, drafts)
        assert out.total_num_scheduled_tokens <= budget
        assert len(out.num_scheduled_tokens) <= max_seqs and len(s.running) <= max_seqs
        for u in upd:
            if u.finished:
                finished.add(u.request.request_id)
            elif u.request.request_id in sampled:
                assert u.request.num_computed_tokens == u.request.num_tokens - 1  # rejected drafts rolled back
        s.kv.check_integrity()

    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, prio, prefix_kind = op
            # Requests need a whole max_model_len-sized table at most; keep them feasible for the pool, lookahead
            # slots included (the scheduler refuses a prompt the pool can never hold).
            plen = min(plen, (num_blocks - 1) * block_size - max_tokens - 1 - lookahead, max_model_len - 1)
            if plen < 1:
                continue
            prefix = [prefix_kind] * (plen // 2)  # shared prefixes exercise caching
            tokens = (prefix + list(range(100 + n, 100 + n + plen)))[:plen]
            rid = f"r{n}"
            s.add_request(make_req(rid, tokens, max_tokens=max_tokens, priority=prio, arrival=float(n)))
            added.append(rid)
            n += 1
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        else:
            if added:
                aborted = s.abort([added[op[1] % len(added)]])
                finished.update(r.request_id for r in aborted)
                s.kv.check_integrity()
    # Everything drains: no starvation, nothing leaks.
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        step()
    assert not s.has_unfinished_requests(), [repr(r) for r in list(s.running) + list(s.waiting)]
    assert finished == set(added)
    assert s.kv.pool.num_free_blocks == num_blocks - 1
    assert not any(g.req_to_blocks for g in s.kv.groups)
