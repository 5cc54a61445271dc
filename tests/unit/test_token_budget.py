"""scheduler.target_itl_ms and scheduler.max_itl_ratio: the plan's first
token budget, the refit to measured step times, and the engine steering its
scheduler with it."""

import random

import pytest

from appliance.config.compose import resolve
from appliance.engine.token_budget import TokenBudget, attention_pairs
from appliance.errors import ConfigError
from appliance.runner import compose

BASE = ["+profile=cpu"]


def test_the_fit_finds_the_budget_that_meets_the_objective():
    # a step costs 10 ms, 0.5 ms per token: 50 ms fits 80 tokens (no attention cost here)
    tb = TokenBudget(target_itl_ms=50, initial=2048, cap=2048)
    for tokens in (4, 4, 512, 4, 300, 4):
        tb.observe(tokens, 0, 0.010 + 0.0005 * tokens)
    a, b, c = tb.fit()
    assert (a, b, c) == (pytest.approx(0.010), pytest.approx(0.0005), 0.0)
    assert tb.next_budget(decodes=0, decode_pairs=0, chunk_context=0) == 80


def test_attention_pairs_make_later_chunks_smaller():
    """Cost = 5 ms + 0.2 ms per token + 1 us per query-key pair: the chunk that
    fits 50 ms shrinks as the prompt it continues grows."""
    tb = TokenBudget(target_itl_ms=50, initial=64, cap=4096)
    for tokens, context in ((4, 100), (64, 0), (64, 1000), (128, 500), (4, 2000), (200, 3000), (32, 64)):
        pairs = attention_pairs(tokens, context + tokens)
        tb.observe(tokens, pairs, 0.005 + 0.0002 * tokens + 1e-6 * pairs)
    a, b, c = tb.fit()
    assert (a, b, c) == (pytest.approx(0.005), pytest.approx(0.0002), pytest.approx(1e-6))

    def cost(decodes, pairs, chunk, context):
        n = decodes + chunk
        return a + b * n + c * (pairs + attention_pairs(chunk, context + chunk))

    early = tb.next_budget(decodes=4, decode_pairs=400, chunk_context=0)
    late = tb.next_budget(decodes=4, decode_pairs=400, chunk_context=3000)
    assert late < early
    for budget, context in ((early, 0), (late, 3000)):
        assert cost(4, 400, budget - 4, context) <= 0.050 < cost(4, 400, budget - 3, context)


def test_attention_pairs_count_each_token_against_its_context():
    assert attention_pairs(1, 10) == 10  # a decode attends to its whole context
    assert attention_pairs(3, 3) == 3 + 2 + 1  # a 3-token prompt from scratch


def test_until_the_steps_pin_a_cost_down_the_first_estimate_holds():
    tb = TokenBudget(target_itl_ms=50, initial=300, cap=2048)
    for _ in range(10):
        tb.observe(4, 40, 0.012)  # decodes only: no per-token cost seen
    tb.observe(0, 0, 0.0)  # an empty step says nothing
    assert tb.fit() is None and tb.next_budget(4, 40, 0) == 300


def test_a_stretch_of_decodes_alone_keeps_the_last_fit():
    """Streams decoding with no prompt in sight give steps of one shape, which
    do not push out the prompt steps kept before; and once the steps kept pin
    no cost down (here, after ``forget``), the budget a prompt then gets
    comes from the last fit, not from the first estimate again."""
    tb = TokenBudget(target_itl_ms=50, initial=2048, cap=2048)
    for tokens in (1, 200, 1, 1):
        tb.observe(tokens, 0, 0.010 + 0.0005 * tokens)
    fitted = tb.next_budget(decodes=4, decode_pairs=0, chunk_context=0)
    assert fitted == 80 and tb.model == tb.fit()
    for _ in range(100):
        tb.observe(4, 400, 0.012)
    assert 200 in [t for t, _, _ in tb.samples] and len(tb.samples) <= tb.shapes * tb.per_shape
    assert tb.next_budget(decodes=4, decode_pairs=0, chunk_context=0) == fitted
    tb.forget()
    for _ in range(100):
        tb.observe(4, 400, 0.012)
    assert tb.fit() is None and tb.next_budget(decodes=4, decode_pairs=0, chunk_context=0) == fitted


