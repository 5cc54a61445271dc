"""vLLM's request fields and endpoints beyond OpenAI's, on the HTTP front
end in-process over a scripted engine client (what reaches the engine is
recorded): /tokenize and /detokenize, chat template arguments and the
deployment's own template, continuing a final message, prompt
truncation, token ids in responses, and reasoning apart from the answer."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.engine.outputs import TokenLogprob
from appliance.server.reasoning import REASONING_PARSERS, ReasoningSplit, split
from tests.integration.server_helpers import ScriptedClient, scripted_front_end

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "What is 2 + 2?"}]
# Qwen3's way with thinking, on the tiny model's turn markers: enable_thinking false closes an empty reasoning in
# the prompt; reasoning_effort goes into a system line
TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "thinking.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def front_end(template_file):
    return scripted_front_end([f"model.chat_template={template_file}"])


def sse(text):
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def prompt_of(front_end, body, path=CHAT):
    """The token ids a request hands the engine."""
    client = ScriptedClient([{"finished": True, "finish_reason": "stop"}])
    with front_end(client) as c:
        r = c.post(path, json={"max_tokens": 4, **body})
        assert r.status_code == 200, r.text
    return client.requests[0][0]


def error(r, status=400):
    assert r.status_code == status, r.text
    return r.json()["error"]


# -- /tokenize and /detokenize --------------------------------------------------------
def test_tokenize_a_prompt_and_messages_as_requests_render_them(front_end):
    tok = front_end.tokenizer
    with front_end(ScriptedClient([])) as c:
        r = c.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
        assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"]) and r["max_model_len"] == 1024
        plain = c.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
        assert plain["tokens"] == tok.encode("Hello world", add_special_tokens=False) and plain["token_strs"] is None
        chat = c.post("/tokenize", json={"messages": MSGS}).json()
        assert c.post("/detokenize", json={"tokens": chat["tokens"]}).json() == {"prompt": tok.decode(chat["tokens"])}
        assert c.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
        assert error(c.post("/tokenize", json={"prompt": "x", "messages": MSGS}))["param"] == "prompt"
        assert error(c.post("/tokenize", json={}))["param"] == "prompt"
        assert error(c.post("/tokenize", json={"prompt": 5}))["param"] == "prompt"
        assert error(c.post("/detokenize", json={"tokens": [512]}))["param"] == "tokens"
        assert error(c.post("/detokenize", json={"tokens": "12"}))["param"] == "tokens"
        assert error(c.post("/tokenize", json={"prompt": "x", "model": "other"}), 404)["param"] == "model"
    assert prompt_of(front_end, {"messages": MSGS}) == chat["tokens"]  # what a chat request runs


# -- chat templates --------------------------------------------------------------------
def test_chat_template_arguments_reach_the_deployments_template(front_end):
    tok = front_end.tokenizer
    thinking = tok.decode(prompt_of(front_end, {"messages": MSGS}))
    assert thinking.endswith("<|im_start|>assistant\n") and "Reasoning:" not in thinking
    closed = tok.decode(prompt_of(front_end, {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}}))
    assert closed == thinking + "<think>\n\n</think>\n\n"
    effort = tok.decode(prompt_of(front_end, {"messages": MSGS, "reasoning_effort": "low"}))
    assert effort.startswith("<|im_start|>system\nReasoning: low<|im_end|>")
    assert prompt_of(front_end, {"messages": MSGS, "reasoning_effort": "low"}) == prompt_of(
        front_end, {"messages": MSGS, "chat_template_kwargs": {"reasoning_effort": "low"}})
    with front_end(ScriptedClient([])) as c:
        for extra, param, needle in [
            ({"chat_template_kwargs": {"enable_thinkin": False}}, "chat_template_kwargs", "does not read 'enable_thinkin'"),
            ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "set by the server"),
            ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "must be of type dict"),
            ({"reasoning_effort": "max"}, "reasoning_effort", "one of low, medium, high"),
            ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "reasoning_effort",
             "disagree"),
            ({"chat_template": "{{ messages }}"}, "chat_template", "model.chat_template"),
            ({"continue_final_message": True}, "continue_final_message", "'add_generation_prompt': false"),
        ]:
            err = error(c.post(CHAT, json={"messages": MSGS, "max_tokens": 2, **extra}))
            assert err["param"] == param and needle in err["message"], (extra, err)
        for extra in ({"chat_template_kwargs": {"enable_thinking": True}}, {"reasoning_effort": "low"}):
            err = error(c.post(CMPL, json={"prompt": "Hi", "max_tokens": 2, **extra}))
            assert "only available on /v1/chat/completions" in err["message"]


def test_the_checkpoints_template_reads_no_arguments():
    with scripted_front_end([])(ScriptedClient([])) as c:
        err = error(c.post(CHAT, json={"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}}))
        assert "(it reads: " in err["message"] and "enable_thinking" in err["message"]


def test_continue_final_message_extends_the_assistants_text(front_end):
    tok = front_end.tokenizer
    msgs = [*MSGS, {"role": "assistant", "content": "The answer is"}]
    ids = prompt_of(front_end, {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True})
    assert tok.decode(ids).endswith("<|im_start|>assistant\nThe answer is")


# -- prompt truncation --------------------------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_last_tokens(front_end):
    tok = front_end.tokenizer
    full = tok.encode("The quick brown fox jumps over the lazy dog.")
    assert prompt_of(front_end, {"prompt": full, "truncate_prompt_tokens": 4}, CMPL) == full[-4:]
    assert prompt_of(front_end, {"prompt": "The quick brown fox jumps over the lazy dog.",
                                 "truncate_prompt_tokens": 100}, CMPL) == full  # shorter already
    chat = prompt_of(front_end, {"messages": MSGS})
    assert prompt_of(front_end, {"messages": MSGS, "truncate_prompt_tokens": 3}) == chat[-3:]
    assert prompt_of(front_end, {"messages": MSGS, "truncate_prompt_tokens": -1}) == chat  # the context length
    client = ScriptedClient([{"new_text": "!", "finished": True, "finish_reason": "stop"}])
    with front_end(client) as c:
        echoed = c.post(CMPL, json={"prompt": "The quick brown fox jumps over the lazy dog.", "truncate_prompt_tokens": 2,
                                    "echo": True, "max_tokens": 1}).json()
        assert echoed["choices"][0]["text"] == tok.decode(full[-2:]) + "!"  # what ran, not what was sent
        for k in (0, -2, 1025, "3"):
            assert error(c.post(CMPL, json={"prompt": "Hi", "truncate_prompt_tokens": k}))["param"] == \
                "truncate_prompt_tokens"


# -- token ids in responses -----------------------------------------------------------------
SCRIPT = [{"new_token_ids": [5, 6], "new_text": "ab", "num_output_tokens": 2,
           "logprobs": [TokenLogprob(5, -0.5, 1, [(5, -0.5)]), TokenLogprob(6, -0.25, 1, [(6, -0.25)])]},
          {"new_token_ids": [7], "new_text": "", "num_output_tokens": 3,  # a part of a character: no text yet
           "logprobs": [TokenLogprob(7, -1.0, 2, [(9, -0.5)])]},
          {"new_token_ids": [8], "new_text": "c", "finished": True, "finish_reason": "length", "num_output_tokens": 4,
           "logprobs": [TokenLogprob(8, -0.125, 1, [(8, -0.125)])]}]


def test_return_token_ids_whole_and_streamed(front_end):
    client = ScriptedClient(SCRIPT)
    with front_end(client) as c:
        body = c.post(CMPL, json={"prompt": "Hello", "max_tokens": 4, "return_token_ids": True}).json()
        prompt = client.requests[-1][0]
        assert body["choices"][0]["prompt_token_ids"] == prompt and body["choices"][0]["token_ids"] == [5, 6, 7, 8]
        chunks = sse(c.post(CMPL, json={"prompt": "Hello", "max_tokens": 4, "return_token_ids": True,
                                        "stream": True}).text)
        assert [ch["choices"][0]["token_ids"] for ch in chunks] == [[5, 6], [7], [8]]  # the textless delta too
        assert [ch["choices"][0]["prompt_token_ids"] for ch in chunks] == [prompt, None, None]
        chat = c.post(CHAT, json={"messages": MSGS, "max_tokens": 4, "return_token_ids": True}).json()
        assert chat["prompt_token_ids"] == client.requests[-1][0] and chat["choices"][0]["token_ids"] == [5, 6, 7, 8]
        chunks = sse(c.post(CHAT, json={"messages": MSGS, "max_tokens": 4, "return_token_ids": True,
                                        "stream": True}).text)
        assert chunks[0]["prompt_token_ids"] == client.requests[-1][0]
        assert [t for ch in chunks[1:] for t in ch["choices"][0]["token_ids"]] == [5, 6, 7, 8]
        plain = c.post(CHAT, json={"messages": MSGS, "max_tokens": 4}).json()
        assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
        # logprobs naming tokens by id: a token that is part of a character is still told apart
        lp = c.post(CHAT, json={"messages": MSGS, "max_tokens": 4, "logprobs": True, "top_logprobs": 1,
                                "return_tokens_as_token_ids": True}).json()["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in lp] == ["token_id:5", "token_id:6", "token_id:7", "token_id:8"]
        assert lp[2]["top_logprobs"][0]["token"] == "token_id:9" and lp[2]["bytes"] == list(b"token_id:7")
        legacy = c.post(CMPL, json={"prompt": "Hello", "max_tokens": 4, "logprobs": 1,
                                    "return_tokens_as_token_ids": True}).json()["choices"][0]["logprobs"]
        assert legacy["tokens"] == ["token_id:5", "token_id:6", "token_id:7", "token_id:8"]
        assert error(c.post(CHAT, json={"messages": MSGS, "return_token_ids": 1}))["param"] == "return_token_ids"


# -- reasoning -----------------------------------------------------------------------------
@pytest.mark.parametrize("parser, text, reasoning, answer", [
    ("deepseek_r1", "I add.</think>4", "I add.", "4"),
    ("deepseek_r1", "<think>I add.</think>4", "I add.", "4"),
    ("deepseek_r1", "still thinking", "still thinking", ""),
    ("deepseek_r1", "", None, ""),
    ("qwen3", "<think>\nI add.\n</think>\n\n4", "\nI add.\n", "\n\n4"),
    ("qwen3", "4, no thinking", None, "4, no thinking"),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "<think>cut short", "cut short", ""),
])
def test_reasoning_parsers_split_the_text(parser, text, reasoning, answer):
    assert split(REASONING_PARSERS[parser], text) == (reasoning, answer)


@settings(max_examples=200, deadline=None, database=None)
@given(parser=st.sampled_from(sorted(REASONING_PARSERS)),
       text=st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", "\n", "</thi"]),
                     max_size=8).map("".join),
       cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=5))
def test_reasoning_streamed_in_any_pieces_adds_up_to_the_whole(parser, text, cuts):
    p = REASONING_PARSERS[parser]
    s = ReasoningSplit(p)
    got_r, got_a = "", ""
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    for a, b in zip(bounds, bounds[1:]):
        r, t = s.feed(text[a:b])
        got_r, got_a = got_r + r, got_a + t
    r, t = s.finish()
    whole_r, whole_a = split(p, text)
    assert (got_r + r, got_a + t) == (whole_r or "", whole_a)


THOUGHT = [{"new_text": "<thi"}, {"new_text": "nk>2 and 2</th"}, {"new_text": "ink>"},
           {"new_text": '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'},
           {"new_text": "", "finished": True, "finish_reason": "stop"}]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def test_reasoning_comes_apart_from_the_answer_and_its_tool_calls():
    make = scripted_front_end(["server.reasoning_parser=qwen3"])
    with make(ScriptedClient(THOUGHT)) as c:
        msg = c.post(CHAT, json={"messages": MSGS, "tools": [TOOL]}).json()["choices"][0]["message"]
        assert msg["reasoning_content"] == "2 and 2" and msg["content"] is None
        assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
        chunks = sse(c.post(CHAT, json={"messages": MSGS, "tools": [TOOL], "stream": True}).text)
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "2 and 2"
        assert not any(d.get("content") for d in deltas)
        assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["add"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    with make(ScriptedClient([{"new_text": "4", "finished": True, "finish_reason": "stop"}])) as c:
        msg = c.post(CHAT, json={"messages": MSGS}).json()["choices"][0]["message"]
        assert msg == {"role": "assistant", "content": "4", "reasoning_content": None}
    with scripted_front_end([])(ScriptedClient(THOUGHT[:3] + THOUGHT[4:])) as c:  # no parser: all of it is content
        msg = c.post(CHAT, json={"messages": MSGS}).json()["choices"][0]["message"]
        assert msg == {"role": "assistant", "content": "<think>2 and 2</think>"}


def _events(text):
    """(event name, data) of an SSE stream that names its events."""
    out = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_reasoning_in_messages_and_responses():
    """A thinking block / a reasoning item before the answer's tool call, whole and streamed."""
    make = scripted_front_end(["server.reasoning_parser=qwen3"])
    anthropic_tool = {"name": "add", "input_schema": {"type": "object"}}
    with make(ScriptedClient(THOUGHT)) as c:
        body = {"messages": MSGS, "max_tokens": 20, "tools": [anthropic_tool]}
        m = c.post("/v1/messages", json=body).json()
        assert [b["type"] for b in m["content"]] == ["thinking", "tool_use"] and m["stop_reason"] == "tool_use"
        assert m["content"][0]["thinking"] == "2 and 2" and m["content"][1]["input"] == {"a": 2}
        events = _events(c.post("/v1/messages", json={**body, "stream": True}).text)
        assert "".join(d["delta"]["thinking"] for e, d in events if e == "content_block_delta"
                       and d["delta"]["type"] == "thinking_delta") == "2 and 2"
        assert [d["content_block"]["type"] for e, d in events if e == "content_block_start"] == ["thinking", "tool_use"]
        assert events[-1][0] == "message_stop"
        r = c.post("/v1/responses", json={"input": "What is 2 + 2?", "tools": [TOOL["function"] | {"type": "function"}],
                                          "store": False}).json()
        assert [it["type"] for it in r["output"]] == ["reasoning", "function_call"]
        assert r["output"][0]["content"][0]["text"] == "2 and 2" and r["output"][1]["arguments"] == '{"a": 2}'
        events = _events(c.post("/v1/responses", json={"input": "What is 2 + 2?", "stream": True, "store": False,
                                                       "tools": [TOOL["function"] | {"type": "function"}]}).text)
        assert "".join(d["delta"] for e, d in events if e == "response.reasoning_text.delta") == "2 and 2"
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
        def strip(items):  # ids are each response's own
            return [{k: v for k, v in it.items() if k not in ("id", "call_id")} for it in items]

        assert strip(events[-1][1]["response"]["output"]) == strip(r["output"])
