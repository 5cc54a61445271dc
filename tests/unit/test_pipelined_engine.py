"""The engine core with steps in flight (pipeline stages, ``EngineCore._pipelined_step``):
a runner that takes up to two steps before it returns the first, standing
for two stages. Its first stage knows only the tokens the scheduler sends
(``CachedRequestData.new_token_ids``), its last samples a token that is a
function of the whole sequence, so any token out of place changes the
text. Outputs equal the one-step-at-a-time engine's, under preemption, a
failed step, and an abort; the stages really hold two steps at once, and a
request is never in two of them unless it still has prompt to compute."""

import collections
import random

import pytest

from appliance.engine.core import EngineCore
from appliance.sampling_params import SamplingParams
from tests.unit.engine_helpers import make_scheduler


def next_token(tokens):
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % 97 + 1  # never 0 (EOS)


class _Out:
    """A step's output (engine.core.StepOutput): the tokens sampled, nothing else."""

    def __init__(self, sampled):
        self.sampled_token_ids, self.logprobs = sampled, {}
        self.spec_token_ids, self.prompt_logprobs, self.expert_stats, self.kv_connector_output = {}, {}, None, None


class TwoStages:
    """``submit`` runs the first stage (its token view from the scheduler's
    output alone), ``collect`` the last (the sampling one) of the oldest
    step. ``fail(rid)``: the next step holding ``rid`` fails, once."""

    def __init__(self, in_flight=2):
        self.num_stages = 2
        self.max_batches_in_flight = in_flight  # 1: a step through both stages before the next
        self.queue = collections.deque()
        self.first: dict[str, list[int]] = {}  # the first stage's tokens per request
        self.last: dict[str, list[int]] = {}  # the sampling stage's
        self.most_in_flight = 0
        self.shared: list[set[str]] = []  # requests in a submitted step and a step still in flight
        self.failing: set[str] = set()
        self.in_flight_at_failure: list[set[str]] = []
        self.ran_alone = 0  # steps no other step was in flight with, from submit to collect
        self._alone = False

    def submit(self, so):
        held = [set(q.num_scheduled_tokens) for q, _, _ in self.queue]
        self.shared += [h & set(so.num_scheduled_tokens) for h in held]
        for rid in so.preempted_req_ids:
            assert not any(rid in h for h in held), f"{rid} was preempted with a step in flight"
        for new in so.scheduled_new_reqs:
            self.first[new.req_id] = list(new.token_ids)
        for c in so.scheduled_cached_reqs:
            self.first[c.req_id].extend(c.new_token_ids)
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        computed.update({c.req_id: c.num_computed_tokens for c in so.scheduled_cached_reqs})
        inputs = {rid: self.first[rid][computed[rid] : computed[rid] + n] for rid, n in so.num_scheduled_tokens.items()}
        for rid, ids in inputs.items():
            assert len(ids) == so.num_scheduled_tokens[rid], f"the first stage lacks tokens of {rid}"
        fail = bool(self.failing & set(so.num_scheduled_tokens))
        self.failing -= set(so.num_scheduled_tokens)
        self._alone = not self.queue
        self.queue.append((so, inputs, fail))
        self.most_in_flight = max(self.most_in_flight, len(self.queue))

    def collect(self):
        so, inputs, fail = self.queue.popleft()
        self.ran_alone += self._alone
        self._alone = False
        for new in so.scheduled_new_reqs:
            self.last[new.req_id] = list(new.token_ids)
        if fail:
            self.in_flight_at_failure = [set(q.num_scheduled_tokens) for q, _, _ in self.queue]
            raise RuntimeError("this step failed")
        sampled = {}
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        computed.update({c.req_id: c.num_computed_tokens for c in so.scheduled_cached_reqs})
        for rid, ids in inputs.items():
            tokens, start = self.last[rid], computed[rid]
            assert ids == tokens[start : start + len(ids)], f"the first stage ran other tokens of {rid}"
            if start + len(ids) >= len(tokens):
                tokens.append(next_token(tokens))
                sampled[rid] = [tokens[-1]]
        return _Out(sampled)

    def execute(self, so):
        self.submit(so)
        return self.collect()


