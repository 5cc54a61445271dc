"""The real server on 127.0.0.1 driven by the openai client and raw httpx."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from appliance import LLM, SamplingParams
from tests.integration.server_helpers import ServerProcess, metric
from tests.model_helpers import CAPITAL_ONE_WORD

KEY = "sk-test-key"
TINY = ["model=tiny_random", "cache.kv_cache_memory_gib=0.05", f"server.api_key={KEY}", "server.dev_mode=true",
        "server.max_body_bytes=20000", "scheduler.max_num_seqs=64"]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*TINY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def raw(server, method, path, auth=True, **kw):
    headers = kw.pop("headers", {})
    if auth:
        headers["Authorization"] = f"Bearer {KEY}"
    return httpx.request(method, f"{server.url}{path}", headers=headers, timeout=60, **kw)


def test_models_health_ready_version_config(server, client, model):
    assert model == "tiny-random-llama"
    assert raw(server, "GET", "/health").json() == {"status": "ok"}
    assert raw(server, "GET", "/ready").status_code == 200
    version = raw(server, "GET", "/version").json()
    cfg = raw(server, "GET", "/v1/appliance/config").json()
    assert cfg["profile"] == "cpu" and len(cfg["hash"]) == 16 and cfg["config"]["model"]["path"] == "tiny_random"
    # What this machine resolved the declarative config to, next to what it asked for.
    here = cfg["resolved_here"]
    assert here["probed"] and here["host"].startswith("cpu: ")
    assert here["dtype"]["requested"] == "float32" and here["dtype"]["resolved"] == "float32"
    assert here["kv_cache_dtype"] == {"requested": "auto", "resolved": "float32"}
    assert here["attention_backend"]["resolved"] == "cpu_native"
    assert version["config_hash"] == cfg["hash"] and version["deployment"] == cfg["deployment"] != cfg["hash"]
    assert cfg["config"]["server"]["api_key"] == "***" and KEY not in str(cfg)  # the key is never shown


def test_completion_and_chat_sync(client, model):
    r = client.completions.create(model=model, prompt="Hello world", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5
    c = client.chat.completions.create(model=model, messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Hi"}],
                                       max_completion_tokens=4, temperature=0)
    assert c.choices[0].message.role == "assistant" and c.usage.completion_tokens == 4


def test_prompt_forms(client, model):
    r = client.completions.create(model=model, prompt=["Hello", "The quick brown fox"], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    ids = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 3
    many = client.completions.create(model=model, prompt=[[5, 6], [7, 8, 9]], max_tokens=2, temperature=0)
    assert many.usage.prompt_tokens == 5 and len(many.choices) == 2


def test_greedy_server_equals_offline_generate(client, model):
    prompt = "The quick brown fox jumps"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    llm = LLM(overrides=["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.01"])
    ref = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert r.choices[0].text == ref


def test_streaming_deltas_concatenate_to_full_text(client, model):
    kw = dict(model=model, prompt="Unicode: café 東京 😀", max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    chat_kw = dict(model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=10, temperature=0)
    full = client.chat.completions.create(**chat_kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**chat_kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, model):
    """vLLM's ``stream_options.continuous_usage_stats``: a client that stops
    reading early still knows the prompt's tokens and how many it got."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model=model, prompt="Counting: one two three", max_tokens=6, temperature=0, n=2)
    chunks = list(client.completions.create(**kw, stream=True, stream_options=opts))
    assert all(c.usage is not None for c in chunks)
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert {c.usage.prompt_tokens for c in chunks} == {prompt_tokens}
    so_far = [c.usage.completion_tokens for c in chunks]
    assert so_far == sorted(so_far) and so_far[0] >= 1 and so_far[-1] == 12  # 6 tokens each of n=2
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in chunks)
    chat = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=5, temperature=0, stream=True, stream_options=opts))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert [c.usage.completion_tokens for c in chat][-2:] == [5, 5]  # the last token's chunk, then the usage chunk
    plain = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=5, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_cut_inside_a_character_streams_and_returns_the_same_text(client, model):
    """max_tokens ends the request inside a multi-byte character: no U+FFFD, the
    same text streamed and whole, and the cut token still counted."""
    from transformers import AutoTokenizer

    from appliance.config.compose import resolve
    from appliance.models.loader import resolve_model_folder

    tok = AutoTokenizer.from_pretrained(str(resolve_model_folder(resolve(["+profile=cpu", *TINY[:1]]).cfg.model)))
    ids = tok.encode("a 😀🚀")
    partial = next(t for i, t in enumerate(ids) if tok.decode(ids[: i + 1]).endswith("\ufffd"))
    kw = dict(model=model, prompt="Hello", max_tokens=1, temperature=0, logit_bias={str(partial): 100})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks if c.choices) == ""
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 1


