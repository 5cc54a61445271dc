"""Hostile and malformed requests: refused at the boundary with an OpenAI
error body, never a 5xx, and never able to stop the engine for anyone else.

The module's server runs with two injected faults (a ``sitecustomize`` on
its PYTHONPATH, so the spawned engine core has them too): the sampler fails
on any batch holding a request with ``logit_bias {"3": -99.5}``, and the
detokenizer fails to start for the stop string ``"__fault__"``. They stand
for bugs the core must contain to the one request.
"""

import asyncio
import json
import os

import httpx
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from appliance import LLM, SamplingParams
from appliance.engine.failures import Suspects
from appliance.server.protocol import PER_DEPLOYMENT_SPECULATIVE
from appliance.worker.sampler import SampleRequest, sample
from tests.integration.server_helpers import ScriptedClient, ServerProcess, metric, scripted_front_end

VOCAB = 512  # the tiny random model's
FAULTS = '''
import appliance.engine.detokenizer as _detok
import appliance.worker.sampler as _sampler

_sample = _sampler.sample


def _faulty_sample(logits, reqs, generator):
    if any(r.params.logit_bias.get(3) == -99.5 for r in reqs):
        raise RuntimeError("injected sampler fault")
    return _sample(logits, reqs, generator)


_sampler.sample = _faulty_sample
_init = _detok.IncrementalDetokenizer.__init__


def _faulty_init(self, tokenizer, prompt_token_ids, stop=(), *args, **kwargs):
    if "__fault__" in stop:
        raise RuntimeError("injected detokenizer fault")
    _init(self, tokenizer, prompt_token_ids, stop, *args, **kwargs)


_detok.IncrementalDetokenizer.__init__ = _faulty_init
'''
POISON = {"3": -99.5}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    faults = tmp_path_factory.mktemp("faults")
    (faults / "sitecustomize.py").write_text(FAULTS)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(faults), old) if p)
    try:
        s = ServerProcess("model=tiny_random", "cache.kv_cache_memory_gib=0.05", "server.max_queue_len=8",
                          "scheduler.max_num_seqs=4")
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    yield s
    s.stop()


def post(server, path, body, **kw):
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"},
                          timeout=60, **kw)
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def assert_openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param, err
    assert "Traceback" not in r.text
    return err


def assert_serving(server):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    r = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def sse_events(text):
    return [ev[len("data: "):] for ev in text.split("\n\n") if ev]


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
MSGS = [{"role": "user", "content": "Hi"}]
HUGE = 10**30


