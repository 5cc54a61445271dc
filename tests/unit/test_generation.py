"""Model execution: token-exact parity with Hugging Face transformers,
sampling, stop conditions, logprobs, n > 1."""

import functools

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.sampling_params import resolve_bad_words
from tests.model_helpers import (PROMPTS, TINY_VARIANTS, check_logprobs_close, greedy_top_logprobs, hf_greedy,
                                 hf_greedy_top_logprobs, hf_logprobs)

MAX_NEW = 12
BASE = ["+profile=cpu", "model=tiny_random"]

SCENARIOS = {
    "default": [],
    "chunked_prefill": ["scheduler.max_num_batched_tokens=16", "scheduler.max_num_seqs=4"],
    # Block size 4 and 32 blocks: the 9 prompts cannot all stay resident, so requests get preempted (the
    # longest prompt fits in both KV-cache groups of a model with sliding layers).
    "preemption": ["cache.block_size=4", "cache.num_blocks=32", "scheduler.max_num_batched_tokens=64"],
    "prefix_cache": ["cache.block_size=4"],
}


# qwen2_window's two KV-cache groups meet HF through gemma2 and gemma3 (two groups too); its own are checked
# through the native whole-step forward (test_cpu_native) and over ranks and stages (test_tensor_parallel)
@pytest.fixture(scope="module", params=[v for v in TINY_VARIANTS if v != "qwen2_window"])
def variant(request):
    return request.param


def _greedy(llm, prompts, **kw):
    ids = [llm.tokenizer.encode(p) for p in prompts]
    outs = llm.generate(ids, SamplingParams(max_tokens=MAX_NEW, temperature=0, **kw), use_tqdm=False)
    return ids, [o.outputs[0].token_ids for o in outs], outs


@pytest.mark.parametrize("backend", ["cpu_native", "torch_sdpa"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_hf_token_for_token(variant, scenario, backend):
    llm = LLM(overrides=BASE + TINY_VARIANTS[variant] + SCENARIOS[scenario] + [f"attention.backend={backend}"])
    assert llm.engine.runner.backend.name == backend
    prompts = PROMPTS
    if scenario == "prefix_cache":
        system = "A scheduler hands out tokens under one budget every step. "
        prompts = [system + p for p in PROMPTS]
    ids, got, outs = _greedy(llm, prompts)
    for p_ids, g in zip(ids, got):
        assert g == hf_greedy(llm, p_ids, MAX_NEW)
    stats = llm.engine.scheduler
    if scenario == "preemption":
        assert stats.num_preemptions > 0
    if scenario == "prefix_cache":
        assert llm.engine.scheduler.kv.stats.hits > 0
        assert max(o.num_cached_tokens for o in outs) >= 8
    assert llm.engine.scheduler.kv.pool.num_free_blocks == llm.engine.scheduler.kv.pool.num_blocks - 1


@pytest.mark.parametrize("backend", ["cpu_native", "torch_sdpa"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_bf16_greedy_is_close_to_hf_bf16(variant, scenario, backend):
    """bf16 on every host (slow without native bf16, but correct), compared
    with HF in bf16 the way vLLM's tests compare reduced precision."""
    llm = LLM(overrides=BASE + TINY_VARIANTS[variant] + SCENARIOS[scenario]
              + ["model.dtype=bfloat16", f"attention.backend={backend}"])
    assert llm.engine.runner.backend.name == backend and llm.execution.dtype == "bfloat16"
    prompts = PROMPTS if scenario != "prefix_cache" else ["A scheduler hands out tokens. " + p for p in PROMPTS]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    ours = greedy_top_logprobs(llm, ids, MAX_NEW, 5)
    ref = [hf_greedy_top_logprobs(llm, p, MAX_NEW, 5, torch.bfloat16) for p in ids]
    check_logprobs_close(ours, ref)
    if scenario == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv.pool.num_free_blocks == llm.engine.scheduler.kv.pool.num_blocks - 1


@pytest.fixture(scope="module")
def tiny():
    return LLM(overrides=BASE)


def test_seeded_sampling_is_batch_invariant(tiny):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = tiny.generate(PROMPTS[2], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=10, temperature=0.8, seed=i, ignore_eos=True) for i in range(15)]
    batch = tiny.generate([PROMPTS[i % len(PROMPTS)] for i in range(15)] + [PROMPTS[2]], others + [p], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    unseeded = tiny.generate([PROMPTS[2]] * 2, SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 10 for o in unseeded)


def test_logprobs_match_hf_log_softmax(tiny):
    ids = tiny.tokenizer.encode(PROMPTS[3])
    out = tiny.generate([ids], SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    c = out.outputs[0]
    ref = hf_logprobs(tiny, ids + c.token_ids)
    for step, lp in enumerate(c.logprobs):
        row = ref[len(ids) - 1 + step]
        assert lp.token_id == c.token_ids[step] and lp.rank == 1
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        top = torch.topk(row, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        for (_, v), ref_v in zip(lp.top, top.values.tolist()):
            assert v == pytest.approx(ref_v, abs=1e-4)


def test_stop_strings_cut_text_across_token_boundaries(tiny):
    base = tiny.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]  # likely spans a token boundary
    out = tiny.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.find(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop  # vLLM's: the string matched
    inc = tiny.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop],
                                                   include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert inc.text == text[: text.find(stop) + len(stop)]


def test_min_tokens_ignore_eos_and_stop_token_ids(tiny):
    eos = tiny.tokenizer.eos_token_id
    # Bias eos up so the model wants to stop at once.
    biased = SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100.0})
    assert tiny.generate(PROMPTS[0], biased, use_tqdm=False)[0].outputs[0].token_ids == [eos]
    o = tiny.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100.0}, min_tokens=3),
                      use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) == 4 and o.token_ids[-1] == eos and eos not in o.token_ids[:3]
    o = tiny.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100.0}, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0]
    assert o.token_ids == [eos] * 8 and o.finish_reason == "length"
    sampled = dict(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)  # seeded: the same stream twice
    first = tiny.generate(PROMPTS[1], SamplingParams(**sampled), use_tqdm=False)[0].outputs[0].token_ids
    j = next(j for j in range(1, 8) if first[j] not in first[:j])  # first token not seen before
    o = tiny.generate(PROMPTS[1], SamplingParams(**sampled, stop_token_ids=[first[j]]), use_tqdm=False)[0].outputs[0]
    assert o.token_ids == first[: j + 1] and o.stop_reason == first[j]


