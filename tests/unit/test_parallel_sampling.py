"""The ``n`` fan-out shared by the server and the offline LLM
(appliance/engine/parallel_sampling.py), and the EngineCore surface the
server's core process uses."""

import pytest

from appliance.engine.core import EngineCore
from appliance.engine.outputs import RequestOutputDelta, StepStats, TokenLogprob
from appliance.engine.parallel_sampling import ParentRequest, child_params, child_request_id
from appliance.sampling_params import SamplingParams
from tests.unit.engine_helpers import make_scheduler


def test_children_of_one_prompt():
    p = SamplingParams(n=3, seed=10, temperature=0.8, max_tokens=5)
    parent = ParentRequest("cmpl-x", 1, p)
    assert [c.request_id for c in parent.children] == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]
    assert [c.index for c in parent.children] == [0, 1, 2] and {c.prompt_index for c in parent.children} == {0}
    assert [c.params.seed for c in parent.children] == [10, 11, 12]
    assert all(c.params.n == 1 and c.params.temperature == 0.8 and c.params.max_tokens == 5 for c in parent.children)
    assert p.n == 3 and p.seed == 10  # the parent's params are not touched


def test_children_of_several_prompts_are_numbered_prompt_major():
    parent = ParentRequest("b", 3, SamplingParams(n=2))
    assert [(c.index, c.prompt_index, c.request_id) for c in parent.children] == [
        (0, 0, "b-0"), (1, 0, "b-1"), (2, 1, "b-2"), (3, 1, "b-3"), (4, 2, "b-4"), (5, 2, "b-5")]
    assert all(c.params.seed is None for c in parent.children) and len(parent) == 6


def test_child_params_and_ids():
    p = SamplingParams(n=4, seed=2**64 - 4)
    assert child_params(p, 3).seed == 2**64 - 1 and child_params(p, 3).n == 1
    assert child_params(SamplingParams(), 0) == SamplingParams()
    assert child_request_id("r", 7) == "r-7"


def _delta(rid, toks, text, finished=False, **kw):
    return RequestOutputDelta(rid, toks, text, finished, num_prompt_tokens=3, num_output_tokens=kw.pop("out", len(toks)),
                              **kw)


def test_deltas_merge_into_their_child_in_order():
    parent = ParentRequest("r", 1, SamplingParams(n=2, logprobs=1))
    lp = TokenLogprob(4, -0.5, 1, [(4, -0.5)])
    parent.add(_delta("r-1", [4], "a", logprobs=[lp], num_cached_tokens=8))
    parent.add(_delta("r-0", [5, 6], "xy", logprobs=[lp, None]))
    assert not parent.finished
    parent.add(_delta("r-1", [7], "b", True, out=2, finish_reason="stop", stop_reason=7, logprobs=[lp],
                      num_cached_tokens=8))
    parent.add(_delta("r-0", [], "z", True, out=2, finish_reason="length"))
    a, b = parent.children
    assert (a.text, a.token_ids, a.finish_reason, a.num_output_tokens) == ("xyz", [5, 6], "length", 2)
    assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == ("ab", [4, 7], "stop", 7)
    assert a.logprobs == [lp, None] and b.logprobs == [lp, lp]
    assert parent.finished and parent.num_cached_tokens == 8 and b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert parent.child("r-1") is b


def test_a_beam_search_runs_one_engine_request_per_prompt_and_splits_its_beams():
    from appliance.engine.outputs import BeamSequence

    p = SamplingParams(n=2, use_beam_search=True, max_tokens=4)
    parent = ParentRequest("r", 2, p)
    assert [c.request_id for c in parent.engine_children] == ["r-0", "r-2"]
    assert all(c.params is p for c in parent.children)  # the engine reads n as the beams
    beams = [BeamSequence([4, 5], "de", "length", score=-1.0), BeamSequence([6, 0], "f", "stop", 0, -1.5)]
    parent.add(RequestOutputDelta("r-2", [], "", True, "length", num_prompt_tokens=3, num_output_tokens=4,
                                  num_cached_tokens=2, beams=beams))
    a, b = parent.children[2:]
    assert (a.token_ids, a.text, a.finish_reason, a.num_output_tokens) == ([4, 5], "de", "length", 2)
    assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == ([6, 0], "f", "stop", 0)
    assert a.finished and b.finished and a.num_cached_tokens == 2 and not parent.finished
    plain = _delta("r-0", [1], "a")
    assert parent.split(parent.children[0], plain) == [(parent.children[0], plain)]


def test_logprobs_are_kept_only_when_asked_for():
    parent = ParentRequest("r", 1, SamplingParams())
    parent.add(_delta("r-0", [1], "a", logprobs=[TokenLogprob(1, -1.0, 1)]))
    assert parent.children[0].logprobs is None


def test_a_delta_of_another_request_is_refused():
    with pytest.raises(KeyError):
        ParentRequest("r", 1, SamplingParams()).add(_delta("q-0", [1], "a"))


# -- EngineCore: what the core process reads and resets ---------------------------
class _Tokenizer:
    def decode(self, ids, **kw):
        return "".join(chr(97 + i % 26) for i in ids)


class _Out:
    """A step's output (engine.core.StepOutput): the tokens sampled, nothing else."""

    def __init__(self, sampled):
        self.sampled_token_ids, self.logprobs = sampled, {}
        self.spec_token_ids, self.prompt_logprobs, self.expert_stats, self.kv_connector_output = {}, {}, None, None


class _Runner:
    """Samples token 7 for every request that reached the end of its known tokens."""

    def __init__(self, scheduler):
        self.s = scheduler

    def execute(self, out):
        reqs = self.s.requests
        return _Out({rid: [7] for rid in out.num_scheduled_tokens
                     if reqs[rid].num_computed_tokens >= reqs[rid].num_tokens})


def _engine():
    s = make_scheduler(num_blocks=10, block_size=4)
    return EngineCore(s, _Runner(s), _Tokenizer(), eos_token_id=0, vocab_size=100)


def _run(engine, rid, prompt):
    engine.add_request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    out = []
    while engine.has_unfinished_requests():
        out += engine.step()
    return out


def test_engine_core_reports_its_kv_pool_and_counts_from_a_reset():
    engine = _engine()
    assert (engine.num_kv_blocks, engine.block_size) == (10, 4)
    prompt = list(range(1, 10))
    deltas = _run(engine, "warm", prompt)
    assert deltas[-1].finished and "".join(d.new_text for d in deltas) == "hh"
    assert engine.stats().prefix_queries == 9
    assert engine.reset_prefix_cache()
    engine.reset_stats()
    budget = engine.step_token_budget
    assert engine.stats() == engine.last_stats == StepStats(token_budget=budget)
    _run(engine, "a", prompt)
    _run(engine, "b", prompt)  # hits the two full blocks "a" left in the cache
    stats = engine.stats()
    assert stats.prefix_queries == 18 and stats.prefix_hits == 8


def test_engine_core_reset_prefix_cache_refuses_while_blocks_are_held():
    engine = _engine()
    engine.add_request("a", list(range(1, 10)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert engine.reset_prefix_cache() is False
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() is True
