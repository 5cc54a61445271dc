"""`appliance bench mix`: the seeded request mix and what it counts (the
run against a server is in tests/integration/test_benches.py)."""

import json
import random
from collections import Counter

import pytest

from appliance.bench.mix import Outcome, Sent, draw, keeps_to_schema, summarize


def test_each_client_draws_the_same_requests_for_the_same_seed():
    a = [draw(random.Random("0:3")) for _ in range(50)]
    b = [draw(random.Random("0:3")) for _ in range(50)]
    c = [draw(random.Random("0:4")) for _ in range(50)]
    assert a == b and a != c


def test_the_mix_holds_its_shares_and_lengths():
    rng = random.Random(7)
    reqs = [draw(rng) for _ in range(4000)]
    shares = Counter(r.kind for r in reqs)
    for kind, share in (("completion", 0.30), ("json_chat", 0.20), ("chat_n2", 0.15), ("stream", 0.35)):
        assert shares[kind] / len(reqs) == pytest.approx(share, abs=0.03)
    completions = [r for r in reqs if r.kind == "completion"]
    assert {len(r.body["prompt"].split()) for r in completions} == {20, 200, 1500}
    assert {r.body["max_tokens"] for r in completions} == {8, 64}
    streams = [r for r in reqs if r.kind == "stream"]
    assert {r.cut_after for r in streams} == {2, 5, None} and {r.body["max_tokens"] for r in streams} == {200}
    assert all(r.body["stream_options"]["continuous_usage_stats"] for r in streams)
    assert all(r.body["n"] == 2 and not r.greedy for r in reqs if r.kind == "chat_n2")
    assert all(r.body["response_format"]["type"] == "json_schema" for r in reqs if r.kind == "json_chat")
    small = draw(random.Random(1), scale=0.01)
    assert small.body["max_tokens"] >= 1


@pytest.mark.parametrize("value,kept", [
    ({"name": "Ada", "age": 36, "tags": ["math"]}, True),
    ({"name": "Ada", "age": 36, "tags": []}, True),
    ({"name": "Ada", "age": 36}, False),  # a required key missing
    ({"name": "Ada", "age": 36, "tags": [], "x": 1}, False),  # no other keys
    ({"name": "Ada", "age": True, "tags": []}, False),
    ({"name": "Ada", "age": 200, "tags": []}, False),
    ({"name": "A" * 25, "age": 3, "tags": []}, False),
    ({"name": "Ada", "age": 3, "tags": ["a", "b", "c", "d"]}, False),
])
def test_json_answers_are_checked_against_the_schema(value, kept):
    assert keeps_to_schema(json.dumps(value)) is kept


def test_an_answer_that_is_not_json_does_not_keep_to_the_schema():
    assert not keeps_to_schema('{"name": "Ada", "age": 3, "tags": [')


def test_the_summary_counts_what_finished_and_its_tokens():
    rng = random.Random(0)
    sent = [
        Sent(draw(rng), Outcome("completion", True, 0.5, 30, 8, text="x")),
        Sent(draw(rng), Outcome("stream", True, 0.2, 400, 2, 0.1, [0.05], "ab", "cut")),
        Sent(draw(rng), Outcome("stream", False, 0.1, error="HTTP 500: boom")),
        Sent(draw(rng), Outcome("json_chat", True, 1.0, 50, 20, text='{"name": "a", "age": 1, "tags": []}',
                                finish_reason="stop")),
    ]
    res = summarize(sent, cut_at_deadline=1, elapsed=10.0)
    t = res["totals"]
    assert (t["requests"], t["errors"], t["cut_at_deadline"]) == (3, 1, 1)
    assert (t["prompt_tokens"], t["generated_tokens"]) == (480, 30)
    assert t["prompt_tok_s"] == pytest.approx(48.0) and t["generated_tok_s"] == pytest.approx(3.0)
    assert res["by_kind"]["stream"]["errors"] == 1 and res["by_kind"]["stream"]["error_samples"] == ["HTTP 500: boom"]
    assert res["by_kind"]["stream"]["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert res["json_schema"] == {"finished": 1, "kept_to_schema": 1}
