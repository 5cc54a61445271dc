"""Structured outputs and tool calling through `appliance run` with the real
SmolLM2 model and the official openai client: JSON schemas hold and
validate, Pydantic parsing, regex and choice constraints under sampling,
forced tool calls whose arguments validate, streamed tool-call deltas that
reassemble into the whole response, and bad constraints refused with 400
while the engine keeps serving. On the tiny model, what a constraint may
cost: an oversized or too deeply nested schema refused at once with the
engine core's memory unchanged, a compile past its timeout refused alone
while other requests are answered, schemas referring outside themselves,
and choices of control characters held exactly."""

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.integration.server_helpers import ServerProcess, metric

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}},
     "required": ["price"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                               "maximum": 5}, "maxItems": 4}},
     "required": ["scores"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 12}, "last": {"type": "string", "maxLength": 12}},
        "required": ["first", "last"]}}, "required": ["user"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": -10,
                                                                      "maximum": 10}}, "required": ["x", "y"]}},
     "required": ["point"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
     "required": ["status", "count"]},
    {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 30}},
     "required": ["email"]},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 3, "maxLength": 15},
                                      "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
     "required": ["title", "year"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                          {"type": "null"}]}}, "required": ["value"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "name": {"type": "string", "maxLength": 8}}, "required": ["id", "name"]}}},
     "required": ["items"]},
    {"type": "object", "properties": {"level": {"type": "string", "enum": ["low", "mid", "high"]},
                                      "urgent": {"type": "boolean"}}, "required": ["level", "urgent"]},
    {"type": "object", "properties": {"ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
     "required": ["ratio"]},
    {"$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                        "name": {"type": "string", "maxLength": 10}},
                       "required": ["kind", "name"]}},
     "type": "object", "properties": {"pet": {"$ref": "#/$defs/pet"}}, "required": ["pet"]},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("server.max_queue_len=64")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, **kw):
    kw.setdefault("max_tokens", 160)
    return client.chat.completions.create(model="smollm2-135m-instruct", messages=kw.pop("messages", ASK), **kw)


def test_twenty_json_schemas_hold(client):
    def one(i):
        r = chat(client, messages=[{"role": "user", "content": "Answer in JSON."}], temperature=0,
                 response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i],
                                                                         "strict": True}})
        return r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(one, range(len(SCHEMAS))))
    for schema, c in zip(SCHEMAS, choices):
        assert c.finish_reason == "stop", (schema, c.message.content)
        jsonschema.validate(json.loads(c.message.content), schema)


def test_pydantic_parse(client):
    class City(BaseModel):
        name: str
        population: int
        coastal: bool

    r = client.beta.chat.completions.parse(model="smollm2-135m-instruct", max_tokens=120, temperature=0,
                                           messages=[{"role": "user", "content": "Describe a city."}],
                                           response_format=City)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and isinstance(parsed.population, int)


