"""``parse_json``: msgspec's fast parse and the standard library's precise
one accept and refuse the same bodies, and the depth bound holds however
the nesting hides."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.server.protocol import MAX_JSON_DEPTH, OpenAIError, _parse_precisely, parse_json

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4)),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, database=None)
@given(body=st.dictionaries(st.text(max_size=6), json_values, max_size=5))
def test_fast_and_precise_parses_agree_on_valid_bodies(body):
    raw = json.dumps(body).encode()
    assert parse_json(raw) == _parse_precisely(raw) == body


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("raw,param", [
    ('{"a": ' + nested(MAX_JSON_DEPTH) + "}", "a"),  # the body itself is the first level
    ('{"prompt": [' + ", ".join(["1"] * 5000) + ", " + nested(MAX_JSON_DEPTH) + "]}", "prompt"),  # past the walk
    ('{"m": [' + ", ".join(['{"x": 1}'] * 3000) + "], \"deep\": " + nested(MAX_JSON_DEPTH) + "}", "deep"),
])
def test_depth_bound_holds_wherever_the_nesting_is(raw, param):
    with pytest.raises(OpenAIError) as e:
        parse_json(raw.encode())
    assert e.value.status == 400 and e.value.param == param and f"more than {MAX_JSON_DEPTH}" in e.value.message


def test_long_flat_bodies_pass():
    assert parse_json(json.dumps({"prompt": list(range(20000))}).encode())["prompt"][-1] == 19999
    assert parse_json(json.dumps({"a": nested(MAX_JSON_DEPTH - 1)}).encode())


@pytest.mark.parametrize("raw,message", [
    (b'{"prompt": "a\\ud800b"}', "valid Unicode"),
    (b'{"prompt": "a\xed\xa0\x80b"}', "valid Unicode"),
    (b'{"t": NaN}', "not a JSON number"),
    (b'{"t": 1e999}', "out of range"),
    (b'{"t": 1} x', "not valid JSON"),
    (b'[1]', "must be a JSON object"),
    (b'"text"', "must be a JSON object"),
])
def test_refusals_name_the_problem(raw, message):
    with pytest.raises(OpenAIError) as e:
        parse_json(raw)
    assert e.value.status == 400 and message in e.value.message