# -- requests that used to stop the engine for everyone ---------------------------
@pytest.mark.parametrize("path,body,param", [
    (CMPL, {"prompt": "Hi", "logit_bias": {"99999999": 5}}, "logit_bias"),
    (CMPL, {"prompt": "Hi", "logit_bias": {"-99999999": 5}}, "logit_bias"),
    (CHAT, {"messages": MSGS, "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    (CMPL, {"prompt": "Hi", "stop_token_ids": [99999999], "min_tokens": 2}, "stop_token_ids"),
    (CMPL, {"prompt": "Hi", "stop_token_ids": ["a"], "min_tokens": 2}, "stop_token_ids"),
])
def test_engine_killers_are_refused_and_the_engine_serves_on(server, path, body, param):
    for stream in (False, True):
        assert_openai_error(post(server, path, {**body, "stream": stream, "max_tokens": 4}), 400, param)
    assert_serving(server)


# -- client mistakes that used to be a 500 or a dropped stream --------------------
@pytest.mark.parametrize("path,body,param", [
    (CMPL, {"prompt": "Hi", "seed": HUGE}, "seed"),
    (CMPL, {"prompt": "Hi", "seed": -HUGE}, "seed"),
    (CMPL, {"prompt": "Hi", "priority": HUGE}, "priority"),
    (CMPL, {"prompt": "Hi", "top_k": HUGE}, "top_k"),
    (CMPL, {"prompt": "Hi", "stop_token_ids": [HUGE]}, "stop_token_ids"),
    (CMPL, {"prompt": "Hi", "logit_bias": {str(HUGE): 1}}, "logit_bias"),
    (CMPL, {"prompt": [HUGE]}, "prompt"),
    (CHAT, {"messages": MSGS, "seed": 2**64}, "seed"),
    (CHAT, {"messages": MSGS, "max_tokens": HUGE}, "max_tokens"),
    (CHAT, {"messages": MSGS, "min_tokens": HUGE}, "min_tokens"),
    (CHAT, {"messages": MSGS, "temperature": HUGE**11}, "temperature"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_out_of_range_integers_are_400(server, path, body, param, stream):
    assert_openai_error(post(server, path, {**body, "stream": stream}), 400, param)


@pytest.mark.parametrize("path,raw,param", [
    (CMPL, '{"prompt": "a\\ud800b"}', "prompt"),
    (CMPL, b'{"prompt": "a\xed\xa0\x80b"}', "prompt"),
    (CMPL, '{"prompt": "Hi", "stop": ["\\udfff"]}', "stop"),
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages"),
    (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "\\ud800": 1}', None),
    (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "metadata": {"\\ud800": 1}}', "metadata"),
])
def test_lone_surrogates_are_400(server, path, raw, param):
    err = assert_openai_error(post(server, path, raw), 400, param)
    assert "valid Unicode" in err["message"]


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_deep_nesting_is_400(server, depth):
    raw = '{"prompt": "Hi", "metadata": ' + "[" * depth + "]" * depth + "}"
    err = assert_openai_error(post(server, CMPL, raw), 400)
    assert "nested more than 64" in err["message"]
    ok = '{"prompt": "Hi", "max_tokens": 1, "metadata": ' + "[" * 60 + "]" * 60 + "}"
    assert post(server, CMPL, ok).status_code == 200


# -- accepted nonsense --------------------------------------------------------------
@pytest.mark.parametrize("path,raw,param", [
    (CMPL, '{"prompt": "Hi", "temperature": NaN}', None),
    (CMPL, '{"prompt": "Hi", "temperature": Infinity}', None),
    (CMPL, '{"prompt": "Hi", "temperature": -Infinity}', None),
    (CMPL, '{"prompt": "Hi", "temperature": 1e999}', None),
    (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "repetition_penalty": NaN}', None),
    (CMPL, '{"prompt": "Hi", "logit_bias": {"-1": 100}}', "logit_bias"),
    (CMPL, '{"prompt": "Hi", "logit_bias": {"5": true}}', "logit_bias"),
    (CMPL, '{"prompt": "Hi", "logit_bias": {"5": 101}}', "logit_bias"),
    (CMPL, '{"prompt": "Hi", "logit_bias": {"+5": 1}}', "logit_bias"),
    (CMPL, '{"prompt": [[true, false]]}', "prompt"),
    (CMPL, '{"prompt": [true, 5]}', "prompt"),
    (CMPL, '{"prompt": [[]]}', "prompt"),
    (CMPL, '{"prompt": "Hi", "stop_token_ids": [1.5]}', "stop_token_ids"),
    (CMPL, '{"prompt": "Hi", "stop_token_ids": [true]}', "stop_token_ids"),
    (CMPL, '{"prompt": "Hi", "max_tokens": 2.0}', "max_tokens"),
    (CMPL, '{"prompt": "Hi", "n": true}', "n"),
    (CMPL, '{"prompt": "Hi", "top_p": 0}', "top_p"),
    (CMPL, '{"prompt": "Hi", "repetition_penalty": 0}', "repetition_penalty"),
    (CMPL, '{"prompt": "Hi", "presence_penalty": 2.5}', "presence_penalty"),
    (CMPL, '{"prompt": "Hi", "stream": true, "stream_options": {"include_usage": "no"}}', "stream_options"),
    (CMPL, '{"prompt": "Hi", "stream": true, "stream_options": {"continuous_usage_stats": true}}', "stream_options"),
    (CMPL, '{"prompt": "Hi", "stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": 1}}',
     "stream_options"),
    (CMPL, '{"prompt": "Hi", "stream": true, "stream_options": {"include_usage": true, "usage_every": true}}',
     "stream_options"),
    (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "model": ["x"]}', "model"),
    (CHAT, '{"messages": [{"role": "user", "content": "Hi"}], "min_tokens": 5000}', "min_tokens"),
])
def test_nonsense_values_are_400(server, path, raw, param):
    assert_openai_error(post(server, path, raw), 400, param)


# -- fields that ask for behaviour not built yet ------------------------------------
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("extra,param", [
    ({"modalities": ["audio"]}, "modalities"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ({"structural_tag": {"type": "structural_tag"}}, "structural_tag"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}, "speculative_config"),
    ({"num_speculative_tokens": 4}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"speculative_model": "tiny_random"}, "speculative_model"),
    ({"ngram_prompt_lookup_max": 3}, "ngram_prompt_lookup_max"),
])
def test_unbuilt_features_are_400_naming_the_field(server, extra, param):
    err = assert_openai_error(post(server, CHAT, {"messages": MSGS, "max_tokens": 2, **extra}), 400, param)
    assert param in err["message"]
    if param in PER_DEPLOYMENT_SPECULATIVE:
        assert "configured per deployment (speculative=" in err["message"]


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"response_format": {"type": "bogus"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
    ({"guided_json": {"type": "object", "properties": []}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "file:///etc/passwd"}}}},
     "response_format"),
    ({"guided_choice": ["a" * 300_000]}, "guided_choice"),
    ({"bad_words": "x"}, "bad_words"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": ["x"] * 257}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"),
])
def test_malformed_tools_and_constraints_are_400_naming_the_field(server, extra, param):
    assert_openai_error(post(server, CHAT, {"messages": MSGS, "max_tokens": 2, **extra}), 400, param)