class _Tokenizer:
    def decode(self, ids, **kw):
        return "".join(chr(97 + i % 26) for i in ids)


def engine(runner, num_blocks=64, budget=32):
    core = EngineCore(make_scheduler(num_blocks=num_blocks, block_size=4, budget=budget, max_model_len=512),
                      runner, _Tokenizer(), eos_token_id=0, vocab_size=100)
    assert core.scheduler.send_token_ids  # the first stage learns the tokens from the scheduler
    return core


def run(core, prompts, max_tokens=12, abort=None):
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    outs: dict[str, list[int]] = collections.defaultdict(list)
    finished = {}
    steps = 0
    while core.has_unfinished_requests():
        for d in core.step():
            outs[d.request_id] += d.new_token_ids
            if d.finished:
                finished[d.request_id] = d.finish_reason
        steps += 1
        if abort is not None and steps == abort[1]:
            core.abort([abort[0]])
        assert steps < 2000
    return dict(outs), finished


PROMPTS = [[rng.randrange(1, 99) for _ in range(n)]
           for rng, n in zip(map(random.Random, range(8)), [3, 17, 40, 5, 9, 70, 2, 11])]


@pytest.fixture(scope="module")
def one_at_a_time():
    return run(engine(TwoStages(in_flight=1)), PROMPTS)


def test_two_steps_in_flight_give_the_same_tokens(one_at_a_time):
    runner = TwoStages()
    core = engine(runner)
    outs, finished = run(core, PROMPTS)
    assert (outs, finished) == one_at_a_time
    assert all(len(t) == 12 for t in outs.values())
    assert runner.most_in_flight == 2
    assert not core.has_unfinished_requests() and not runner.queue


def test_a_step_is_shared_out_and_only_prompts_go_on_while_in_flight():
    runner = TwoStages()
    core = engine(runner, budget=512)
    for i in range(8):
        core.add_request(f"r{i}", [i + 1] * 4, SamplingParams(max_tokens=6, ignore_eos=True))
    core.add_request("long", list(range(1, 90)), SamplingParams(max_tokens=2, ignore_eos=True))
    core.scheduler.max_num_batched_tokens = 32  # the long prompt takes several chunks
    sizes = []
    while core.has_unfinished_requests():
        core.step()
        sizes += [len(q.num_scheduled_tokens) for q, _, _ in runner.queue]
    # only the long prompt, with prompt still to compute, was in two steps at once
    assert runner.shared and set().union(*runner.shared) == {"long"}
    assert max(sizes) <= 6  # nine requests (the long one in both) shared out over two steps, never all in one


def test_in_flight_requests_are_not_preempted(one_at_a_time):
    runner = TwoStages()
    core = engine(runner, num_blocks=24)  # too few blocks for all: requests are preempted and recomputed
    outs, finished = run(core, PROMPTS)
    assert core.scheduler.num_preemptions > 0
    assert (outs, finished) == one_at_a_time


def test_a_failed_step_with_a_later_one_in_flight_recomputes_its_requests(one_at_a_time):
    runner = TwoStages()
    core = engine(runner)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
    outs: dict[str, list[int]] = collections.defaultdict(list)
    finished = {}
    for step in range(2000):
        if step == 1:
            runner.failing = {"r5"}  # the 70-token prompt, still prefilling: in the later step too
        for d in core.step():
            outs[d.request_id] += d.new_token_ids
            if d.finished:
                finished[d.request_id] = d.finish_reason
        if not core.has_unfinished_requests():
            break
    assert not runner.failing  # it did fail, with its next chunk in the step after, in flight
    assert any("r5" in held for held in runner.in_flight_at_failure)
    assert (dict(outs), finished) == one_at_a_time


