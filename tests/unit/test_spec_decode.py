"""Speculative decoding with n-gram drafts: the proposer, the rejection
sampler (lossless: the emitted tokens are distributed as without drafts),
and whole generations equal to plain decoding under greedy sampling over
chunked prefill, prefix hits, preemption, stop strings and max_tokens."""

import numpy as np
import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.sampling_params import SamplingParams as Params
from appliance.worker.sampler import SampleRequest, verify_drafts
from appliance.worker.spec_decode import NgramProposer, ngram_draft

BASE = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05"]
SPEC = ["speculative=ngram", "speculative.num_speculative_tokens=4", "speculative.disable_by_batch_size=null"]
# Prompts whose continuations repeat them (the tiny random model loops), and some that do not.
REPEATING = ["one two three four one two three four one two three four one two",
             "the cat sat on the mat and the cat sat on the mat and the cat",
             "a b c d e f a b c d e f a b c d e f a b c",
             "Hello", "Why is the sky blue? Because", "x = x + 1; y = y + 1; x = x + 1; y = y +"]


@pytest.mark.parametrize("context,k,lo,hi,want", [
    ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),  # the suffix [2, 3] occurred at 1; what followed it
    ([1, 2, 3, 4, 2, 3], 1, 2, 3, [4]),
    ([1, 2, 3, 4, 5, 6], 4, 1, 3, []),  # 6 never occurred before
    ([1, 2, 3, 4, 2, 3], 4, 3, 3, []),  # [4, 2, 3] never occurred before
    ([7, 1, 2, 9, 5, 1, 2, 8, 1, 2], 2, 2, 2, [9, 5]),  # ties: the earliest occurrence
    ([5, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 2, 3, [8, 1]),  # the longest suffix wins over an earlier shorter one
    ([3], 4, 1, 5, []),
])
def test_ngram_drafts(context, k, lo, hi, want):
    assert ngram_draft(np.array(context), k, lo, hi) == want


def test_ngram_proposer_stops_drafting_at_max_model_len():
    prop = NgramProposer(4, 1, 2, max_model_len=10)
    ctx = [1, 2, 3, 1, 2, 3, 1]
    assert prop.propose(ctx) == [2, 3]  # the next step computes positions 6.. up to max_model_len - 2
    assert prop.propose(ctx + [2]) == [3]
    assert prop.propose(ctx + [2, 3]) == []
    with pytest.raises(ValueError):
        NgramProposer(0, 1, 2, 10)


def _row(params, outputs=(), seed=None):
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SampleRequest(params, [1, 2], list(outputs), gen, ())


def test_greedy_verification_accepts_the_argmax_run():
    logits = torch.full((4, 8), -5.0)
    for j, t in enumerate([3, 5, 1, 6]):  # the target's argmax at each position
        logits[j, t] = 5.0
    p = Params(temperature=0, logprobs=1)
    rows = [_row(p)] * 4
    g = torch.Generator().manual_seed(0)
    assert verify_drafts(logits, rows, [3, 5, 1], g)[0] == [3, 5, 1, 6]  # all accepted, and a bonus token
    assert verify_drafts(logits, rows, [3, 4, 1], g)[0] == [3, 5]  # the first mismatch emits the target's token
    assert verify_drafts(logits, rows, [0, 5, 1], g)[0] == [3]
    emitted, lps = verify_drafts(logits, rows, [3, 5, 1], g)
    ref = torch.log_softmax(logits, dim=-1)
    assert [lp.logprob for lp in lps] == pytest.approx([float(ref[j, t]) for j, t in enumerate(emitted)])


def test_penalties_see_the_drafts_before_each_position():
    """Row j counts drafts 0..j-1 as output: a repetition penalty there
    turns the argmax away from a token drafted earlier in the run."""
    logits = torch.zeros(3, 8)
    logits[:, 4] = 1.0
    logits[:, 5] = 0.9
    p = Params(temperature=0, repetition_penalty=2.0)
    rows = [_row(p, [9] + [4] * j) for j in range(3)]
    g = torch.Generator().manual_seed(0)
    assert verify_drafts(logits, rows, [4, 4], g)[0] == [4, 5]  # row 1 has 4 among its outputs: 0.5 < 0.9