def test_a_long_prompts_chunks_on_the_objective_do_not_unpin_the_costs():
    """A budget that meets its objective makes a long prompt's chunks all take
    about the objective, fewer tokens each as their context grows: steps of
    one time along a line of the costs, which alone cannot tell a token's
    cost from a pair's. The decodes and early chunks kept beside them hold
    the fit; a window of the last steps alone drifted to a step ten times
    the objective and more."""
    a, b, c = 0.007, 0.0006, 5e-7
    for seed in range(10):
        tb = TokenBudget(target_itl_ms=100, initial=312, cap=2048)
        for tokens, context in ((312, 0), (1, 313), (1, 314), (4, 160), (140, 0), (4, 170), (130, 140), (4, 180)):
            pairs = attention_pairs(tokens, context + tokens)
            tb.observe(tokens, pairs, a + b * tokens + c * pairs)
        rng, done = random.Random(seed), 270
        for _ in range(60):  # each chunk as large as the fit allows: 100 ms, give or take 6%
            budget = tb.next_budget(decodes=4, decode_pairs=700, chunk_context=done)
            chunk = budget - 4
            tb.observe(budget, 700 + attention_pairs(chunk, done + chunk), 0.1 * (1 + rng.uniform(-0.06, 0.06)))
            done += chunk
        budget = tb.next_budget(decodes=4, decode_pairs=700, chunk_context=done)
        assert a + b * budget + c * (700 + attention_pairs(budget - 4, done + budget - 4)) < 0.2, seed


def test_the_steps_kept_are_the_last_of_the_shapes_seen_last():
    tb = TokenBudget(target_itl_ms=50, initial=100, cap=4096, shapes=4, per_shape=2)
    for tokens in (1, 2, 4, 8, 16, 16, 16, 4):  # five shapes: the oldest (1 token) goes, 16 keeps its last two
        tb.observe(tokens, 0, 0.01 + 0.001 * tokens)
    assert [t for t, _, _ in tb.samples] == [2, 4, 8, 16, 16, 4]


def test_the_budget_never_drops_below_the_running_decodes_plus_one():
    tb = TokenBudget(target_itl_ms=50, initial=300, cap=2048)
    tb.budget = 1  # as a stalled step with nothing but a prompt may leave it
    assert tb.next_budget(8, 80, 0) == 9


def test_a_budget_every_step_fills_exactly_grows_until_the_fit_returns():
    """Steps of exactly the budget's size cannot tell the cost per token:
    the budget doubles until they can, then the fit decides."""
    tb = TokenBudget(target_itl_ms=50, initial=1, cap=2048)
    for _ in range(4):
        tb.observe(1, 1, 0.010)
    assert tb.fit() is None and tb.next_budget(0, 0, 0) == 2
    for tokens in (2, 2):
        tb.observe(tokens, 0, 0.010 + 0.0005 * tokens)
    assert tb.fit() is not None and tb.next_budget(0, 0, 0) > 2


@pytest.mark.parametrize("target_ms,expected", [(1, 17), (10_000, 1024)])
def test_the_budget_stays_between_the_decodes_and_the_cap(target_ms, expected):
    """At least every running decode plus one prefill token; at most the cap."""
    tb = TokenBudget(target_itl_ms=target_ms, initial=100, cap=1024, min_prefill_share=0.0)
    for tokens in (16, 200, 16, 400, 16):
        tb.observe(tokens, 0, 0.020 + 0.001 * tokens)
    assert tb.next_budget(16, 1600, 0) == expected


@pytest.mark.parametrize("share,chunk", [(0.5, 36), (0.25, 12), (0.0, 1)])
def test_decodes_that_overrun_the_objective_leave_a_prompt_its_share(share, chunk):
    """16 decodes alone take 36 ms against a 10 ms objective: the step is
    missed anyway, and a waiting prompt still gets ``share`` of it (the step
    lasts 36 ms / (1 - share)) instead of one token a step."""
    tb = TokenBudget(target_itl_ms=10, initial=100, cap=1024, min_prefill_share=share)
    for tokens in (16, 200, 16, 400, 16):
        tb.observe(tokens, 0, 0.020 + 0.001 * tokens)
    budget = tb.next_budget(16, 1600, 0)
    assert budget == 16 + chunk
    step = 0.020 + 0.001 * budget
    assert (budget - 16) * 0.001 <= max(0.001, share * step) + 1e-9  # one token a step at the least


