"""The messages between the HTTP process and the engine-core process
(appliance/server/messages.py): every one survives msgpack as an equal value,
and one that does not fit its direction's union is refused on arrival."""

from typing import get_args

import msgspec
import pytest

from appliance.engine.outputs import RequestOutputDelta, StepStats, TokenLogprob
from appliance.sampling_params import SamplingParams
from appliance.server.messages import (
    AbortRequests,
    AddRequest,
    Fatal,
    FromCore,
    Heartbeat,
    Outputs,
    Ready,
    RequestError,
    ResetPrefixCache,
    ResetPrefixCacheResult,
    Shutdown,
    ToCore,
    decode_from_core,
    decode_to_core,
    encode,
)

PARAMS = SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=2**64 - 1, max_tokens=33,
                        min_tokens=2, stop=["\n\n", "END"], stop_token_ids=[2, 7], ignore_eos=True,
                        include_stop_str_in_output=True, presence_penalty=0.5, frequency_penalty=-0.5,
                        repetition_penalty=1.1, logit_bias={3: -99.5, 400: 1.0}, logprobs=5,
                        allowed_token_ids=[3, 9, 400], bad_words=["never"], bad_words_token_ids=[[5], [6, 7]],
                        skip_special_tokens=False)
DELTA = RequestOutputDelta(
    "cmpl-1-0", [5, 6], "hi", True, finish_reason="stop", stop_reason=7,
    logprobs=[TokenLogprob(5, -0.25, 1, [(5, -0.25), (9, -2.0)]), None],
    num_prompt_tokens=4, num_output_tokens=2, num_cached_tokens=16, queue_time=0.125)

TO_CORE = [
    AddRequest("cmpl-1-0", [1, 2, 3], PARAMS, priority=-3, cache_salt="salt"),
    AddRequest("r", [1], SamplingParams()),
    AbortRequests(["a", "b"]),
    ResetPrefixCache(),
    Shutdown(),
]
FROM_CORE = [
    Ready(num_kv_blocks=512, block_size=16, backend="cpu_native", pid=1234),
    Outputs([DELTA, RequestOutputDelta("r", [], "", True, finish_reason="error"),
             RequestOutputDelta("s", [1], "x", False, stop_reason="stop_string")],
            StepStats(3, 1, 0.5, 2, 100, 48, 64)),
    Outputs([], StepStats()),
    Heartbeat(),
    RequestError("r", "prompt holds a token id outside the vocabulary (0..511)"),
    ResetPrefixCacheResult(True),
    ResetPrefixCacheResult(False),
    Fatal("RuntimeError: boom"),
]


@pytest.mark.parametrize("msg", TO_CORE, ids=lambda m: type(m).__name__)
def test_messages_to_the_core_round_trip(msg):
    back = decode_to_core(encode(msg))
    assert type(back) is type(msg) and back == msg


@pytest.mark.parametrize("msg", FROM_CORE, ids=lambda m: type(m).__name__)
def test_messages_from_the_core_round_trip(msg):
    back = decode_from_core(encode(msg))
    assert type(back) is type(msg) and back == msg


def test_every_message_type_is_covered():
    assert {type(m) for m in TO_CORE} == set(get_args(ToCore))
    assert {type(m) for m in FROM_CORE} == set(get_args(FromCore))


def test_sampling_params_keep_their_types():
    back = decode_to_core(encode(TO_CORE[0]))
    p = back.params
    assert isinstance(p, SamplingParams) and p.logit_bias == {3: -99.5, 400: 1.0}
    assert all(type(k) is int for k in p.logit_bias) and p.seed == 2**64 - 1
    assert decode_from_core(encode(FROM_CORE[1])).outputs[0].logprobs[0].top == [(5, -0.25), (9, -2.0)]


def _raw(obj):
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize("raw", [
    _raw({"type": "add", "request_id": "r", "prompt_token_ids": [1]}),  # no params
    _raw({"type": "add", "request_id": "r", "prompt_token_ids": ["x"], "params": {}}),
    _raw({"type": "add", "request_id": "r", "prompt_token_ids": [1], "params": {"n": 0}}),  # __post_init__ refuses
    _raw({"type": "add", "request_id": "r", "prompt_token_ids": [1], "params": {"logit_bias": {"3": 1.0}}}),
    _raw({"type": "abort", "request_ids": "r"}),
    _raw({"type": "outputs", "outputs": [], "stats": {}}),  # a message of the other direction
    _raw({"type": "nope"}),
    _raw({"request_ids": ["r"]}),  # untagged
    _raw([1, 2]),
], ids=range(9))
def test_a_malformed_message_to_the_core_is_refused(raw):
    with pytest.raises(msgspec.ValidationError):
        decode_to_core(raw)


@pytest.mark.parametrize("raw", [
    _raw({"type": "ready", "num_kv_blocks": "many", "block_size": 16, "backend": "x", "pid": 1}),
    _raw({"type": "outputs", "outputs": [{"request_id": "r"}], "stats": {}}),  # a delta missing its fields
    _raw({"type": "outputs", "outputs": [], "stats": {"kv_usage": "full"}}),
    _raw({"type": "request_error", "request_id": "r"}),
    _raw({"type": "reset_prefix_cache_result", "ok": 1}),
    _raw({"type": "add", "request_id": "r", "prompt_token_ids": [1], "params": {}}),
], ids=range(6))
def test_a_malformed_message_from_the_core_is_refused(raw):
    with pytest.raises(msgspec.ValidationError):
        decode_from_core(raw)


def test_bytes_that_are_no_message_are_refused():
    with pytest.raises(msgspec.DecodeError):
        decode_to_core(b"\xc1")
