"""Speculative decoding through `appliance run` and `appliance generate`:
the served text equals plain decoding's under greedy sampling, and the
drafts show in /metrics."""

import httpx
import pytest

from appliance import LLM, SamplingParams
from tests.integration.server_helpers import ServerProcess, metric

TINY = ["model=tiny_random", "cache.kv_cache_memory_gib=0.05", "server.dev_mode=true"]
PROMPT = "one two three four one two three four one two three four one two"
PROPOSERS = {"ngram": ["speculative=ngram"],
             "draft_model": ["speculative=draft_model", "speculative.draft_model=tiny_random_draft"]}


@pytest.fixture(scope="module")
def plain_text():
    llm = LLM(overrides=["+profile=cpu", *TINY])
    return llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_served_speculative_completions_equal_plain_ones(proposer, plain_text):
    s = ServerProcess(*TINY, *PROPOSERS[proposer])
    try:
        body = {"model": "tiny-random-llama", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain_text
        text = httpx.get(f"{s.url}/metrics", timeout=30).text
        assert metric(text, "appliance:spec_decode_num_drafts_total") > 0
        assert metric(text, "appliance:spec_decode_num_accepted_tokens_total") >= 0
    finally:
        s.stop()


def test_generate_cli_speculates_to_the_same_text():
    from tests.conftest import run_cli

    outs = [run_cli("generate", "+profile=cpu", *TINY[:2], *extra, f"prompt={PROMPT}", "max_tokens=24")
            for extra in ([], *PROPOSERS.values())]
    assert all(r.returncode == 0 for r in outs), [r.stderr for r in outs]
    assert outs[0].stdout.strip() and outs[0].stdout == outs[1].stdout == outs[2].stdout