@pytest.mark.parametrize("extra", [
    {"tools": [TOOL], "tool_choice": "none"},
    {"tools": []},
    {"tool_choice": "none"},
    {"response_format": {"type": "text"}},
    {"modalities": ["text"]},
    {"parallel_tool_calls": False, "user": "u-1", "use_beam_search": False},
])
def test_no_op_values_of_those_fields_are_accepted(server, extra):
    r = post(server, CHAT, {"messages": MSGS, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text


# -- the queue limit counts every sequence ------------------------------------------
def test_queue_limit_counts_prompts_times_n(server):
    err = assert_openai_error(post(server, CMPL, {"prompt": ["Hi"] * 16, "n": 16, "max_tokens": 2}), 400, "prompt")
    assert "256 sequences" in err["message"] and "server.max_queue_len=8" in err["message"]
    assert_openai_error(post(server, CHAT, {"messages": MSGS, "n": 9, "max_tokens": 2}), 400, "n")

    async def flood():
        async with httpx.AsyncClient(timeout=120) as ac:
            return await asyncio.gather(*(ac.post(f"{server.url}{CMPL}", json={
                "prompt": "Hello", "n": 4, "max_tokens": 150, "ignore_eos": True}) for _ in range(10)))

    async def watch(done: asyncio.Event):
        most = 0
        async with httpx.AsyncClient(timeout=10) as ac:
            while not done.is_set():
                most = max(most, metric((await ac.get(f"{server.url}/metrics")).text, "appliance:num_requests_waiting"))
                await asyncio.sleep(0.02)
        return most

    async def main():
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        rs = await flood()
        done.set()
        return rs, await watcher

    rs, most_waiting = asyncio.run(main())
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
    assert all(r.json()["error"]["code"] == "queue_full" for r in rs if r.status_code == 503)
    assert most_waiting <= 8


# -- a request the core fails on ends alone ---------------------------------------
def test_a_request_the_core_fails_on_ends_alone_and_the_others_finish(server):
    ref = post(server, CMPL, {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0}).json()

    async def main():
        async with httpx.AsyncClient(timeout=120) as ac:
            normal = [ac.post(f"{server.url}{CMPL}", json={"prompt": "The quick brown fox", "max_tokens": 24,
                                                           "temperature": 0}) for _ in range(3)]
            poisoned = ac.post(f"{server.url}{CMPL}", json={"prompt": "Hi", "max_tokens": 24, "logit_bias": POISON})
            return await asyncio.gather(poisoned, *normal)

    bad, *good = asyncio.run(main())
    err = assert_openai_error(bad, 500)
    assert err["code"] == "engine_error" and err["type"] == "internal_server_error"
    assert "injected" not in bad.text  # the cause is logged, not sent
    for r in good:
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    assert "RuntimeError: injected sampler fault" in server.output()  # the core logged the traceback
    assert_serving(server)


@pytest.mark.parametrize("path,body", [
    (CMPL, {"prompt": "Hi", "max_tokens": 8, "logit_bias": POISON}),
    (CHAT, {"messages": MSGS, "max_tokens": 8, "logit_bias": POISON}),
    (CMPL, {"prompt": "Hi", "max_tokens": 8, "stop": ["__fault__"]}),
])
def test_a_failed_stream_ends_with_an_error_event_then_done(server, path, body):
    r = post(server, path, {**body, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "internal_server_error" and err["code"] == "engine_error"
    assert set(err) == {"message", "type", "param", "code"}
    assert_serving(server)


def test_a_request_that_fails_to_start_in_the_core_is_500(server):
    err = assert_openai_error(post(server, CMPL, {"prompt": "Hi", "max_tokens": 4, "stop": ["__fault__"]}), 500)
    assert err["code"] == "engine_error"
    assert "RuntimeError: injected detokenizer fault" in server.output()
    assert_serving(server)


# -- fuzz ---------------------------------------------------------------------------------
FIELDS = ["prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "best_of", "stop", "stop_token_ids", "logit_bias", "logprobs", "top_logprobs", "seed",
          "priority", "stream", "stream_options", "echo", "suffix", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "min_tokens", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
          "cache_salt", "tools", "tool_choice", "response_format", "functions", "modalities", "user",
          "add_generation_prompt", "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "return_token_ids",
          "return_tokens_as_token_ids", "chat_template_kwargs", "reasoning_effort", "continue_final_message",
          "add_special_tokens", "chat_template", "tokens", "return_token_strs", "system", "stop_sequences",
          "tool_choice", "metadata", "input", "instructions", "max_output_tokens", "text", "reasoning", "store",
          "previous_response_id", "use_beam_search", "length_penalty", "early_stopping", "\ud800"]
# Raw JSON text spliced in where a placeholder string stands: what json.dumps cannot write.
RAW = {"@nan": "NaN", "@inf": "Infinity", "@-inf": "-Infinity", "@big": "1e999", "@deep": "[" * 200 + "]" * 200,
       "@int": "9" * 40, "@surrogate": '"\\udc80"', "@half": '"\\ud83d x"'}

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-3, max_value=3), st.integers(min_value=-2**70, max_value=2**70),
    st.sampled_from([2**63 - 1, 2**63, 2**64, -2**63 - 1, VOCAB - 1, VOCAB, 49152, 99999999]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, 1e-300, 1e300, -0.0, 0.5, 2.0]),
    st.text(max_size=12), st.sampled_from(["\ud800", "a\udfffb", "", "-1", "50000", "text", "none", "auto",
                                           "required", "json_object", "0"]),
    st.sampled_from(sorted(RAW)),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.sampled_from(["type", "role", "content", "include_usage",
                                                                       "text", "5", "-1", "600"]), st.text(max_size=6)),
                                            inner, max_size=4)),
    max_leaves=12,
)
messages = st.one_of(values, st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"])},
    optional={"content": values, "name": values}), min_size=1, max_size=3))


