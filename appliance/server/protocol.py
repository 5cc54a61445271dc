"""OpenAI request parsing and validation, and response bodies.

Every client mistake becomes an ``OpenAIError`` with the status, message
and offending parameter; the app turns it into
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from appliance.sampling_params import SamplingParams, SamplingParamsError


class OpenAIError(Exception):
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 503: "service_unavailable", 500: "internal_server_error"}

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code if self.code is not None else self.status}}


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "request body must be a JSON object", code="invalid_json")
    return body


def _typed(body: dict, key: str, types: tuple, default: Any = None, allow_none: bool = True) -> Any:
    if key not in body or (body[key] is None and allow_none):
        return default
    v = body[key]
    if isinstance(v, bool) and bool not in types:
        raise OpenAIError(400, f"'{key}' must be of type {'/'.join(t.__name__ for t in types)}", param=key)
    if not isinstance(v, types):
        raise OpenAIError(400, f"'{key}' must be of type {'/'.join(t.__name__ for t in types)}, got {type(v).__name__}",
                          param=key)
    return v


NUM = (int, float)

# Accepted and intentionally ignored: they do not change generation.
IGNORED = {"user", "service_tier", "store", "metadata", "parallel_tool_calls"}


@dataclass
class GenerationRequest:
    prompts: list[list[int]]  # token ids, one entry per prompt
    prompt_texts: list[Optional[str]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    cache_salt: Optional[str]
    echo: bool = False
    logprobs_mode: Optional[str] = None  # "completion" | "chat" | None
    extra: dict = field(default_factory=dict)


def sampling_from_body(body: dict, *, chat: bool) -> tuple[SamplingParams, Optional[str]]:
    max_tokens = _typed(body, "max_tokens", (int,))
    if chat:
        mct = _typed(body, "max_completion_tokens", (int,))
        max_tokens = mct if mct is not None else max_tokens
    elif max_tokens is None and "max_tokens" not in body:
        max_tokens = 16  # the completions API's default
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise OpenAIError(400, "'stop' must be a string or a list of strings", param="stop")
    if len(stop) > 16:
        raise OpenAIError(400, "'stop' takes at most 16 sequences", param="stop")
    bias_raw = _typed(body, "logit_bias", (dict,), {})
    logit_bias = {}
    for k, v in bias_raw.items():
        try:
            logit_bias[int(k)] = float(v)
        except (TypeError, ValueError):
            raise OpenAIError(400, f"'logit_bias' keys must be token ids and values numbers, got {k!r}: {v!r}",
                              param="logit_bias") from None
    logprobs_mode = None
    if chat:
        want = _typed(body, "logprobs", (bool,), False)
        top = _typed(body, "top_logprobs", (int,))
        if top is not None and not want:
            raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        n_lp = (top or 0) if want else None
        logprobs_mode = "chat" if want else None
    else:
        n_lp = _typed(body, "logprobs", (int,))
        logprobs_mode = "completion" if n_lp is not None else None
    if _typed(body, "best_of", (int,), 1) not in (1, _typed(body, "n", (int,), 1)):
        raise OpenAIError(400, "'best_of' is not supported; use 'n'", param="best_of")
    try:
        params = SamplingParams(
            n=_typed(body, "n", (int,), 1),
            temperature=float(_typed(body, "temperature", NUM, 1.0)),
            top_p=float(_typed(body, "top_p", NUM, 1.0)),
            top_k=_typed(body, "top_k", (int,), 0),
            min_p=float(_typed(body, "min_p", NUM, 0.0)),
            seed=_typed(body, "seed", (int,)),
            max_tokens=max_tokens,
            min_tokens=_typed(body, "min_tokens", (int,), 0),
            stop=stop,
            stop_token_ids=list(_typed(body, "stop_token_ids", (list,), [])),
            ignore_eos=_typed(body, "ignore_eos", (bool,), False),
            include_stop_str_in_output=_typed(body, "include_stop_str_in_output", (bool,), False),
            presence_penalty=float(_typed(body, "presence_penalty", NUM, 0.0)),
            frequency_penalty=float(_typed(body, "frequency_penalty", NUM, 0.0)),
            repetition_penalty=float(_typed(body, "repetition_penalty", NUM, 1.0)),
            logit_bias=logit_bias,
            logprobs=n_lp,
            skip_special_tokens=_typed(body, "skip_special_tokens", (bool,), True),
        )
    except SamplingParamsError as e:
        raise OpenAIError(400, str(e), param=e.param) from None
    if params.n > 16:
        raise OpenAIError(400, f"'n' must be at most 16, got {params.n}", param="n")
    return params, logprobs_mode


def stream_options(body: dict) -> tuple[bool, bool]:
    stream = _typed(body, "stream", (bool,), False)
    opts = _typed(body, "stream_options", (dict,), {})
    if opts and not stream:
        raise OpenAIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    return stream, bool(opts.get("include_usage", False))


def common_extensions(body: dict) -> tuple[int, Optional[str]]:
    priority = _typed(body, "priority", (int,), 0)
    salt = _typed(body, "cache_salt", (str,))
    if salt is not None and not salt:
        raise OpenAIError(400, "'cache_salt' must not be empty", param="cache_salt")
    return priority, salt


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u
