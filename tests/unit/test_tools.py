import json
import random
import re

import jsonschema
import pytest

from appliance.server.protocol import OpenAIError
from appliance.server.tool_requests import TOOL_PARSERS, ToolRequest, parse_tools
from appliance.server.tools import ContentDelta, ToolCall, ToolCallDelta, ToolCallStream, extract_tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def error(body: dict) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse_tools(body)
    assert info.value.status == 400 and info.value.message
    return info.value


# ---------------------------------------------------------------------------------------------------
# Request parsing


@pytest.mark.parametrize("body", [{}, {"tools": None}, {"tools": []}, {"tools": [], "tool_choice": "none"},
                                  {"functions": [], "function_call": "none"}])
def test_no_tools(body):
    assert parse_tools(body) is None


def test_tools_default_to_auto_and_are_kept_as_sent():
    request = parse_tools({"tools": [WEATHER, TIME]})
    assert request == ToolRequest([WEATHER, TIME], "auto", None)
    assert request.tools[0] is WEATHER
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}).choice == "none"
    assert parse_tools({"tools": [WEATHER], "tool_choice": "required"}).choice == "required"
    choice = {"type": "function", "function": {"name": "get_time"}}
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": choice})
    assert (named.choice, named.function) == ("named", "get_time")


def test_optional_function_fields_may_be_null():
    tool = {"type": "function", "function": {"name": "f", "description": None, "parameters": None, "strict": None}}
    assert parse_tools({"tools": [tool]}).parameters("f") == {"type": "object"}


@pytest.mark.parametrize("body, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": ["get_weather"]}, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "get weather"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": 7}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}, "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [WEATHER, TIME, WEATHER]}, "tools[2].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER], "functions": [TIME["function"]]}, "functions"),
    ({"functions": [TIME["function"]], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "function_call": "auto"}, "function_call"),
    ({"functions": [{"name": "a b"}]}, "functions[0].name"),
    ({"functions": [TIME["function"], TIME["function"]]}, "functions[1].name"),
    ({"functions": [TIME["function"]], "function_call": "required"}, "function_call"),
    ({"functions": [TIME["function"]], "function_call": {"name": "get_weather"}}, "function_call"),
])
def test_client_mistakes_name_their_field(body, param):
    assert error(body).param == param


def test_legacy_functions_map_onto_tools():
    functions = [WEATHER["function"], TIME["function"]]
    request = parse_tools({"functions": functions})
    assert request == ToolRequest([WEATHER, TIME], "auto", None)
    assert parse_tools({"functions": functions, "function_call": "none"}).choice == "none"
    assert parse_tools({"functions": functions, "function_call": "auto"}).choice == "auto"
    named = parse_tools({"functions": functions, "function_call": {"name": "get_weather"}})
    assert (named.choice, named.function) == ("named", "get_weather")
    assert named.constraint_schema() == WEATHER["function"]["parameters"]


# ---------------------------------------------------------------------------------------------------
# Constraint schemas


def valid(schema: dict, instance) -> bool:
    return not list(jsonschema.Draft202012Validator(schema).iter_errors(instance))


def test_constraint_schema_named_is_the_parameters():
    request = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                     "function": {"name": "get_weather"}}})
    schema = request.constraint_schema()
    assert schema == WEATHER["function"]["parameters"]
    assert valid(schema, {"location": "Paris"}) and not valid(schema, {"city": "Paris"})
    assert parse_tools({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
                       ).constraint_schema() == {"type": "object"}


def test_constraint_schema_required_is_an_array_of_calls():
    schema = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}).constraint_schema()
    assert schema == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]}, "parameters": {"type": "object"}},
         "required": ["name", "parameters"]}]}}
    assert list(schema["items"]["anyOf"][0]["properties"]) == ["name", "parameters"]
    assert valid(schema, [{"name": "get_weather", "parameters": {"location": "Paris"}},
                          {"name": "get_time", "parameters": {}}])
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "get_date", "parameters": {}}],
                [{"name": "get_time"}], {"name": "get_time", "parameters": {}}):
        assert not valid(schema, bad)


def test_constraint_schema_none_for_free_choices():
    assert parse_tools({"tools": [WEATHER]}).constraint_schema() is None
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}).constraint_schema() is None
    with pytest.raises(KeyError):
        parse_tools({"tools": [WEATHER]}).parameters("get_time")


# ---------------------------------------------------------------------------------------------------
# Output: whole responses, and streams that reassemble into them


