"""scheduler.target_itl_ms: the plan's first token budget, the refit to
measured step times, and the engine steering its scheduler with it."""

import pytest

from appliance.config.compose import resolve
from appliance.engine.token_budget import TokenBudget
from appliance.errors import ConfigError
from appliance.runner import compose

BASE = ["+profile=cpu"]


def test_the_fit_finds_the_budget_that_meets_the_objective():
    # a step costs 10 ms plus 0.5 ms per token: 50 ms fits 80 tokens
    tb = TokenBudget(target_itl_ms=50, initial=2048, floor=8, cap=2048)
    for tokens in (4, 4, 512, 4, 300, 4):
        budget = tb.observe(tokens, 0.010 + 0.0005 * tokens)
    assert budget == 80
    a, b = tb.fit()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.0005)


def test_until_the_steps_pin_a_cost_down_the_first_estimate_holds():
    tb = TokenBudget(target_itl_ms=50, initial=300, floor=8, cap=2048)
    assert [tb.observe(4, 0.012) for _ in range(10)] == [300] * 10  # decodes only: no per-token cost seen
    tb.observe(0, 0.0)  # an empty step says nothing
    assert tb.fit() is None and tb.budget == 300


@pytest.mark.parametrize("target_ms,expected", [(1, 16), (10_000, 1024)])
def test_the_budget_stays_between_the_decodes_and_the_cap(target_ms, expected):
    tb = TokenBudget(target_itl_ms=target_ms, initial=100, floor=16, cap=1024)
    for tokens in (16, 200, 16, 400, 16):
        budget = tb.observe(tokens, 0.020 + 0.001 * tokens)
    assert budget == expected


def test_a_floor_above_the_cap_is_refused():
    with pytest.raises(ValueError, match="floor"):
        TokenBudget(target_itl_ms=50, initial=10, floor=64, cap=32)


def test_the_plan_derives_the_first_budget_from_the_prefill_roofline():
    fixed = compose(resolve(BASE), here=False).plan
    assert fixed.token_budget == 2048 and fixed.token_budget_reason == "scheduler.max_num_batched_tokens"
    p = compose(resolve(BASE + ["scheduler.target_itl_ms=100"]), here=False).plan
    assert p.token_budget == max(p.token_budget_floor, min(2048, int(0.1 * p.prefill_roofline_tok_s)))
    assert "target_itl_ms=100" in p.token_budget_reason and p.token_budget_floor == 64  # the cpu profile's max_num_seqs


@pytest.mark.parametrize("override,message", [
    ("scheduler.target_itl_ms=0", "must be positive"),
    ("scheduler.enable_chunked_prefill=false", "needs scheduler.enable_chunked_prefill=true"),
])
def test_impossible_objectives_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        resolve(BASE + ["scheduler.target_itl_ms=50", "model.max_model_len=2048", override])


def test_the_engine_steers_its_scheduler_by_measured_steps():
    from appliance import LLM, SamplingParams

    llm = LLM(overrides=BASE + ["model=tiny_random", "scheduler.target_itl_ms=5", "scheduler.max_num_seqs=4"])
    engine = llm.engine
    plan = llm.deployment.plan
    assert engine.scheduler.max_num_batched_tokens == plan.token_budget
    llm.generate([[5 + i % 400 for i in range(n)] for n in (300, 20, 700, 9)], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    tb = engine.token_budget
    assert len(tb.samples) > tb.MIN_SAMPLES and tb.fit() is not None  # prefill chunks and decodes were timed
    assert engine.scheduler.max_num_batched_tokens == tb.budget and 4 <= tb.budget <= 2048
    assert engine.stats().token_budget == tb.budget
