"""Beam search (appliance/engine/beam_search.py): the algorithm on made-up
log-probabilities, forks of the KV cache with copy on write, and the
engine's beams token for token against transformers' generate(num_beams=n)
on the tiny model in fp32 (with stop tokens, seats and blocks short of the
beams, preemption, other requests beside)."""

import math

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.engine.beam_search import BeamSearch
from appliance.engine.kv_cache.manager import KVCacheManager
from appliance.engine.request import Request
from appliance.sampling_params import SamplingParamsError
from tests.model_helpers import PROMPTS, hf_greedy, hf_model, resolve_model_folder

L = math.log


# -- the algorithm --------------------------------------------------------------------
def test_the_best_candidates_continue_and_the_top_n_finish_on_a_stop_token():
    s = BeamSearch(num_beams=2, max_new_tokens=5, stop_ids=[0], eos_token_id=0)
    assert s.num_candidates == 4
    assert s.advance([[(7, L(0.5)), (8, L(0.3)), (0, L(0.2))]]) == [(0, 7), (0, 8)]
    # beam 0 (7) ends on the stop token, the best candidate; beam 1 (8) goes on twice, ahead of 7 then 9
    nxt = s.advance([[(0, L(0.9)), (9, L(0.1))], [(5, L(0.6)), (6, L(0.4))]])
    assert nxt == [(1, 5), (1, 6)]
    assert [(h.token_ids, h.finish_reason, h.stop_reason) for h in s.finished] == [([7, 0], "stop", None)]
    assert s.finished[0].score == pytest.approx((L(0.5) + L(0.9)) / 2)
    assert [(b.token_ids, b.score) for b in s.running] == [([8, 5], pytest.approx(L(0.3) + L(0.6))),
                                                           ([8, 6], pytest.approx(L(0.3) + L(0.4)))]
    assert not s.done


def test_a_stop_candidate_outside_the_top_n_does_not_finish():
    s = BeamSearch(num_beams=1, max_new_tokens=5, stop_ids=[0], eos_token_id=0)
    assert s.advance([[(3, L(0.6)), (0, L(0.4))]]) == [(0, 3)]  # 0 is second: not among the top 1
    assert s.finished == []


def test_the_length_limit_finishes_the_top_n_by_length_penalty():
    s = BeamSearch(num_beams=2, max_new_tokens=2, stop_ids=[0], eos_token_id=0, length_penalty=2.0)
    s.advance([[(4, L(0.6)), (5, L(0.4))]])
    assert s.advance([[(6, L(0.5)), (7, L(0.5))], [(8, L(0.9)), (9, L(0.1))]]) == []
    assert s.done
    res = s.results()
    assert [h.token_ids for h in res] == [[5, 8], [4, 6]] and {h.finish_reason for h in res} == {"length"}
    assert res[0].score == pytest.approx((L(0.4) + L(0.9)) / 4)


@pytest.mark.parametrize("early_stopping, steps", [(True, 2), (False, 2), ("never", 3)])
def test_early_stopping_ends_the_search_when_nothing_can_improve(early_stopping, steps):
    """Both beams finish at step 2. True stops there; False stops as well, since the best running beam at its
    current length is no better than the worst finished; "never" (a positive penalty: the bound at the limit)
    keeps going while the running beam, at the longest length, could still win."""
    s = BeamSearch(num_beams=2, max_new_tokens=4, stop_ids=[0], eos_token_id=0, early_stopping=early_stopping)
    s.advance([[(1, L(0.5)), (2, L(0.5))]])
    taken = 1
    tops = [[(0, L(0.6)), (3, L(0.4))], [(0, L(0.6)), (3, L(0.4))]]
    while not s.done:
        s.advance(tops[: len(s.running)])
        taken += 1
    assert taken == steps and len(s.finished) == 2


def test_stop_reason_names_a_stop_token_but_not_the_eos():
    s = BeamSearch(num_beams=1, max_new_tokens=5, stop_ids=[0, 9], eos_token_id=0)
    s.advance([[(9, L(0.9)), (4, L(0.1))]])
    assert s.done and (s.results()[0].finish_reason, s.results()[0].stop_reason) == ("stop", 9)