def reassemble(deltas: list) -> tuple:
    """(content, [(id, name, arguments)]) from deltas, checking the shape of each call's deltas."""
    content, calls = [], {}
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            assert delta.text
            content.append(delta.text)
        elif delta.index not in calls:
            assert delta.index == len(calls) and CALL_ID.fullmatch(delta.id) and delta.name
            calls[delta.index] = [delta.id, delta.name, delta.arguments]
        else:
            assert delta.id is None and delta.name is None and delta.arguments
            calls[delta.index][2] += delta.arguments
    return "".join(content) or None, [tuple(call) for call in calls.values()]


def splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def stream(mode: str, parser: str, function, pieces: list[str]) -> tuple[ToolCallStream, list]:
    s = ToolCallStream(mode, parser, function)
    deltas = [delta for piece in pieces for delta in s.feed(piece)] + s.finish()
    return s, deltas


ARGS_TRICKY = '{"q": "a {b} [c] \\"quoted\\" </tool_call> \\\\", "n": [1, {"x": null}], "ok": true}'
CASES = [
    # mode, parser, function, text, content, [(name, arguments)]
    ("auto", "hermes", None, "Just an answer.\n", "Just an answer.\n", []),
    ("auto", "hermes", None, "a < b and <tool is not a tag", "a < b and <tool is not a tag", []),
    ("auto", "hermes", None, '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>',
     None, [("get_weather", '{"location": "Paris"}')]),
    ("auto", "hermes", None,
     'Let me check.\n\n<tool_call>\n{"name": "search", "arguments": ' + ARGS_TRICKY + '}\n</tool_call>\n'
     '<tool_call>\n{"arguments": {"location": "Oslo"}, "id": 3, "name": "get_weather"}\n</tool_call>\n\n'
     'Done.  \n<tool_call>{"name":"get_time"}</tool_call>  \n',
     "Let me check.Done.", [("search", ARGS_TRICKY), ("get_weather", '{"location": "Oslo"}'), ("get_time", "{}")]),
    ("auto", "hermes", None, ' \n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\n', None, [("f", "{}")]),
    ("auto", "hermes", None, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', None, [("f", '{"a": 1}')]),
    ("auto", "llama3_json", None, '{"name": "get_weather", "parameters": {"location": "Paris"}}', None,
     [("get_weather", '{"location": "Paris"}')]),
    ("auto", "llama3_json", None,
     '\n<|python_tag|>{"name": "search", "parameters": ' + ARGS_TRICKY + '} ;\n{"parameters": {}, "name": "g"};'
     '{"name": "h", "arguments": {"z": -1.5e3}}',
     None, [("search", ARGS_TRICKY), ("g", "{}"), ("h", '{"z": -1.5e3}')]),
    ("auto", "llama3_json", None, "  The answer is {42}.", "  The answer is {42}.", []),
    ("auto", "llama3_json", None, "<|eot|> not a tag", "<|eot|> not a tag", []),
    ("auto", "llama3_json", None, " \n ", None, []),
    ("required", "hermes", None,
     '[{"name": "search", "parameters": ' + ARGS_TRICKY + '}, {"name": "get_time", "arguments": {}}]',
     None, [("search", ARGS_TRICKY), ("get_time", "{}")]),
    ("required", "hermes", None, ' [ {"parameters" : {"location": "Rome"} , "name" : "get_weather"} ] ',
     None, [("get_weather", '{"location": "Rome"}')]),
    ("named", "hermes", "get_weather", '{"location": "Paris, \\"FR\\" {}"}', None,
     [("get_weather", '{"location": "Paris, \\"FR\\" {}"}')]),
]


@pytest.mark.parametrize("mode, parser, function, text, content, calls", CASES)
def test_whole_response(mode, parser, function, text, content, calls):
    got_content, got_calls = extract_tool_calls(mode, parser, function, text)
    assert got_content == content
    assert [(call.name, call.arguments) for call in got_calls] == calls
    for call in got_calls:
        assert CALL_ID.fullmatch(call.id)
        json.loads(call.arguments)
    assert len({call.id for call in got_calls}) == len(got_calls)


@pytest.mark.parametrize("mode, parser, function, text, content, calls", CASES)
def test_stream_reassembles_to_whole_response(mode, parser, function, text, content, calls):
    for pieces in [[text], list(text)] + [splits(text, seed) for seed in range(6)]:
        s, deltas = stream(mode, parser, function, pieces)
        got_content, got_calls = reassemble(deltas)
        assert not s.failed
        assert got_content == s.content == content
        assert [(name, arguments) for _, name, arguments in got_calls] == calls
        assert [(c.id, c.name, c.arguments) for c in s.calls] == got_calls
        if content is None or "<" not in content:  # no partial tag ever goes out as content
            assert all("<" not in delta.text for delta in deltas if isinstance(delta, ContentDelta))


def test_partial_tag_is_held_back_until_clear():
    s = ToolCallStream("auto", "hermes")
    assert s.feed("Hello <tool_") == [ContentDelta("Hello")]
    assert s.feed("box") == [ContentDelta(" <tool_box")]
    assert s.feed(" <tool_call") == []
    assert s.feed('>{"name": "f"') == [ToolCallDelta(0, s._call.id, "f", "")]
    assert s.feed(', "arguments": {"a"') == [ToolCallDelta(0, arguments='{"a"')]
    assert s.feed(": 1}") == [ToolCallDelta(0, arguments=": 1}")]
    assert s.feed("}</tool_call>") == []
    assert s.finish() == []
    assert s.content == "Hello <tool_box" and [(c.name, c.arguments) for c in s.calls] == [("f", '{"a": 1}')]


def test_arguments_before_name_are_sent_with_the_name():
    s = ToolCallStream("auto", "hermes")
    assert s.feed('<tool_call>{"arguments": {"a": [1, 2]}, "extra": {"name": "x"}, ') == []
    [delta] = s.feed('"name": "f"}')
    assert (delta.index, delta.name, delta.arguments) == (0, "f", '{"a": [1, 2]}')


def test_llama3_waits_for_the_python_tag():
    s = ToolCallStream("auto", "llama3_json")
    assert s.feed("  <|python") == []
    assert s.feed("_tag|> ") == []
    [delta] = s.feed('{"name": "f", "parameters": {')
    assert delta.name == "f" and delta.arguments == "{"
    s = ToolCallStream("auto", "llama3_json")
    assert s.feed("  <|py") == [] and s.finish() == [ContentDelta("  <|py")]


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "cut'),
    ("hermes", '<tool_call>{"name": 5, "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}} junk</tool_call>'),
    ("hermes", '<tool_call>[{"name": "f", "arguments": {}}]</tool_call>'),
    ("hermes", "Text <tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g",</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and more'),
    ("llama3_json", '{not json}'),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": '),
])
def test_malformed_call_makes_the_whole_response_content(parser, text):
    assert extract_tool_calls("auto", parser, None, text) == (text, [])
    for pieces in ([text], list(text)):
        assert stream("auto", parser, None, pieces)[0].failed