def test_the_share_lengthens_a_step_only_where_the_objective_leaves_a_prompt_less():
    """12 ms of decodes leave a prompt 38 of the objective's 50 ms: the objective decides at a share of 0 or 0.5;
    at 0.9 the prompt's share (108 ms beside them) lengthens the step."""
    budgets = []
    for share in (0.0, 0.5, 0.9):
        tb = TokenBudget(target_itl_ms=50, initial=100, cap=1024, min_prefill_share=share)
        for tokens in (4, 200, 4, 400, 4):
            tb.observe(tokens, 0, 0.010 + 0.0005 * tokens)
        budgets.append(tb.next_budget(4, 40, 0))
    assert budgets[0] == budgets[1] == 80 and budgets[2] > 80  # at 0.9, 12 ms of decodes allow a 120 ms step


@pytest.mark.parametrize("target_ms,ratio,budget", [(200, None, 380), (200, 5.0, 100), (200, 20.0, 380),
                                                     (None, 5.0, 100), (None, 20.0, 460)])
def test_a_ratio_holds_a_step_to_a_multiple_of_the_decodes_time(target_ms, ratio, budget):
    """4 decodes take 12 ms and a token 0.5 ms: a 200 ms objective leaves a prompt 376 tokens; at most 5x the
    decodes' time (60 ms) leaves it 96, with the objective or alone; 20x (240 ms) is past the objective and
    changes nothing beside it, and alone leaves the prompt 456."""
    tb = TokenBudget(target_itl_ms=target_ms, initial=100, cap=1024, max_itl_ratio=ratio)
    for tokens in (4, 200, 4, 400, 4):
        tb.observe(tokens, 0, 0.010 + 0.0005 * tokens)
    assert tb.next_budget(4, 40, 0) == budget


def test_the_decodes_time_is_what_their_own_steps_took():
    """The line through the steps says 4 decodes take 12 ms; their last decode-only steps took 20 ms: the ratio
    multiplies those (a 100 ms step, 80 ms of it the prompt's); forgotten with the steps kept."""
    tb = TokenBudget(target_itl_ms=None, initial=100, cap=1024, max_itl_ratio=5.0)
    for tokens in (200, 400, 100, 300):
        tb.observe(tokens, 0, 0.010 + 0.0005 * tokens)
    assert tb.next_budget(4, 40, 0) == 4 + 96
    for seconds in (0.019, 0.020, 0.021):
        tb.observe(4, 0, seconds, decodes_only=True)
    assert tb.model is not None
    a, b, c = tb.model  # the slow decodes moved the line too
    assert c == 0 and a + 4 * b < 0.0195  # below the decodes' own 20 ms
    assert tb.next_budget(4, 0, 0) == 4 + int(0.080 / b + 1e-6)  # 5 x 20 ms, 20 of them the decodes'
    assert tb.next_budget(8, 0, 0) == 8 + int(4 * (a + 8 * b) / b + 1e-6)  # 8 decodes: none measured, the line's
    tb.forget()
    assert tb.next_budget(4, 0, 0) == 4 + int(4 * (a + 4 * b) / b + 1e-6)  # the last fit's again


def test_a_step_is_the_decodes_own_when_every_request_in_it_decodes():
    from types import SimpleNamespace

    tb = TokenBudget(target_itl_ms=None, initial=100, cap=1024, max_itl_ratio=5.0)
    decoding = {"a": SimpleNamespace(num_computed_tokens=9, num_tokens=10),
                "b": SimpleNamespace(num_computed_tokens=4, num_tokens=5)}
    prefilling = {**decoding, "c": SimpleNamespace(num_computed_tokens=0, num_tokens=30)}
    tb.observe_step(SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2),
                    decoding, 0.010)
    tb.observe_step(SimpleNamespace(num_scheduled_tokens={"a": 1, "c": 1}, total_num_scheduled_tokens=2),
                    prefilling, 0.030)
    assert list(tb._decode_steps[2]) == [0.010]


