"""Speculative decoding with a draft model: config resolution and checks,
and generations equal to plain decoding under greedy sampling (the target
drafting for itself accepts every draft, which proves the bookkeeping of
the draft's K/V), lossless sampling with the draft's q."""

import numpy as np
import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.config.compose import ConfigError, resolve
from appliance.sampling_params import SamplingParams as Params
from appliance.worker.sampler import SampleRequest, _probs, verify_drafts
from tests.unit.test_spec_decode import REPEATING, _chi2_pvalue, _equal

BASE = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05"]
SELF = ["speculative=draft_model", "speculative.draft_model=tiny_random", "speculative.num_speculative_tokens=3",
        "speculative.disable_by_batch_size=null"]
OTHER = ["speculative=draft_model", "speculative.draft_model=tiny_random_draft", "speculative.num_speculative_tokens=3",
         "speculative.disable_by_batch_size=null"]


def test_the_draft_resolves_and_is_checked():
    from appliance.config.draft import draft_model_config

    cfg = resolve(BASE + OTHER).cfg
    draft, problems = draft_model_config(cfg)
    assert not problems and draft.num_layers == 1 and draft.vocab_size == cfg.model.vocab_size
    with pytest.raises(ConfigError, match="has a vocabulary of 49152 tokens and the target 512"):
        resolve(BASE + ["speculative=draft_model", "speculative.draft_model=smollm2_135m"])
    with pytest.raises(ConfigError, match="speculative.draft_model=nope is neither a model option"):
        resolve(BASE + ["speculative=draft_model", "speculative.draft_model=nope"])
    with pytest.raises(ConfigError, match="speculative.method=draft_model needs speculative.draft_model"):
        resolve(BASE + ["speculative=draft_model", "speculative.draft_model=null"])
    with pytest.raises(ConfigError, match="prompt_lookup_min=2 has no effect with speculative=draft_model"):
        resolve(BASE + OTHER + ["speculative.prompt_lookup_min=2"])


def test_the_plan_counts_the_draft():
    from appliance.config.plan import make_plan

    plain = make_plan(resolve(BASE).cfg)
    spec = make_plan(resolve(BASE + OTHER).cfg)
    assert spec.weight_bytes_total > plain.weight_bytes_total
    assert spec.kv_bytes_per_token > plain.kv_bytes_per_token  # a block holds both models' K/V
    assert spec.num_kv_blocks < plain.num_kv_blocks
    assert "draft_model tiny_random_draft" in spec.speculative


def test_the_plan_puts_the_whole_draft_on_every_tensor_parallel_rank():
    """Each rank holds the target's share and the whole draft, weights and K/V."""
    from appliance.config.memory import draft_weight_bytes, kv_bytes_per_token
    from appliance.config.plan import make_plan

    one = resolve(BASE + OTHER + ["hardware.num_devices=2"]).cfg
    two = resolve(BASE + OTHER + ["hardware.num_devices=2", "parallel=tp2"]).cfg
    draft_w = draft_weight_bytes(two, "float32")
    assert draft_w > 0
    p1, p2 = make_plan(one), make_plan(two)
    assert p2.weight_bytes_per_device == (p1.weight_bytes_total - draft_w) // 2 + draft_w
    target_kv = kv_bytes_per_token(resolve(BASE + ["parallel=tp2"]).cfg, "float32")
    draft_kv = kv_bytes_per_token(one, "float32") - kv_bytes_per_token(resolve(BASE).cfg, "float32")
    assert kv_bytes_per_token(two, "float32") == target_kv + draft_kv


@pytest.fixture(scope="module")
def plain():
    return LLM(overrides=BASE)


def test_the_target_drafting_for_itself_accepts_every_draft(plain):
    llm = LLM(overrides=BASE + SELF)
    p = SamplingParams(max_tokens=40, temperature=0, logprobs=2, ignore_eos=True)
    _equal(plain.generate(REPEATING, p, use_tqdm=False), llm.generate(REPEATING, p, use_tqdm=False))
    s = llm.engine.stats()
    assert s.spec_drafts > 0 and s.spec_accepted_tokens == s.spec_draft_tokens