def test_stream_goes_on_after_a_malformed_block():
    text = ('<tool_call>{"name": "f", "arguments": {"a": 1} "x": 2}</tool_call>\nAfter.'
            '<tool_call>{"name": "g", "arguments": {"b": 2}}</tool_call>')
    for pieces in ([text], list(text)):
        s, deltas = stream("auto", "hermes", None, pieces)
        content, calls = reassemble(deltas)
        assert s.failed and content == s.content == "After."
        assert [(name, arguments) for _, name, arguments in calls] == [("f", '{"a": 1}'), ("g", '{"b": 2}')]
        assert [(c.name, c.arguments) for c in s.calls] == [("g", '{"b": 2}')]


def test_required_cut_short_keeps_the_whole_calls():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b": "cu'
    content, calls = extract_tool_calls("required", "hermes", None, text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
    content, calls = reassemble(stream("required", "hermes", None, list(text))[1])
    assert content is None and [(n, a) for _, n, a in calls] == [("f", '{"a": 1}'), ("g", '{"b": "cu')]


def test_named_cut_short_has_no_call():
    text = '{"location": "Par'
    s, deltas = stream("named", "hermes", "get_weather", list(text))
    assert s.calls == [] and s.content is None
    assert [(n, a) for _, n, a in reassemble(deltas)[1]] == [("get_weather", text)]
    assert deltas[0].name == "get_weather" and deltas[0].arguments == "{"
    assert extract_tool_calls("named", "hermes", "get_weather", text) == (None, [])


def test_to_openai_shapes():
    first = ToolCallDelta(1, "call_" + "a" * 24, "f", '{"a"')
    assert first.to_openai() == {"index": 1, "id": "call_" + "a" * 24, "type": "function",
                                 "function": {"name": "f", "arguments": '{"a"'}}
    assert ToolCallDelta(1, arguments=": 1}").to_openai() == {"index": 1, "function": {"arguments": ": 1}"}}
    assert ToolCall("call_1", "f", "{}").to_openai() == {"id": "call_1", "type": "function",
                                                         "function": {"name": "f", "arguments": "{}"}}


def test_stream_arguments_are_checked():
    assert TOOL_PARSERS == ("hermes", "llama3_json")
    for args in [("none",), ("auto", "mistral"), ("named",), ("auto", "hermes", "f")]:
        with pytest.raises(ValueError):
            ToolCallStream(*args)