def test_an_objective_is_needed():
    with pytest.raises(ValueError, match="needs an objective"):
        TokenBudget(target_itl_ms=None, initial=100, cap=1024)


def test_a_ratio_never_takes_a_prompt_below_its_share():
    tb = TokenBudget(target_itl_ms=10, initial=100, cap=1024, min_prefill_share=0.5, max_itl_ratio=2.0)
    for tokens in (16, 200, 16, 400, 16):
        tb.observe(tokens, 0, 0.020 + 0.001 * tokens)
    assert tb.next_budget(16, 1600, 0) == 16 + 36  # 36 ms of decodes, 36 of the prompt: its share, the ratio's 2x
    with pytest.raises(ValueError, match="at least 1 / \\(1 - share\\) = 2"):
        TokenBudget(target_itl_ms=10, initial=100, cap=1024, min_prefill_share=0.5, max_itl_ratio=1.9)


@pytest.mark.parametrize("share", [-0.1, 1.0])
def test_a_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match="share"):
        TokenBudget(target_itl_ms=50, initial=10, cap=100, min_prefill_share=share)


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="cap"):
        TokenBudget(target_itl_ms=50, initial=10, cap=0)


def test_the_plan_derives_the_first_budget_from_the_prefill_roofline():
    fixed = compose(resolve(BASE + ["scheduler.max_itl_ratio=null"]), here=False).plan
    assert fixed.token_budget == 2048 and fixed.token_budget_reason == "scheduler.max_num_batched_tokens"
    p = compose(resolve(BASE + ["scheduler.max_itl_ratio=null", "scheduler.target_itl_ms=100"]), here=False).plan
    assert p.token_budget == max(1, min(2048, int(0.1 * p.prefill_roofline_tok_s)))
    assert "target_itl_ms=100 at the" in p.token_budget_reason and "at most 2048" in p.token_budget_reason


@pytest.mark.parametrize("override,message", [
    ("scheduler.target_itl_ms=0", "must be positive"),
    ("scheduler.enable_chunked_prefill=false", "needs scheduler.enable_chunked_prefill=true"),
    ("scheduler.min_prefill_share=1.0", r"must be in \[0, 1\)"),
    ("scheduler.min_prefill_share=-0.5", r"must be in \[0, 1\)"),
    ("scheduler.max_itl_ratio=1.5", r"less than scheduler.min_prefill_share=0.5 of a step: it must be at least "
                                    r"1 / \(1 - min_prefill_share\) = 2"),
])
def test_impossible_objectives_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        resolve(BASE + ["scheduler.target_itl_ms=50", "model.max_model_len=2048", override])


def test_a_prefill_share_without_an_objective_is_refused():
    with pytest.raises(ConfigError, match="has an effect only with an objective"):
        resolve(BASE + ["scheduler.max_itl_ratio=null", "scheduler.min_prefill_share=0.2"])
    assert "gets at least 20% of each step" in compose(resolve(BASE + ["scheduler.min_prefill_share=0.2"]),
                                              here=False).plan.token_budget_reason


def test_the_plan_estimates_a_ratio_from_the_decode_roofline():
    p = compose(resolve(BASE), here=False).plan  # the CPU profiles: at most 8x the decodes' own step
    assert p.token_budget == max(1, min(2048, int(8 / p.decode_roofline_tok_s * p.prefill_roofline_tok_s)))
    assert "first estimate for scheduler.max_itl_ratio=8 (8x a decode step at the" in p.token_budget_reason
    both = compose(resolve(BASE + ["scheduler.target_itl_ms=1000", "scheduler.max_itl_ratio=8"]), here=False).plan
    assert both.token_budget == p.token_budget  # the smaller of the two
    assert "scheduler.target_itl_ms=1000 and scheduler.max_itl_ratio=8" in both.token_budget_reason
    assert compose(resolve(BASE + ["scheduler.target_itl_ms=null", "scheduler.max_itl_ratio=4",
                                   "scheduler.min_prefill_share=0.75"]), here=False).plan.token_budget < p.token_budget