@pytest.mark.parametrize("scenario", [
    [],
    ["scheduler.max_num_batched_tokens=16", "scheduler.max_itl_ratio=null"],  # chunked prefill
    ["cache.block_size=4", "cache.num_blocks=30", "cache.kv_cache_memory_gib=null"],  # preemption
])
def test_another_draft_gives_the_targets_greedy_tokens(scenario):
    p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = REPEATING + [REPEATING[0] + " five six"]
    ref = LLM(overrides=BASE + scenario).generate(prompts, p, use_tqdm=False)
    llm = LLM(overrides=BASE + OTHER + scenario)
    _equal(ref, llm.generate(prompts, p, use_tqdm=False))
    assert llm.engine.stats().spec_drafts > 0


def test_rejection_with_a_draft_distribution_is_lossless():
    params = Params(temperature=1.0)
    g = torch.Generator().manual_seed(3)
    target = torch.randn(2, 8, generator=g)
    draft = torch.randn(8, generator=g)
    q = _probs(draft, params)
    p0 = _probs(target[0].clone(), params).numpy()
    rows = [SampleRequest(params, [1], [], None, ())] * 2
    first = np.zeros(8)
    for _ in range(20000):
        d = int(torch.multinomial(q, 1, generator=g))
        emitted, _ = verify_drafts(target, rows, [d], g, q[None])
        first[emitted[0]] += 1
    assert _chi2_pvalue(first, p0) > 1e-6


def test_sampled_draft_requests_run_and_seeded_ones_repeat(plain):
    llm = LLM(overrides=BASE + OTHER)
    p = SamplingParams(max_tokens=16, temperature=0.9, seed=7, ignore_eos=True)
    a = llm.generate([REPEATING[1]], p, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(REPEATING[:3], [SamplingParams(max_tokens=16, temperature=1.0)] + [p] * 2, use_tqdm=False)
    assert b[1].outputs[0].token_ids == a and len(a) == 16


def test_the_draft_runs_at_its_own_dtype(plain):
    from appliance.config.plan import make_plan

    own = make_plan(resolve(BASE + OTHER + ["speculative.draft_dtype=bfloat16"]).cfg)
    same = make_plan(resolve(BASE + OTHER).cfg)
    assert own.weight_bytes_total < same.weight_bytes_total and own.kv_bytes_per_token < same.kv_bytes_per_token
    assert "at bfloat16" in own.speculative
    llm = LLM(overrides=BASE + OTHER + ["speculative.draft_dtype=bfloat16"])
    proposer = llm.engine.runner.proposer
    assert proposer.kv_caches[0].dtype == torch.bfloat16 and llm.engine.runner.kv_caches[0].dtype == torch.float32
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    _equal(plain.generate(REPEATING, p, use_tqdm=False), llm.generate(REPEATING, p, use_tqdm=False))
    with pytest.raises(ConfigError, match="speculative.draft_dtype=float16 is not supported by hardware=cpu"):
        resolve(BASE + OTHER + ["speculative.draft_dtype=float16"])
    with pytest.raises(ConfigError, match="speculative.draft_dtype=bfloat16 has no effect with speculative=ngram"):
        resolve(BASE + ["speculative=ngram", "speculative.draft_dtype=bfloat16"])


def test_a_draft_behind_catches_up_within_the_token_cap(plain):
    """Drafting off while three requests run, the draft falls behind; once one
    runs alone it catches up over several steps, no forward past the step's
    token cap, and the output stays the target's."""
    cap = ["scheduler.max_num_batched_tokens=16", "scheduler.max_itl_ratio=null"]
    llm = LLM(overrides=BASE + OTHER[:3] + ["speculative.disable_by_batch_size=1"] + cap)
    proposer = llm.engine.runner.proposer
    sizes, orig = [], proposer._run
    proposer._run = lambda runner, states, starts, tokens, want: (sizes.append(sum(map(len, tokens))),
                                                                  orig(runner, states, starts, tokens, want))[1]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 4, 4)]
    got = llm.generate(REPEATING[:3], params, use_tqdm=False)
    ref = LLM(overrides=BASE + cap).generate(REPEATING[:3], params, use_tqdm=False)
    _equal(ref, got)
    assert llm.engine.stats().spec_drafts > 0 and sizes and max(sizes) <= 16
    assert sum(1 for n in sizes if n == 16) >= 2  # the prompt and outputs took more than one forward