def test_raw_sse_ends_with_done(server):
    r = raw(server, "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    lines = [ln for ln in r.text.split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)


def test_n_stop_seed_logprobs(client, model):
    r = client.completions.create(model=model, prompt="Hello", max_tokens=6, n=3, temperature=1.0, seed=11)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    again = client.completions.create(model=model, prompt="Hello", max_tokens=6, n=3, temperature=1.0, seed=11)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    base = client.completions.create(model=model, prompt="Paged attention", max_tokens=12, temperature=0).choices[0].text
    stop = base[4:7]
    s = client.completions.create(model=model, prompt="Paged attention", max_tokens=12, temperature=0, stop=[stop])
    assert s.choices[0].text == base[: base.find(stop)] and s.choices[0].finish_reason == "stop"
    lp = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    L = lp.choices[0].logprobs
    assert len(L.tokens) == len(L.token_logprobs) == len(L.top_logprobs) == len(L.text_offset) == 3
    assert all(len(t) >= 2 for t in L.top_logprobs) and all(v <= 0 for v in L.token_logprobs)
    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].bytes == list(content[0].token.encode())


def test_extension_fields(client, model):
    r = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True, "min_tokens": 4, "top_k": 5, "min_p": 0.1,
                                              "priority": 1, "cache_salt": "tenant-a", "repetition_penalty": 1.1})
    assert r.usage.completion_tokens == 4


def test_choices_carry_vllms_stop_reason(server):
    """The stop string or stop token id that ended a choice (None for EOS and length), whole and streamed."""
    body = {"prompt": "Hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    plain = raw(server, "POST", "/v1/completions", json=body).json()["choices"][0]
    assert plain["finish_reason"] == "length" and plain["stop_reason"] is None
    text, ids = plain["text"], plain["token_ids"]
    stop = text[2:5]
    cut = raw(server, "POST", "/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    j = next(j for j in range(1, len(ids)) if ids[j] not in ids[:j])
    by_id = raw(server, "POST", "/v1/completions", json={**body, "stop_token_ids": [ids[j]]}).json()["choices"][0]
    assert by_id["stop_reason"] == ids[j]
    chunks = _sse_json(raw(server, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "stop_token_ids": [ids[j]], "stream": True}).text)
    chat = raw(server, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "stop_token_ids": [ids[j]]}).json()["choices"][0]
    last = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][-1]
    assert last["stop_reason"] == chat["stop_reason"] and all(
        c["choices"][0]["stop_reason"] is None for c in chunks if c["choices"] and not c["choices"][0]["finish_reason"])