def _chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X chi-square with ``df`` degrees of freedom: Q(df / 2, stat / 2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0  # nothing outside the support
    n = counts.sum()
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    return _chi2_sf(stat, int(keep.sum()) - 1)


@pytest.mark.parametrize("params", [Params(temperature=1.0), Params(temperature=0.7, top_k=5),
                                    Params(temperature=1.0, top_p=0.8)])
def test_rejection_sampling_is_lossless(params):
    """The first emitted token follows the target's row-0 distribution,
    and given the first draft accepted, the second follows row 1's: as if
    sampled one by one (chi-square, p > 1e-6, so the test cannot flake)."""
    from appliance.worker.sampler import _probs

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 8, generator=g) * 1.5
    rows = [_row(params)] * 3
    p0, p1 = (_probs(logits[j].clone(), params).numpy() for j in range(2))
    drafts = [int(np.argsort(p0)[-2]), int(np.argmax(p1))]  # a likely-ish first draft, the best second
    first, second = np.zeros(8), np.zeros(8)
    for _ in range(20000):
        emitted, _ = verify_drafts(logits, rows, drafts, g)
        first[emitted[0]] += 1
        if emitted[0] == drafts[0]:
            second[emitted[1]] += 1
    assert _chi2_pvalue(first, p0) > 1e-6
    assert _chi2_pvalue(second, p1) > 1e-6 and second.sum() > 1000


@pytest.fixture(scope="module")
def plain():
    return LLM(overrides=BASE)


@pytest.fixture(scope="module")
def spec():
    return LLM(overrides=BASE + SPEC)


def _equal(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text
        assert x.outputs[0].finish_reason == y.outputs[0].finish_reason
        for u, v in zip(x.outputs[0].logprobs or [], y.outputs[0].logprobs or []):
            assert v.logprob == pytest.approx(u.logprob, abs=1e-4)


def test_greedy_output_is_token_identical(plain, spec):
    p = SamplingParams(max_tokens=48, temperature=0, logprobs=2, ignore_eos=True)
    before = spec.engine.stats()
    _equal(plain.generate(REPEATING, p, use_tqdm=False), spec.generate(REPEATING, p, use_tqdm=False))
    after = spec.engine.stats()
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert accepted > 0 and after.spec_drafts > before.spec_drafts
    assert sum(after.spec_accepted_per_pos) - sum(before.spec_accepted_per_pos) == accepted


@pytest.mark.parametrize("scenario", [
    ["scheduler.max_num_batched_tokens=16", "scheduler.max_itl_ratio=null"],  # chunked prefill beside drafts
    ["cache.block_size=4", "cache.num_blocks=24", "cache.kv_cache_memory_gib=null"],  # preemption
    ["scheduler.max_num_seqs=2", "scheduler.max_num_batched_tokens=10", "scheduler.max_itl_ratio=null"],
])
def test_greedy_output_is_identical_under_pressure(scenario):
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = REPEATING + [REPEATING[0] + " five six", REPEATING[2] + " g"]  # shared prefixes: prefix-cache hits
    ref = LLM(overrides=BASE + scenario).generate(prompts, p, use_tqdm=False)
    llm = LLM(overrides=BASE + SPEC + scenario)
    _equal(ref, llm.generate(prompts, p, use_tqdm=False))
    assert llm.engine.stats().spec_accepted_tokens > 0


def test_stops_inside_an_accepted_run(plain, spec):
    """max_tokens, stop strings and stop ids that fall inside a run of
    accepted drafts end the output where plain decoding ends it."""
    free = plain.generate(REPEATING[:3], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)
    for max_tokens in (5, 6, 7, 9):
        p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        _equal(plain.generate(REPEATING[:3], p, use_tqdm=False), spec.generate(REPEATING[:3], p, use_tqdm=False))
    for out, prompt in zip(free, REPEATING[:3]):
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        for params in (SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]),
                       SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[ids[12]]),
                       SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop],
                                      include_stop_str_in_output=True)):
            _equal(plain.generate([prompt], params, use_tqdm=False), spec.generate([prompt], params, use_tqdm=False))