def encode_body(body: dict) -> str:
    text = json.dumps(body)
    for token, raw in RAW.items():
        text = text.replace(json.dumps(token), raw)
    return text


@st.composite
def hostile_requests(draw):
    path = draw(st.sampled_from([CHAT, CMPL, CHAT, CMPL, "/tokenize", "/detokenize", MESSAGES, RESPONSES]))
    chat = path in (CHAT, MESSAGES) or (path == "/tokenize" and draw(st.booleans()))
    base = {"tokens": [1, 2]} if path == "/detokenize" else {"messages": MSGS} if chat else {"prompt": "Hello"}
    body = {"input": "Hi", "max_output_tokens": 3} if path == RESPONSES else {**base, "max_tokens": 3}
    for key in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4, unique=True)):
        body[key] = draw(messages if key == "messages" else values)
    return path, encode_body(body)


@settings(max_examples=160, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(req=hostile_requests())
def test_fuzz_never_5xx(server, req):
    path, raw = req
    r = post(server, path, raw.encode("utf-8", "surrogatepass"))
    event(f"HTTP {r.status_code}")
    assert r.status_code < 500, (raw, r.status_code, r.text)
    if r.status_code >= 400 and path == MESSAGES:  # Anthropic's shape
        assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}, r.text
    elif r.status_code >= 400:
        assert_openai_error(r, r.status_code)
    elif path == MESSAGES and r.headers["content-type"].startswith("text/event-stream"):
        kinds = [ev.split("\n", 1)[0] for ev in r.text.split("\n\n") if ev]
        assert kinds[0] == "event: message_start" and kinds[-1] == "event: message_stop", (raw, r.text)
    elif path == RESPONSES and r.headers["content-type"].startswith("text/event-stream"):
        kinds = [ev.split("\n", 1)[0] for ev in r.text.split("\n\n") if ev]
        assert kinds[0] == "event: response.created" and kinds[-1] in (
            "event: response.completed", "event: response.incomplete"), (raw, r.text)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(r.text)
        assert events[-1] == "[DONE]", r.text
        for ev in events[:-1]:
            assert "error" not in json.loads(ev), (raw, ev)