def test_penalties_change_greedy_choice(tiny):
    plain = tiny.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(plain)) < len(plain)  # the random model repeats itself
    pen = tiny.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, presence_penalty=2.0,
                                                   frequency_penalty=2.0), use_tqdm=False)[0].outputs[0].token_ids
    assert pen != plain and len(set(pen)) > len(set(plain))
    rep = tiny.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=5.0),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert rep != plain


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_allowed_token_ids_and_bad_words(tiny):
    greedy = dict(max_tokens=10, temperature=0, ignore_eos=True)
    plain = tiny.generate(PROMPTS[0], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    allowed = sorted(set(range(40, 60)) - set(plain))  # none of the greedy choices
    for extra in ({}, {"temperature": 1.0, "seed": 5}):
        out = tiny.generate(PROMPTS[0], SamplingParams(**{**greedy, **extra}, allowed_token_ids=allowed),
                            use_tqdm=False)[0].outputs[0].token_ids
        assert len(out) == 10 and set(out) <= set(allowed)
    # a two-token word of the greedy text, tokenized back to the same two ids: its second token never follows its
    # first again, and a one-token word never comes at all
    tok = tiny.tokenizer
    j = next(j for j in range(len(plain) - 1) if plain[j] != plain[j + 1]
             and tok.encode(tok.decode(plain[j : j + 2]).lstrip(), add_special_tokens=False) == plain[j : j + 2])
    encode = functools.partial(tok.encode, add_special_tokens=False)
    params = SamplingParams(**greedy, bad_words=[tok.decode(plain[j : j + 2])])
    out = tiny.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out[: j + 1] == plain[: j + 1] and out[j + 1] != plain[j + 1]
    resolve_bad_words(params, encode)
    assert plain[j : j + 2] in params.bad_words_token_ids
    assert not any(_contains(out, w) for w in params.bad_words_token_ids)
    single = SamplingParams(**greedy, bad_words=[tok.decode([plain[0]])])
    out = tiny.generate(PROMPTS[0], single, use_tqdm=False)[0].outputs[0].token_ids
    resolve_bad_words(single, encode)
    assert [plain[0]] in single.bad_words_token_ids
    assert all(t not in out for [t] in (w for w in single.bad_words_token_ids if len(w) == 1))


def test_bad_words_take_the_spaced_form_only_where_it_differs():
    vocab = {"cat": [7], " cat": [8], "dog": [3, 4], " dog": [3, 4], "ant eater": [1, 2], " ant eater": [9]}
    p = SamplingParams(bad_words=["  cat", "dog", "ant eater"])
    resolve_bad_words(p, lambda w: vocab[w])
    assert p.bad_words_token_ids == [[7], [8], [3, 4], [1, 2]]  # " ant eater" has another token count
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_n_greater_than_one_shares_prefix_blocks(tiny):
    kv = tiny.engine.scheduler.kv
    before = kv.stats.hits
    prompt = PROMPTS[7]
    out = tiny.generate(prompt, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    n_prompt = len(tiny.tokenizer.encode(prompt))
    bs = tiny.resolved.cfg.cache.block_size
    assert kv.stats.hits - before >= 3 * ((n_prompt - 1) // bs) * bs  # children 1..3 hit the first's blocks


def test_chat_uses_template(tiny):
    out = tiny.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids[0] == tiny.tokenizer.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.parametrize("backend", ["cpu_native", "torch_sdpa"])
@pytest.mark.parametrize("scenario", ["default", "chunked_prefill", "preemption"])
def test_prompt_logprobs_match_hf_log_softmax(backend, scenario):
    """Each prompt token scored from the positions before it, as HF's full forward
    scores it, however the prompt is chunked; the prefix cache is bypassed
    (a warm cache would skip the positions to score), and the output stays
    what it is without prompt logprobs."""
    llm = LLM(overrides=BASE + ["model.dtype=float32", "cache.block_size=4", f"attention.backend={backend}"]
              + SCENARIOS[scenario])
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    plain = llm.generate(ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    scored = llm.generate(ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=3),
                          use_tqdm=False)
    for p_ids, a, b in zip(ids, plain, scored):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert a.prompt_logprobs is None and b.num_cached_tokens == 0
        lps = b.prompt_logprobs
        assert len(lps) == len(p_ids) and lps[0] is None
        ref = hf_logprobs(llm, p_ids)
        for j in range(1, len(p_ids)):
            row, lp = ref[j - 1], lps[j]
            assert lp.token_id == p_ids[j]
            assert lp.logprob == pytest.approx(float(row[p_ids[j]]), abs=1e-4)
            assert lp.rank == int((row > row[p_ids[j]]).sum()) + 1
            top = torch.topk(row, 3)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            for (_, v), ref_v in zip(lp.top, top.values.tolist()):
                assert v == pytest.approx(ref_v, abs=1e-4)