def test_a_seeded_request_is_the_same_alone_in_a_batch_and_without_drafts(plain):
    """n-gram drafts change nothing a seeded request emits: alone (drafting)
    and among six (above disable_by_batch_size, not drafting) and without
    speculation, the same tokens."""
    spec = LLM(overrides=BASE + ["speculative=ngram", "speculative.prompt_lookup_min=1"])  # drafts off above 4
    for seed in (19, 7, 99):  # seeds whose continuations repeat, so drafts are proposed alone
        p = SamplingParams(max_tokens=24, temperature=0.6, seed=seed)
        before = spec.engine.stats().spec_drafts
        alone = spec.generate([REPEATING[0]], p, use_tqdm=False)[0].outputs[0].token_ids
        assert spec.engine.stats().spec_drafts > before
        batch = spec.generate(REPEATING, [p] + [SamplingParams(max_tokens=24, temperature=1.0)] * (len(REPEATING) - 1),
                              use_tqdm=False)
        assert batch[0].outputs[0].token_ids == alone
        assert plain.generate([REPEATING[0]], p, use_tqdm=False)[0].outputs[0].token_ids == alone


def test_sampled_generations_follow_the_same_distribution(plain):
    """Two-sample chi-square over the sixth output token (drafts verified
    before it: the random model's sampled outputs repeat themselves), with
    and without speculation; rare tokens pooled so every cell is large."""
    spec = LLM(overrides=BASE + SPEC + ["speculative.prompt_lookup_min=1"])
    p = [SamplingParams(max_tokens=6, temperature=1.0, top_k=3, seed=s, ignore_eos=True) for s in range(800)]
    prompt = [REPEATING[2]] * len(p)
    runs = [llm.generate(prompt, p, use_tqdm=False) for llm in (plain, spec)]
    stats = spec.engine.stats()
    assert stats.spec_drafts > 200 and stats.spec_accepted_tokens > 100
    last = [[o.outputs[0].token_ids[5] for o in run] for run in runs]
    common = sorted(t for t in set(last[0]) | set(last[1]) if last[0].count(t) + last[1].count(t) >= 20)
    table = np.array([[row.count(t) for t in common] + [sum(x not in common for x in row)] for row in last], float)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    assert table.shape[1] >= 3 and _chi2_sf(stat, table.shape[1] - 1) > 1e-6


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size():
    llm = LLM(overrides=BASE + SPEC[:2] + ["speculative.disable_by_batch_size=2"])
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm.generate(REPEATING[:3], p, use_tqdm=False)  # three run to the end together
    assert llm.engine.stats().spec_drafts == 0
    llm.generate(REPEATING[:2], p, use_tqdm=False)
    assert llm.engine.stats().spec_drafts > 0


@pytest.mark.parametrize("proposer", [SPEC, ["speculative=draft_model", "speculative.draft_model=tiny_random_draft",
                                              "speculative.disable_by_batch_size=null"]])
def test_bf16_speculation_stays_close_to_plain_bf16(proposer):
    """bf16 weights and activations (every CPU: native bf16 or emulated): a
    verifying step runs more rows than a decode, whose sums round
    differently, so greedy output is held to vLLM's closeness rule."""
    from tests.model_helpers import check_logprobs_close, greedy_top_logprobs

    bf16 = BASE + ["model.dtype=bfloat16"]
    plain_llm = LLM(overrides=bf16)
    ids = [plain_llm.tokenizer.encode(p) for p in REPEATING]
    plain = greedy_top_logprobs(plain_llm, ids, 24, 5)
    spec = LLM(overrides=bf16 + proposer)
    check_logprobs_close(greedy_top_logprobs(spec, ids, 24, 5), plain, "speculative", "plain")
    assert spec.engine.stats().spec_drafts > 0