def test_after_the_fuzz_the_engine_still_serves(server):
    assert_serving(server)


# -- the engine core in-process ------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM(overrides=["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.01",
                          "scheduler.max_num_batched_tokens=64"])


def test_sampler_skips_out_of_range_ids():
    logits = torch.randn(3, 50)
    wild = (2**64 - 1, -5, 50, 99999999)
    reqs = [
        SampleRequest(SamplingParams(temperature=0, logit_bias={60: 5.0, 3: 100.0}, min_tokens=4,
                                     repetition_penalty=1.3, frequency_penalty=1.0, presence_penalty=0.5, logprobs=20),
                      [1, 2, 77], [4, 120], None, wild),
        SampleRequest(SamplingParams(seed=7, min_tokens=1), [1], [], torch.Generator().manual_seed(7), wild + (9,)),
        SampleRequest(SamplingParams(top_k=10**9, top_p=0.5, logit_bias={2**40: 1.0}), [2], [], None, ()),
    ]
    tokens, lps = sample(logits, reqs, torch.Generator().manual_seed(0))
    assert tokens[0] == 3 and all(0 <= t < 50 for t in tokens) and tokens[1] != 9
    assert len(lps[0].top) == 20 and lps[1] is None


def _run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_core_ends_only_the_request_whose_sampling_fails(llm, monkeypatch):
    import appliance.worker.model_runner as runner

    greedy = SamplingParams(max_tokens=12, temperature=0)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    prompts = ["The quick brown fox", "Hello there " * 30, "Paged attention"]  # the second needs chunked prefill
    ref = [o.outputs[0].text for o in _run(llm, prompts, [greedy, seeded, greedy])]
    real = runner.sample

    def faulty(logits, reqs, generator):
        if any(r.params.logit_bias.get(3) == -99.5 for r in reqs):
            raise RuntimeError("injected sampler fault")
        return real(logits, reqs, generator)

    monkeypatch.setattr(runner, "sample", faulty)
    poisoned = SamplingParams(max_tokens=12, temperature=0, logit_bias={3: -99.5})
    outs = _run(llm, [*prompts, "Hi"], [greedy, seeded, greedy, poisoned])
    assert [o.outputs[0].text for o in outs[:3]] == ref
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length", "length", "error"]
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine._suspects and not engine._suspects.strikes
    assert engine.scheduler.kv.usage() == 0
    engine.scheduler.kv.check_integrity()
    assert [o.outputs[0].text for o in _run(llm, prompts, [greedy, seeded, greedy])] == ref


def test_core_retries_a_failed_batch_one_request_at_a_time(llm, monkeypatch):
    """A fault of the whole batch (here: any step of two or more requests) is
    not pinned on anyone: each request runs alone and goes on as it would
    have; a fault that keeps coming back ends them after a few rounds."""
    greedy = SamplingParams(max_tokens=2, temperature=0)
    prompts = ["One two three", "Four five six", "Seven eight"]
    ref = [o.outputs[0].text for o in _run(llm, prompts, greedy)]
    runner = llm.engine.runner
    real = runner.execute

    def fails_in_batches(sched_out):
        if len(sched_out.num_scheduled_tokens) > 1:
            raise RuntimeError("injected batch fault")
        return real(sched_out)

    monkeypatch.setattr(runner, "execute", fails_in_batches)
    outs = _run(llm, prompts, greedy)
    assert [o.outputs[0].text for o in outs] == ref
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
    outs = _run(llm, prompts, SamplingParams(max_tokens=8, temperature=0))
    assert [o.outputs[0].finish_reason for o in outs] == ["error"] * 3
    assert [len(o.outputs[0].token_ids) for o in outs] == [Suspects.MAX_STRIKES - 1] * 3
    monkeypatch.setattr(runner, "execute", real)
    assert not llm.engine._suspects and not llm.engine._suspects.strikes and llm.engine.scheduler.kv.usage() == 0
    llm.engine.scheduler.kv.check_integrity()
    assert [o.outputs[0].text for o in _run(llm, prompts, greedy)] == ref