def test_regex_and_choice_hold_under_sampling(client):
    def regex(_):
        r = client.completions.create(model="smollm2-135m-instruct", prompt="A product code:", max_tokens=20,
                                      temperature=1.0, n=10, extra_body={"structured_outputs": {
                                          "regex": r"[A-Z]{2}-[0-9]{3}"}})
        return [c.text for c in r.choices]

    def choice(_):
        r = chat(client, messages=[{"role": "user", "content": "Pick a colour."}], temperature=1.0, n=10,
                 max_tokens=8, extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
        return [c.message.content for c in r.choices]

    with ThreadPoolExecutor(4) as pool:
        codes = sum(pool.map(regex, range(5)), [])
        colours = sum(pool.map(choice, range(5)), [])
    assert len(codes) == 50 and all(re.fullmatch(r"[A-Z]{2}-[0-9]{3}", t) for t in codes), codes
    assert len(colours) == 50 and set(colours) <= {"red", "green", "blue"}, colours


def test_legacy_guided_fields_and_json_object(client):
    r = chat(client, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = chat(client, temperature=0, max_tokens=200, response_format={"type": "json_object"},
             messages=[{"role": "user", "content": "Give a JSON object with a name."}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a small model may go on nesting until max_tokens: what it wrote is still an object's start
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_required_tool_call_validates(client):
    r = chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
    for call in c.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert call.id.startswith("call_") and call.type == "function"


def test_named_tool_call_and_the_result_round_trip(client):
    r = chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
             temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    follow = chat(client, tools=[WEATHER, TIME], temperature=0, max_tokens=20, messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_deltas_reassemble_into_the_whole_response(client, choice):
    whole = chat(client, tools=[WEATHER, TIME], tool_choice=choice, temperature=0).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chat(client, tools=[WEATHER, TIME], tool_choice=choice, temperature=0, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.function.name  # the name comes first
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert finish == whole.finish_reason


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "Unsupported type"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "Unclosed"),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs.grammar", "not defined"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "structured_outputs.json",
     "uniqueItems"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "only one"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "only one"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "JSON schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "unknown"),
    # SmolLM2's vocabulary has no token holding U+0004: the mask after "ok" would allow nothing
    ({"structured_outputs": {"choice": ["yes", "ok\x04"]}}, "structured_outputs.choice", "cannot be written"),
    ({"guided_choice": ["\x04"]}, "guided_choice", "cannot be written"),
]


def test_bad_constraints_get_400_and_the_engine_keeps_serving(server, client):
    for extra, param, message in BAD:
        body = {"model": "smollm2-135m-instruct", "messages": ASK, "max_tokens": 4, **extra}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], (extra, err)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "smollm2-135m-instruct", "prompt": "x",
                                                          "tools": [WEATHER]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert chat(client, max_tokens=4, temperature=0).choices[0].finish_reason == "length"
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert metric(text, "appliance:grammar_compile_seconds_count") >= 1


def test_control_characters_smollm2_can_write_are_chosen_exactly(client):
    choices = ["\x01", "x\ty", "a\x00b", "\x7f!"]
    r = chat(client, messages=[{"role": "user", "content": "Pick one."}], temperature=1.0, n=8, max_tokens=8,
             extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in r.choices), r.choices


# -- what a constraint may cost (the tiny model) -------------------------------------------
TINY_MODEL = "tiny-random-llama"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def tiny():
    s = ServerProcess("model=tiny_random", "cache.kv_cache_memory_gib=0.05", "structured_output.compile_timeout_s=0.5")
    yield s
    s.stop()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def tiny_chat(server, timeout=60, **extra):
    body = {"model": TINY_MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 24,
            "temperature": 0, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


def schema_format(schema, name="s"):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}


def assert_refused(r, param, *words):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err


def test_an_oversized_or_deep_schema_is_refused_at_once_and_the_core_stays_small(tiny):
    assert tiny_chat(tiny, **schema_format(PERSON)).status_code == 200  # grammars compiled, helper started
    core = tiny.core_pid()
    before = rss_mib(core)
    huge = {"type": "object", "properties": {f"field_{i:05d}": {"type": "string", "description": "x" * 50}
                                             for i in range(12_000)}}
    assert len(json.dumps(huge)) > 1_000_000
    t0 = time.monotonic()
    r = tiny_chat(tiny, **schema_format(huge))
    assert time.monotonic() - t0 < 10
    assert_refused(r, "response_format", "structured_output.max_schema_bytes=262144", "bytes")
    deep = '{"type": "array", "items": ' * 100 + '{"type": "integer"}' + "}" * 100  # as text: no body limit applies
    assert_refused(tiny_chat(tiny, structured_outputs={"json": deep}), "structured_outputs.json",
                   "structured_output.max_schema_depth=64")
    assert_refused(tiny_chat(tiny, guided_choice=["x" * 200_000, "y" * 100_000]), "guided_choice",
                   "choices together are 300000 bytes")
    assert rss_mib(core) - before < 32, (before, rss_mib(core))
    r = tiny_chat(tiny, **schema_format(PERSON))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_compile_past_its_timeout_fails_alone_while_others_are_answered(tiny):
    core = tiny.core_pid()
    before = rss_mib(core)
    # 8,000 properties (about 240 kB, under max_schema_bytes) take seconds to compile, past the 0.5 s allowed
    slow = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(8000)}}
    assert len(json.dumps(slow)) < 262144

    def timed(extra):
        t0 = time.monotonic()
        return tiny_chat(tiny, **extra), time.monotonic() - t0

    with ThreadPoolExecutor(3) as pool:
        refused = pool.submit(timed, schema_format(slow))
        time.sleep(0.2)
        constrained = pool.submit(timed, {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
        free = pool.submit(timed, {"max_tokens": 4})
        (r, took), (c, c_took), (f, _) = refused.result(), constrained.result(), free.result()
    assert_refused(r, "response_format", "took longer than structured_output.compile_timeout_s=0.5 s")
    assert took < 10, took
    assert c.status_code == 200 and re.fullmatch(r"[0-9]{3}-[a-z]{2}", c.json()["choices"][0]["message"]["content"])
    assert c_took < 10 and f.status_code == 200  # the trial ran beside the slow one (see the unit tests' timings)
    assert rss_mib(core) - before < 32, (before, rss_mib(core))  # the core never compiled it
    assert_refused(tiny_chat(tiny, **schema_format(slow)), "response_format", "compile_timeout_s")  # again


@pytest.mark.parametrize("ref", ["http://example.com/person.json", "file:///etc/passwd", "person.json#/defs/a",
                                 "#person"])
def test_a_schema_referring_outside_itself_is_refused(tiny, ref):
    schema = {"type": "object", "properties": {"who": {"$ref": ref}}, "required": ["who"]}
    assert_refused(tiny_chat(tiny, **schema_format(schema)), "response_format", "refers outside itself", ref)
    assert_refused(tiny_chat(tiny, structured_outputs={"json": schema}), "structured_outputs.json", ref)
    local = {"$defs": {"p": PERSON}, "type": "object", "properties": {"who": {"$ref": "#/$defs/p"}},
             "required": ["who"]}
    assert tiny_chat(tiny, **schema_format(local)).status_code == 200


def test_choices_of_control_characters_hold_exactly(tiny):
    choices = ["a\x00b", "\x04", "x\x1fy", "tab\there", "new\nline", "\x7f", 'q"uote\\']
    r = tiny_chat(tiny, structured_outputs={"choice": choices}, n=16, temperature=1.0, max_tokens=12, seed=3)
    assert r.status_code == 200, r.text
    got = [c["message"]["content"] for c in r.json()["choices"]]
    assert all(c["finish_reason"] == "stop" for c in r.json()["choices"]) and set(got) <= set(choices), got