def test_vllm_token_fields_through_the_engine(server, client, model):
    """allowed_token_ids and return_token_ids through the real engine; the ids come back as /tokenize and
    /detokenize see them."""
    base = dict(model=model, prompt="Hello world", max_tokens=6, temperature=0)
    plain = client.completions.create(**base, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids, prompt = plain.choices[0].token_ids, plain.choices[0].prompt_token_ids
    assert prompt == raw(server, "POST", "/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert raw(server, "POST", "/detokenize", json={"tokens": ids}).json()["prompt"] == plain.choices[0].text
    allowed = sorted(set(range(40, 60)) - set(ids))
    r = client.completions.create(**base, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                      "allowed_token_ids": allowed})
    assert len(r.choices[0].token_ids) == 6 and set(r.choices[0].token_ids) <= set(allowed)
    assert raw(server, "POST", "/tokenize", auth=False, json={"prompt": "x"}).status_code == 401


def _sse_json(text):
    import json
    return [json.loads(ln[6:]) for ln in text.split("\n\n") if ln.startswith("data: {")]


def test_prompt_logprobs_and_echo_with_logprobs(server):
    """vLLM's prompt_logprobs (per prompt token a map of id to logprob, rank
    and text, the first None) on both APIs; the completions API's echo with
    logprobs scores the echoed prompt too, streamed or not."""
    prompt = "The quick brown fox jumps over the lazy dog"
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = raw(server, "POST", "/v1/completions", json={**body, "prompt_logprobs": 2}).json()
    n_prompt = r["usage"]["prompt_tokens"]
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == n_prompt > 5 and plp[0] is None
    for entry in plp[1:]:
        assert 2 <= len(entry) <= 3 and all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
        assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2]
    scored = [max(e.items(), key=lambda kv: kv[1]["rank"]) if len(e) == 3 else None for e in plp[1:]]

    echo = raw(server, "POST", "/v1/completions", json={**body, "echo": True, "logprobs": 1}).json()["choices"][0]
    lp = echo["logprobs"]
    assert echo["text"].startswith(prompt) and len(echo["text"]) > len(prompt)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n_prompt + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == sorted(lp["text_offset"]) and "prompt_logprobs" not in echo
    for j, s in enumerate(scored, 1):  # the same scores as prompt_logprobs gave (where the token was not top-2)
        if s is not None:
            assert lp["token_logprobs"][j] == pytest.approx(s[1]["logprob"], abs=1e-6)
            assert lp["tokens"][j] == s[1]["decoded_token"]

    chunks = _sse_json(raw(server, "POST", "/v1/completions",
                           json={**body, "echo": True, "logprobs": 1, "stream": True}).text)
    streamed = {k: [] for k in lp}
    for c in chunks:
        for ch in c["choices"]:
            for k in lp:
                streamed[k] += ch["logprobs"][k]
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert streamed["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-6)
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == echo["text"]

    chat = raw(server, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    plain = raw(server, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                               "max_tokens": 2}).json()
    assert "prompt_logprobs" not in plain


@pytest.mark.parametrize(
    "path,body,status,param,needle",
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "temperature must be non-negative"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "'max_tokens' must be of type int"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2000}, 400, "max_tokens",
         "maximum context length is 1024 tokens. However, you requested 2001 tokens (1 in the prompt, 2000"),
        ("/v1/completions", {}, 400, "prompt", "'prompt' is required"),
        ("/v1/completions", {"prompt": [999999]}, 400, "prompt", "outside the vocabulary"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-17"}, 404, "model", "the model 'gpt-17' does not exist"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "'messages' must be a non-empty list"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
         "top_logprobs", "needs 'logprobs': true"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 0, "stream": True}, 400, "prompt_logprobs",
         "not available when 'stream' is true"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 21}, 400,
         "prompt_logprobs", "between 0 and 20"),
    ],
)
def test_client_errors_are_openai_shaped(server, path, body, status, param, needle):
    r = raw(server, "POST", path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"] and err["param"] == param
    assert "Traceback" not in r.text


def test_malformed_json_body_too_large_and_auth(server):
    ok = raw(server, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert ok.status_code == 200
    r = raw(server, "POST", "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = raw(server, "POST", "/v1/completions", json={"prompt": "x" * 30000})
    assert r.status_code == 413 and "error" in r.json()
    r = raw(server, "POST", "/v1/completions", auth=False, json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = raw(server, "GET", "/v1/models", auth=False, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert raw(server, "GET", "/health", auth=False).status_code == 200  # probes need no key


def test_concurrent_streams_and_async_client(server, model):
    async def one(ac, i):
        stream = await ac.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Number {i}"}],
                                                  max_tokens=8, temperature=0, stream=True)
        text = ""
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
        return text

    async def main():
        ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(*(one(ac, i) for i in range(32)))

    texts = asyncio.run(main())
    assert len(texts) == 32 and all(isinstance(t, str) for t in texts)


def _wait_idle(server, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = raw(server, "GET", "/metrics").text
        if metric(m, "appliance:num_requests_running") == 0 and metric(m, "appliance:kv_cache_usage_perc") == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"server did not return to idle:\n{m}")


def test_disconnect_mid_stream_frees_request_and_kv(server):
    _wait_idle(server)
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "Hello", "max_tokens": 900, "stream": True, "ignore_eos": True}, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # close the connection mid-stream
    m = _wait_idle(server)
    assert metric(m, "appliance:request_success_total", finished_reason="abort") >= 1


def test_metrics_names_and_labels(server):
    raw(server, "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    m = raw(server, "GET", "/metrics").text
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket", "iteration_tokens_bucket"]:
        assert f"appliance:{name}" in m, name
    assert 'profile="cpu"' in m and 'model_name="tiny-random-llama"' in m and "config_hash=" in m
    assert f'deployment="{raw(server, "GET", "/version").json()["deployment"]}"' in m
    assert metric(m, "appliance:generation_tokens_total") > 0


def test_prefix_cache_hits_and_reset(server, client, model):
    system = "A scheduler hands out tokens under one budget every step. " * 3
    before = metric(raw(server, "GET", "/metrics").text, "appliance:prefix_cache_hits_total")
    for q in ("one", "two"):
        client.completions.create(model=model, prompt=system + q, max_tokens=1, temperature=0)
    assert metric(raw(server, "GET", "/metrics").text, "appliance:prefix_cache_hits_total") > before
    _wait_idle(server)
    r = raw(server, "POST", "/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"reset": True}


def test_default_server_has_no_dev_endpoints_and_queue_limit():
    s = ServerProcess("model=tiny_random", "cache.kv_cache_memory_gib=0.05", "server.max_queue_len=1",
                      "scheduler.max_num_seqs=1")
    try:
        assert httpx.post(f"{s.url}/reset_prefix_cache").status_code == 404

        async def flood():
            async with httpx.AsyncClient(timeout=60) as ac:
                return await asyncio.gather(*(ac.post(f"{s.url}/v1/completions", json={
                    "prompt": "Hello", "max_tokens": 200, "ignore_eos": True}) for _ in range(8)))

        codes = [r.status_code for r in asyncio.run(flood())]
        assert 200 in codes and 503 in codes
        rejected = next(r for r in asyncio.run(flood()) if r.status_code == 503)
        assert rejected.headers["retry-after"] and rejected.json()["error"]["code"] == "queue_full"
    finally:
        s.stop()


def test_graceful_shutdown_finishes_in_flight_and_exits_zero():
    s = ServerProcess("model=tiny_random", "cache.kv_cache_memory_gib=0.05", "server.shutdown_timeout_s=30")
    try:
        result = {}

        async def request():
            async with httpx.AsyncClient(timeout=60) as ac:
                r = await ac.post(f"{s.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 300, "ignore_eos": True})
                result["r"] = r

        async def main():
            t = asyncio.create_task(request())
            await asyncio.sleep(0.5)
            code = await asyncio.to_thread(s.terminate)
            await t
            return code

        assert asyncio.run(main()) == 0
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 300
        assert "shut down cleanly" in s.output()
    finally:
        s.stop()


def test_core_death_is_detected():
    import os
    import signal

    s = ServerProcess("model=tiny_random", "cache.kv_cache_memory_gib=0.05", "server.core_restart_backoff_s=10")
    try:
        os.kill(s.core_pid(), signal.SIGKILL)  # restarted after 10 s (tests/integration/test_supervision.py)
        deadline = time.time() + 10
        while httpx.get(f"{s.url}/health").status_code == 200 and time.time() < deadline:
            time.sleep(0.1)
        assert httpx.get(f"{s.url}/health").status_code == 503
        assert httpx.get(f"{s.url}/ready").status_code == 503
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_restarting"
    finally:
        s.stop()


def test_default_model_chat_over_http():
    s = ServerProcess("cache.kv_cache_memory_gib=0.25", "model.max_model_len=2048")
    try:
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": CAPITAL_ONE_WORD}], "max_tokens": 20,
            "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        s.stop()


def test_dashboard_metric_names_exist(server):
    from tests.unit.test_docker import dashboard_metric_names

    names = dashboard_metric_names()
    assert len(names) >= 10
    exported = {line.split("{")[0].split(" ")[0] for line in raw(server, "GET", "/metrics").text.splitlines()
                if line and not line.startswith("#")}
    missing = sorted(n for n in names if n not in exported)
    assert not missing, missing


def test_request_timeout_aborts_and_answers_408():
    s = ServerProcess("model=tiny_random", "cache.kv_cache_memory_gib=0.05", "server.request_timeout_s=0.02")
    try:
        r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                       json={"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True})
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
        assert "server.request_timeout_s=0.02" in r.json()["error"]["message"]
        with httpx.stream("POST", f"{s.url}/v1/completions", timeout=60,
                          json={"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as st:
            lines = [ln for ln in st.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]" and "request_timeout" in lines[-2]
        deadline = time.time() + 10
        while time.time() < deadline:
            m = httpx.get(f"{s.url}/metrics").text
            if metric(m, "appliance:num_requests_running") == 0:
                break
            time.sleep(0.1)
        assert metric(m, "appliance:num_requests_running") == 0  # both requests were aborted in the core
    finally:
        s.stop()


# -- Anthropic's Messages API -------------------------------------------------------------
@pytest.fixture(scope="module")
def claude(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


GREEDY = {"temperature": 0}  # this client's create() has no temperature argument
# a number, not a string: the random model writes control characters into strings, which strict JSON refuses
WEATHER = {"name": "get_forecast", "description": "The forecast some days ahead",
           "input_schema": {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}},
                            "required": ["days"], "additionalProperties": False}}


def test_messages_through_the_anthropic_client(claude, client, model):
    """A Messages request is the chat request it means: the same prompt, the same greedy text, whole and
    streamed; its stop reasons and usage in Anthropic's terms."""
    ask = [{"role": "user", "content": "Hello there"}]
    m = claude.messages.create(model=model, max_tokens=6, messages=ask, system="Be brief.", extra_body=GREEDY)
    chat = client.chat.completions.create(model=model, max_tokens=6, extra_body=GREEDY,
                                          messages=[{"role": "system", "content": "Be brief."}, *ask])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.usage.input_tokens == chat.usage.prompt_tokens and m.usage.output_tokens == chat.usage.completion_tokens
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    with claude.messages.stream(model=model, max_tokens=6, messages=ask, system="Be brief.", extra_body=GREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == m.content[0].text and final.content[0].text == streamed
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens
    # a stop sequence inside the greedy text ends it there
    long = claude.messages.create(model=model, max_tokens=16, messages=ask, extra_body=GREEDY)
    text = long.content[0].text
    seq = text[4:7]
    cut = claude.messages.create(model=model, max_tokens=16, messages=ask, extra_body=GREEDY, stop_sequences=[seq])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == seq
    assert cut.content[0].text == text[: text.find(seq)]


def test_messages_tool_use_round_trip(claude, model):
    m = claude.messages.create(model=model, max_tokens=40, extra_body=GREEDY, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_forecast"},
                               messages=[{"role": "user", "content": "Forecast?"}])
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    assert use.name == "get_forecast" and use.id.startswith("toolu_") and 1 <= use.input["days"] <= 9
    with claude.messages.stream(model=model, max_tokens=40, extra_body=GREEDY, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_forecast"},
                                messages=[{"role": "user", "content": "Forecast?"}]) as s:
        final = s.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == use.input
    after = claude.messages.create(model=model, max_tokens=4, extra_body=GREEDY, tools=[WEATHER], messages=[
        {"role": "user", "content": "Forecast?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"},
                                     {"type": "text", "text": "And so?"}]}])
    assert after.content[0].type == "text"


def test_messages_errors_are_anthropic_shaped(server, claude, model):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in e.value.body["error"]["message"]
    for body, needle in [({"messages": [{"role": "user", "content": "x"}]}, "'max_tokens' is required"),
                         ({"max_tokens": 2, "messages": []}, "'messages' must be a non-empty list"),
                         ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "thinking": {}},
                          "'thinking' is not supported"),
                         ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens")]:
        r = raw(server, "POST", "/v1/messages", json=body)
        assert r.status_code == 400 and r.json()["type"] == "error" and needle in r.json()["error"]["message"], r.text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0).messages.create(
            model=model, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "x"}])


# -- OpenAI's Responses API ----------------------------------------------------------------
FORECAST_FN = {"type": "function", "name": WEATHER["name"], "description": WEATHER["description"],
               "parameters": WEATHER["input_schema"]}


def test_responses_through_the_openai_client(client, model):
    """A Responses request is the chat request it means: the same greedy text, whole and streamed as the
    client's typed events; a function call round trip through input items; text.format constrains."""
    ask = "Hello there"
    r = client.responses.create(model=model, input=ask, instructions="Be brief.", max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": ask}])
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    events = list(client.responses.create(model=model, input=ask, instructions="Be brief.", max_output_tokens=6,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{r.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    # a forced function call, its output sent back as input items
    call = client.responses.create(model=model, input="Forecast?", tools=[FORECAST_FN], max_output_tokens=40,
                                   tool_choice={"type": "function", "name": "get_forecast"}, temperature=0)
    [fc] = call.output
    assert fc.type == "function_call" and fc.name == "get_forecast" and 1 <= json.loads(fc.arguments)["days"] <= 9
    streamed = list(client.responses.create(model=model, input="Forecast?", tools=[FORECAST_FN], max_output_tokens=40,
                                            tool_choice={"type": "function", "name": "get_forecast"}, temperature=0,
                                            stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta") == fc.arguments
    with client.responses.stream(model=model, input="Forecast?", tools=[FORECAST_FN], max_output_tokens=40,
                                 tool_choice={"type": "function", "name": "get_forecast"}, temperature=0) as s:
        final = s.get_final_response()  # the client's own accumulation of the events (it wants them complete)
    assert final.status == "completed" and final.output[0].arguments == fc.arguments
    after = client.responses.create(model=model, tools=[FORECAST_FN], max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Forecast?"},
        {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}])
    assert after.output[0].type == "message"
    fmt = {"format": {"type": "json_schema", "name": "days", "schema": WEATHER["input_schema"]}}
    constrained = client.responses.create(model=model, input="Forecast?", text=fmt, max_output_tokens=40,
                                          temperature=0)
    assert 1 <= json.loads(constrained.output_text)["days"] <= 9


def test_responses_refuse_what_is_not_built(server, client, model):
    r = raw(server, "POST", "/v1/responses", json={"input": "x", "previous_response_id": "resp_none"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    for body, param in [({"input": "x", "store": "yes"}, "store"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
                        ({"input": [{"type": "input_image"}]}, "input[0]"), ({"input": []}, "input"),
                        ({"input": "x", "background": True}, "background")]:
        r = raw(server, "POST", "/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert raw(server, "POST", "/v1/responses", auth=False, json={"input": "x"}).status_code == 401


def test_stored_responses_continue_and_can_be_deleted(client, model):
    """previous_response_id continues a stored conversation exactly as sending it whole as input items does;
    retrieve and delete through the client; store=false keeps nothing."""
    import openai

    first = client.responses.create(model=model, input="Hello there", instructions="Be brief.", max_output_tokens=4,
                                    temperature=0)
    assert first.store is True and client.responses.retrieve(first.id).output_text == first.output_text
    nxt = client.responses.create(model=model, input="And then?", previous_response_id=first.id, max_output_tokens=4,
                                  instructions="Be brief.", temperature=0)
    whole = client.responses.create(model=model, max_output_tokens=4, instructions="Be brief.", temperature=0,
                                    store=False, input=[{"role": "user", "content": "Hello there"},
                                                        {"role": "assistant", "content": first.output_text},
                                                        {"role": "user", "content": "And then?"}])
    assert nxt.previous_response_id == first.id and nxt.output_text == whole.output_text
    assert nxt.usage.input_tokens == whole.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)  # store=false
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    streamed = list(client.responses.create(model=model, input="Hi", max_output_tokens=3, temperature=0,
                                            stream=True))
    assert client.responses.retrieve(streamed[-1].response.id).output_text == streamed[-1].response.output_text


# -- batch files ------------------------------------------------------------------------------
def _batch_lines(model):
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0}
    return [
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "c2", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": "Once upon", "max_tokens": 2, "temperature": 0}},
        "{not json",
        {"custom_id": "c3", "method": "POST", "url": "/v1/chat/completions", "body": {**chat, "temperature": -1}},
        {"custom_id": "c4", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "again"}},
        {"custom_id": "c5", "method": "POST", "url": "/v1/responses",
         "body": {"model": model, "input": "Hello", "max_output_tokens": 2, "temperature": 0, "store": False}},
    ]


def test_batch_files_run_in_order_and_resume(server, tmp_path, model):
    """Each line gets what the server answers it (errors too), in the input's order; a line that is no request
    gets an error of its own; a half-written output is taken up where it ends, its results kept as they are."""
    from appliance.server.batch import BatchError, run_batch

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in _batch_lines(model)) + "\n")
    headers = {"Authorization": f"Bearer {KEY}"}
    done = asyncio.run(run_batch(server.url, str(src), str(out), headers, max_concurrency=3, progress=False))
    assert done == {"lines": 7, "resumed_at": 0, "written": 7}
    res = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in res] == ["c1", "c2", None, "c3", "c4", "c1", "c5"]
    assert res[0]["response"]["status_code"] == 200 and res[0]["response"]["body"]["object"] == "chat.completion"
    assert res[1]["response"]["body"]["choices"][0]["text"] and res[6]["response"]["body"]["object"] == "response"
    assert res[3]["response"]["status_code"] == 400 and res[3]["response"]["body"]["error"]["param"] == "temperature"
    assert [r["error"]["code"] for r in (res[2], res[4], res[5])] == ["invalid_request"] * 3
    assert "given twice" in res[5]["error"]["message"] and res[2]["response"] is None
    # stopped after two results and part of the third: those two stay, the rest is done again
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][:10])
    again = asyncio.run(run_batch(server.url, str(src), str(out), headers, progress=False))
    assert again == {"lines": 7, "resumed_at": 2, "written": 5}
    resumed = out.read_text().splitlines(keepends=True)
    assert resumed[:2] == lines[:2] and [json.loads(x)["custom_id"] for x in resumed] == [r["custom_id"] for r in res]
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"custom_id": f"z{i}", "method": "POST", "url": "/v1/completions",
                                         "body": {}}) + "\n" for i in range(7)))
    with pytest.raises(BatchError, match="another batch's output"):
        asyncio.run(run_batch(server.url, str(other), str(out), headers, progress=False))