def test_advance_takes_one_list_per_running_beam():
    s = BeamSearch(num_beams=2, max_new_tokens=5, stop_ids=[], eos_token_id=None)
    with pytest.raises(ValueError, match="each of the 1 running beams"):
        s.advance([[(1, -1.0)], [(2, -1.0)]])


# -- forks of the KV cache --------------------------------------------------------------
def _request(rid, n_tokens):
    return Request(rid, list(range(1, n_tokens + 1)))


def test_a_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    parent = _request("p", 10)  # blocks: 4 + 4 + 2 tokens
    kv.allocate_slots(parent, 10)
    kv.hold("p", "p#kv")
    kv.free(parent)
    held = kv.get_block_ids("p#kv")[0]
    assert kv.fork("p#kv", "a", 10)
    a = kv.get_block_ids("a")[0]
    assert a[:2] == held[:2] and a[2] != held[2]
    assert kv.take_copies() == [(held[2], a[2])] and kv.take_copies() == []
    kv.move("p#kv", "b", 10)  # the last child takes the table as it stands: no copy
    assert kv.get_block_ids("b")[0] == held and kv.take_copies() == []
    assert [kv.pool.blocks[b].ref_cnt for b in held] == [2, 2, 1]
    kv.check_integrity()
    kv.free_held("a")
    kv.free_held("b")
    kv.check_integrity()
    assert kv.num_free_blocks == 15


def test_a_fork_at_a_block_boundary_copies_nothing_and_a_full_pool_refuses():
    kv = KVCacheManager(num_blocks=4, block_size=4)  # three blocks to hand out
    kv.allocate_slots(_request("p", 8), 8)  # two full blocks: the next token starts a third
    assert kv.fork("p", "a", 8) and kv.take_copies() == []
    assert kv.get_block_ids("a") == kv.get_block_ids("p")
    kv.free_held("a")
    kv.allocate_slots(_request("q", 3), 3)  # the pool's last block, partly filled
    assert kv.num_free_blocks == 0 and not kv.fork("q", "c", 3)  # no block for the copy: nothing taken
    assert not kv.holds("c")
    kv.check_integrity()


def test_a_fork_passes_on_no_lookahead_slots():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots(_request("p", 6), 6, num_lookahead_tokens=6)  # a draft model's slots: three blocks
    assert kv.fork("p", "a", 6) and len(kv.get_block_ids("a")[0]) == 2  # the copy of the second
    kv.move("p", "b", 6)
    assert len(kv.get_block_ids("b")[0]) == 2 and kv.num_free_blocks == 8 - 1 - 3
    kv.check_integrity()


# -- the parameters ------------------------------------------------------------------------
@pytest.mark.parametrize("kw, param", [
    (dict(temperature=0.7), "temperature"), (dict(stop=["x"]), "stop"), (dict(logprobs=1), "logprobs"),
    (dict(seed=1), "seed"), (dict(top_p=0.5), "top_p"), (dict(min_tokens=2), "min_tokens"),
    (dict(repetition_penalty=1.2), "repetition_penalty"), (dict(n=11), "n"),
    (dict(n=5, stop_token_ids=[3, 4, 5]), "n"), (dict(early_stopping=1), "early_stopping"),
])
def test_what_beam_search_does_not_take_is_refused_by_name(kw, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(use_beam_search=True, **kw)
    assert e.value.param == param


def test_beam_settings_without_beam_search_are_refused():
    for kw in (dict(length_penalty=2.0), dict(early_stopping=True)):
        with pytest.raises(SamplingParamsError, match="beam search only"):
            SamplingParams(**kw)
    SamplingParams(use_beam_search=True, n=10, temperature=0, early_stopping="never", length_penalty=-1.0)


# -- the engine against transformers -------------------------------------------------------
MAX_NEW = 10


def _hf_beams(llm, ids, n, stop_ids, **kw):
    eos = llm.tokenizer.eos_token_id
    model = hf_model(str(resolve_model_folder(llm.resolved.cfg.model)))
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, num_beams=n,
                             num_return_sequences=n, do_sample=False, eos_token_id=[eos, *stop_ids],
                             pad_token_id=eos, **kw)
    beams = []
    for row in out[:, len(ids):].tolist():
        end = next((j + 1 for j, t in enumerate(row) if t in (eos, *stop_ids)), len(row))
        beams.append(row[:end])
    return beams