def test_prompt_logprobs_survive_a_failed_step_mid_prompt(llm, monkeypatch):
    """Two prompts in chunks of at most 64 tokens; the first step that runs
    both (one of them past its first chunk) fails, so both are recomputed
    from their start: each prompt token is still scored once, as in a run
    without the fault."""
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    prompts = ["Hello there " * 40, "The quick brown fox " * 30]
    ref = _run(llm, prompts, params)
    runner, requests = llm.engine.runner, llm.engine.scheduler.requests
    real, scored_before = runner.execute, []

    def fails_once(sched_out):
        if not scored_before and len(sched_out.num_scheduled_tokens) == 2:
            scored_before.append(max(requests[r].num_computed_tokens - n
                                     for r, n in sched_out.num_scheduled_tokens.items()))
            raise RuntimeError("injected fault mid-prompt")
        return real(sched_out)

    monkeypatch.setattr(runner, "execute", fails_once)
    outs = _run(llm, prompts, params)
    assert scored_before and scored_before[0] > 0  # positions already scored before the fault
    for a, b in zip(ref, outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids) > 64
        assert [lp and (lp.token_id, lp.logprob) for lp in b.prompt_logprobs] == \
               [lp and (lp.token_id, lp.logprob) for lp in a.prompt_logprobs]
    assert not llm.engine._prompt_lps


def test_core_refuses_token_ids_outside_the_vocabulary(llm):
    engine = llm.engine
    for ids, params in [([1, VOCAB], SamplingParams()), ([-1], SamplingParams()),
                        ([1], SamplingParams(stop_token_ids=[VOCAB])), ([1], SamplingParams(logit_bias={VOCAB: 1.0})),
                        ([1, "x"], SamplingParams())]:
        with pytest.raises(ValueError):
            engine.add_request("bad", ids, params)
        assert "bad" not in engine.scheduler.requests and "bad" not in engine.detok


# -- the front end in-process, over a scripted engine client --------------------------
@pytest.fixture(scope="module")
def front_end():
    return scripted_front_end(["server.max_queue_len=8"])


@pytest.mark.parametrize("path,body", [(CMPL, {"prompt": "Hi"}), (CHAT, {"messages": MSGS})])
def test_an_error_after_the_headers_ends_the_stream_with_an_event_then_done(front_end, path, body):
    script = [{"new_text": "Hel"}, OverflowError("int too big to convert")]
    with front_end(ScriptedClient(script)) as c:
        r = c.post(path, json={**body, "stream": True})
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and "Hel" in events[-3]
        err = json.loads(events[-2])["error"]
        assert err["type"] == "internal_server_error" and "OverflowError" in err["message"]
        assert "int too big" not in r.text
        assert_openai_error(c.post(path, json=body), 500)


def test_an_error_finish_from_the_core_is_500(front_end):
    with front_end(ScriptedClient([{"new_text": "Hel"}, {"finished": True, "finish_reason": "error"}])) as c:
        err = assert_openai_error(c.post(CMPL, json={"prompt": "Hi"}), 500)
        assert err["code"] == "engine_error"
        events = sse_events(c.post(CHAT, json={"messages": MSGS, "stream": True}).text)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_error"


def test_a_dead_engine_does_not_tell_clients_why(front_end):
    with front_end(ScriptedClient([], dead=True)) as c:
        err = assert_openai_error(c.post(CMPL, json={"prompt": "Hi"}), 503)
        assert err["code"] == "engine_dead" and err["message"] == "the engine failed; see the server log"
        health = c.get("/health")
        assert health.status_code == 503 and "IndexError" not in health.text