def test_run_batch_cli_starts_the_deployment_and_stops_it(tmp_path):
    from tests.conftest import run_cli

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in _batch_lines("tiny-random-llama")[:2]))
    r = run_cli("run-batch", "--input", str(src), "--output", str(out), "+profile=cpu", "model=tiny_random",
                "cache.kv_cache_memory_gib=0.05")
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["response"]["status_code"] for x in out.read_text().splitlines()] == [200, 200]
    r = run_cli("run-batch", "--input", str(src), "--output", str(out), "model=tiny_random")
    assert r.returncode == 0 and "already holds all 2 results" in r.stdout
    src.write_text(json.dumps({**_batch_lines("m")[0], "custom_id": "other"}) + "\n")
    r = run_cli("run-batch", "--input", str(src), "--output", str(out), "model=tiny_random")
    assert r.returncode != 0 and "holds 2 results but the input has 1 lines" in r.stderr


def test_beam_search_returns_the_engines_beams_whole_and_streamed(client, model):
    """vLLM's use_beam_search: the n best beams as the n choices, best first, the same as offline."""
    beam = {"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True}
    prompts = ["The quick brown fox jumps", "Counting: one two"]
    r = client.completions.create(model=model, prompt=prompts, max_tokens=8, n=3, extra_body=beam)
    llm = LLM(overrides=["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.01"])
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=8, length_penalty=0.5, early_stopping=True)
    ref = [o for out in llm.generate(prompts, params, use_tqdm=False) for o in out.outputs]
    assert [c.index for c in r.choices] == list(range(6)) and [c.text for c in r.choices] == [o.text for o in ref]
    assert [c.finish_reason for c in r.choices] == [o.finish_reason for o in ref]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in ref)
    texts = ["" for _ in range(6)]
    for chunk in client.completions.create(model=model, prompt=prompts, max_tokens=8, n=3, extra_body=beam,
                                           stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [o.text for o in ref]
    msgs = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, n=2,
                                          extra_body={"use_beam_search": True})
    offline = llm.chat(msgs, SamplingParams(n=2, use_beam_search=True, max_tokens=6), use_tqdm=False)[0].outputs
    assert [c.message.content for c in chat.choices] == [o.text for o in offline]
    for body, param in (({"temperature": 0.7}, "temperature"), ({"stop": ["x"]}, "stop"), ({"n": 11}, "n"),
                        ({"early_stopping": "sometimes"}, "early_stopping"), ({"length_penalty": 2.0}, None)):
        extra = {"use_beam_search": param is not None, **{k: v for k, v in body.items() if k != "n"}}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="x", max_tokens=2, n=body.get("n", 2), extra_body=extra)
        assert e.value.body["param"] == (param or "length_penalty")
