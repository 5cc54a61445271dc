"""The messages between the HTTP process and the engine-core process.

Each is a ``msgspec.Struct`` tagged by its ``type`` field, sent as msgpack
over ZeroMQ and decoded against the union of its direction, so each side
validates a message once, on arrival, and reads typed fields after that
(``SamplingParams`` is rebuilt, and checked by its ``__post_init__``, on the
way in). A message that does not fit raises ``msgspec.ValidationError``.

Front end -> core (``ToCore``):
    AddRequest          a request to run (token ids, sampling params, priority, cache salt)
    AbortRequests       requests the front end no longer waits on
    ResetPrefixCache    drop the prefix cache (answered by ResetPrefixCacheResult)
    Shutdown            finish what runs, then exit
Core -> front end (``FromCore``):
    Ready               after loading and one real warm-up generation
    Outputs             the deltas of a step and the core's stats after it
    Heartbeat           the step loop came round (between steps and while idle, every second or sooner)
    RequestError        a request the core refused (the client's doing: HTTP 400)
    ResetPrefixCacheResult
    Fatal               the core cannot go on; it exits non-zero after sending it
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec

from appliance.engine.outputs import RequestOutputDelta, StepStats
from appliance.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: Optional[str] = None


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    pass


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    num_kv_blocks: int
    block_size: int
    backend: str
    pid: int


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: list[RequestOutputDelta]
    stats: StepStats


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """The core's step loop came round: a core that sends nothing for
    ``server.core_heartbeat_timeout_s`` is unresponsive."""


class RequestError(msgspec.Struct, tag="request_error"):
    request_id: str
    message: str


class ResetPrefixCacheResult(msgspec.Struct, tag="reset_prefix_cache_result"):
    ok: bool


class Fatal(msgspec.Struct, tag="fatal"):
    message: str


ToCore = Union[AddRequest, AbortRequests, ResetPrefixCache, Shutdown]
FromCore = Union[Ready, Outputs, Heartbeat, RequestError, ResetPrefixCacheResult, Fatal]

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(msg: Union[ToCore, FromCore]) -> bytes:
    return _encoder.encode(msg)


def decode_to_core(raw: bytes) -> ToCore:
    """A message for the core; ``msgspec.ValidationError`` if it is none."""
    return _to_core.decode(raw)


def decode_from_core(raw: bytes) -> FromCore:
    """A message from the core; ``msgspec.ValidationError`` if it is none."""
    return _from_core.decode(raw)