def test_an_abort_while_in_flight():
    runner = TwoStages()
    core = engine(runner)
    outs, finished = run(core, PROMPTS, abort=("r1", 3))
    assert "r1" not in finished or finished["r1"] == "abort"
    want, _ = run(engine(TwoStages(in_flight=1)), PROMPTS)
    assert {k: v for k, v in outs.items() if k != "r1"} == {k: v for k, v in want.items() if k != "r1"}
    assert core.scheduler.requests == {} and not core.scheduler.running and not runner.queue


def test_the_ranks_replies_combine_by_stage():
    from appliance.engine.interfaces import EngineDeadError
    from appliance.worker.executor import RankError, combine_replies

    def dead(why):
        raise EngineDeadError(why)

    ok, sampled = ("ok", _Out({}), None), ("ok", _Out({"a": [3]}), None)
    err = ("error", "RuntimeError: boom", RankError("traceback"))
    # tp2 x pp2: the last stage's first rank's output; the first stage sampled nothing
    assert combine_replies([ok, ok, sampled, sampled], dead, tp_size=2).sampled_token_ids == {"a": [3]}
    with pytest.raises(EngineDeadError, match="rank 3 sampled other tokens than rank 2"):
        combine_replies([ok, ok, sampled, ("ok", _Out({"a": [4]}), None)], dead, tp_size=2)
    # a stage failed and handed it on: an ordinary failed step, whose message is the first failed stage's
    with pytest.raises(RuntimeError, match="boom"):
        combine_replies([ok, ok, err, err], dead, tp_size=2)
    with pytest.raises(RuntimeError, match="boom"):
        combine_replies([err, err, err, err], dead, tp_size=2)
    with pytest.raises(EngineDeadError, match=r"failed on rank\(s\) \[1\] only"):
        combine_replies([ok, err, err, err], dead, tp_size=2)
    with pytest.raises(EngineDeadError, match=r"stage 0 failed the step \(RuntimeError: boom\) but a later stage ran it"):
        combine_replies([err, ok], dead, tp_size=1)


def test_the_ranks_kv_tier_reports_combine():
    """Each rank's KV connector report kept apart by rank; a failed step
    carries them, and whether its requests are to be recomputed (a tier
    block a rank could not read)."""
    from appliance.engine.interfaces import EngineDeadError
    from appliance.engine.kv_connector import KVConnectorOutput
    from appliance.worker.executor import RankError, StepFailed, combine_replies

    def dead(why):
        raise EngineDeadError(why)

    def out(saved, dropped=()):
        o = _Out({})
        o.kv_connector_output = KVConnectorOutput(saved=list(saved), dropped=list(dropped))
        return o

    got = combine_replies([("ok", out([b"a"]), None), ("ok", out([b"a", b"b"], [b"c"]), None)], dead, tp_size=2)
    assert [(o.saved, o.dropped) for o in got.kv_connector_output.by_rank] == [([b"a"], []), ([b"a", b"b"], [b"c"])]
    assert combine_replies([("ok", _Out({}), None)] * 2, dead, tp_size=2).kv_connector_output is None
    lost = RankError("traceback", retry_requests=True, kv_connector_output=KVConnectorOutput(dropped=[b"d"]))
    with pytest.raises(StepFailed) as e:
        combine_replies([("ok", out([b"e"]), None), ("error", "KVLoadError: unreadable", lost)], dead, tp_size=1)
    assert e.value.retry_requests and "unreadable" in str(e.value)
    assert [(o.saved, o.dropped) for o in e.value.kv_connector_output.by_rank] == [([b"e"], []), ([], [b"d"])]


def test_the_latency_objective_observes_only_steps_that_ran_alone():
    from appliance.engine.token_budget import TokenBudget

    runner = TwoStages()
    core = engine(runner)
    core.token_budget = TokenBudget(target_itl_ms=50, initial=32, cap=32)
    run(core, PROMPTS[:1], max_tokens=5)  # one request: each step alone in the pipeline
    alone = len(core.token_budget.samples)
    assert alone == 5  # its prompt's step and four decodes
    assert runner.ran_alone == 5
    run(core, PROMPTS[1:], max_tokens=5)
    assert runner.most_in_flight == 2
    assert len(core.token_budget.samples) == runner.ran_alone  # none of the steps that overlapped