SCENARIOS = {
    "default": [],
    # three seats for four beams, four-token blocks (forks copy their partial blocks), a pool too small for the
    # searches and the plain requests beside them: beams wait for seats and blocks, the KV held for forks goes
    # back when nothing can run, requests are preempted
    "tight": ["cache.block_size=4", "cache.num_blocks=12", "scheduler.max_num_seqs=3",
              "scheduler.max_num_batched_tokens=32"],
    # a draft model's lookahead slots past each step's token, which forks do not pass on
    "draft_model": ["cache.block_size=4", "speculative=draft_model", "speculative.draft_model=tiny_random",
                    "speculative.num_speculative_tokens=3", "speculative.disable_by_batch_size=null"],
}


@pytest.fixture(scope="module", params=list(SCENARIOS))
def llm(request):
    llm = LLM(overrides=["+profile=cpu", "model=tiny_random", *SCENARIOS[request.param]])
    llm.scenario = request.param
    return llm


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, False), (0.5, True), (2.0, "never"), (-1.0, False)])
def test_beams_equal_transformers_token_for_token(llm, length_penalty, early_stopping):
    kv = llm.engine.scheduler.kv
    copies = []
    take = kv.take_copies
    kv.take_copies = lambda: copies.extend(c := take()) or c
    try:
        ids = [llm.tokenizer.encode(p) for p in PROMPTS[1:4]]
        # for each prompt a stop token the model is likely to produce: beams finish on it early and late
        stops = [hf_greedy(llm, p_ids, 4)[2] for p_ids in ids]
        beams = [SamplingParams(n=4, use_beam_search=True, max_tokens=MAX_NEW, stop_token_ids=[stop],
                                length_penalty=length_penalty, early_stopping=early_stopping) for stop in stops]
        plain = SamplingParams(max_tokens=MAX_NEW, temperature=0)
        outs = llm.generate(ids + ids[:2], beams + [plain] * 2, use_tqdm=False)
    finally:
        del kv.take_copies
    for p_ids, stop, out in zip(ids, stops, outs):
        assert [o.token_ids for o in out.outputs] == _hf_beams(llm, p_ids, 4, [stop], length_penalty=length_penalty,
                                                               early_stopping=early_stopping)
        assert [o.text for o in out.outputs] == [llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
                                                 for o in out.outputs]
        assert {o.finish_reason for o in out.outputs} <= {"stop", "length"}
    if length_penalty < 0:  # short beams win: ones that ended on the stop token are among the results
        assert any(o.finish_reason == "stop" and o.stop_reason == stop for stop, out in zip(stops, outs)
                   for o in out.outputs)
    for p_ids, out in zip(ids, outs[3:]):  # the plain requests beside the beams: their own answer
        assert out.outputs[0].token_ids == hf_greedy(llm, p_ids, MAX_NEW)
    if kv.block_size == 4:  # forks in the middle of a block
        assert copies
    if llm.scenario == "tight":
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.beams.num_kv_releases > 0
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks - 1 and not llm.engine.beams.groups and not llm.engine.beams.steps


def test_an_aborted_search_gives_back_every_block(llm):
    eng = llm.engine
    eng.add_request("b", llm.tokenizer.encode(PROMPTS[0]), SamplingParams(n=3, use_beam_search=True, max_tokens=8))
    for _ in range(4):
        assert eng.step() == []  # no output until the search ends
    assert "b" in eng.beams and eng.has_unfinished_requests()
    eng.abort(["b"])
    assert not eng.has_unfinished_requests() and not eng.beams.steps
    eng.scheduler.kv.check_integrity()
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.kv.num_blocks - 1