def test_with_no_stream_decoding_a_prompt_prefills_at_the_cap():
    """The objective is the running streams' inter-token gap: a prompt alone
    (or prompts with no stream decoding) takes the whole cap per step."""
    from appliance import LLM, SamplingParams

    # no share for the prompt: the objective alone holds its chunks back beside a decode (10 us: no step of
    # the tiny model meets it however fast this host runs it)
    llm = LLM(overrides=BASE + ["model=tiny_random", "scheduler.target_itl_ms=0.01", "scheduler.min_prefill_share=0",
                                "scheduler.max_num_batched_tokens=256"])
    engine = llm.engine
    engine.add_request("long", [5 + i % 400 for i in range(600)], SamplingParams(max_tokens=2, ignore_eos=True))
    scheduled = []
    while engine.has_unfinished_requests():
        engine.step()
        scheduled.append(engine.step_token_budget)
    assert scheduled[:2] == [256, 256]  # the prompt's chunks, nothing decoding beside them
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # "a" prefills alone, then decodes
    engine.add_request("b", [5 + i % 400 for i in range(600)], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()
    # "a" decodes: the objective's budget holds "b"'s chunks back
    assert engine.step_token_budget == engine.token_budget.budget < 256


def test_the_engine_steers_its_scheduler_by_measured_steps():
    from appliance import LLM, SamplingParams

    llm = LLM(overrides=BASE + ["model=tiny_random", "scheduler.target_itl_ms=5", "scheduler.max_itl_ratio=null",
                                "scheduler.max_num_seqs=4"])
    engine = llm.engine
    plan = llm.deployment.plan
    assert engine.step_token_budget == engine.scheduler.max_num_batched_tokens == plan.token_budget
    llm.generate([[5 + i % 400 for i in range(n)] for n in (300, 20, 700, 9)], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    tb = engine.token_budget
    assert len(tb.samples) > tb.MIN_SAMPLES and tb.fit() is not None  # prefill chunks and decodes were timed
    assert engine.step_token_budget == tb.budget and 1 <= tb.budget <= 2048
    assert engine.scheduler.max_num_batched_tokens == plan.token_budget  # the configured one stays as it was
    assert engine.stats().token_budget == tb.budget


def test_the_servers_warm_up_gives_the_budget_its_first_fit():
    """The first estimate rests on the prefill roofline (it errs large, and
    the first prompt beside running streams would take it): the warm-up
    prefills a prompt of that size alone and decodes it, so the budget has a
    fit from measured steps before the first request; nothing stays cached."""
    from appliance import LLM
    from appliance.server.core_proc import _warm_up

    llm = LLM(overrides=BASE + ["model=tiny_random", "scheduler.target_itl_ms=50", "scheduler.max_itl_ratio=null"])
    engine, tb = llm.engine, llm.engine.token_budget
    first, free = tb.budget, engine.scheduler.kv.num_free_blocks
    assert tb.model is None and first == llm.deployment.plan.token_budget
    _warm_up(engine, llm.tokenizer)
    assert tb.model is not None and tb.model[1] > 0
    # the calibration prompt in one step (here the model's length caps it, with room for its decodes), then its decodes
    assert first > engine.scheduler.max_model_len
    assert [t for t, _, _ in tb.samples][:2] == [engine.scheduler.max_model_len - tb.MIN_SAMPLES - 1, 1]
    assert not engine.has_unfinished_requests() and engine.scheduler.kv.num_free_blocks == free
    # the core sizes the calibration prompt and drops the steps kept (here the model's length caps it)
    assert engine.begin_budget_calibration() == engine.scheduler.max_model_len - tb.MIN_SAMPLES - 1
    assert tb.samples == [] and tb.model is not None  # the fit stays until new steps give another


def test_no_objective_no_budget_calibration():
    from appliance import LLM

    llm = LLM(overrides=BASE + ["model=tiny_random", "scheduler.max_itl_ratio=null"])
    assert llm.engine.token_budget is None and llm.engine.begin_budget_calibration() is None
