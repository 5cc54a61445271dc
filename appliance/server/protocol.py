"""OpenAI request parsing and validation, and response bodies.

Every client mistake becomes an ``OpenAIError`` with the status, message
and offending parameter; the app turns it into
``{"error": {"message", "type", "param", "code"}}``.

Everything is checked here, in the HTTP process, before anything is
encoded for the engine core: JSON numbers are finite and nesting is
bounded, strings are valid Unicode, every field has its exact type (a
bool is not an int, a float is not an int), numbers are in range, and
every token id is inside the model's vocabulary. Fields that ask for
behaviour the server does not have (tools, structured outputs, audio,
...) are refused with a 400 naming them instead of being ignored.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import msgspec

from appliance.engine.kv_p2p import kv_transfer_problem, kv_transfer_trust_problem
from appliance.sampling_params import SamplingParams, SamplingParamsError


class OpenAIError(Exception):
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 503: "service_unavailable", 500: "internal_server_error"}

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Union[str, int, None] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code if self.code is not None else self.status}}


MAX_JSON_DEPTH = 64
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 16
MAX_PROMPTS = 64


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:40]} is out of range")
    return v


def _too_deep(param: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep", param=param,
                       code="invalid_json")


def _check_str(s: str, param: Optional[str]) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise OpenAIError(400, "strings must be valid Unicode (a lone surrogate such as \\ud800 is not)",
                          param=param, code="invalid_json") from None


def _check_tree(body: dict) -> None:
    """Nesting depth and valid strings (keys too), without recursion."""
    stack: list[tuple[Any, int, Optional[str]]] = [(body, 1, None)]
    while stack:
        obj, depth, top = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(top)
        pairs = obj.items() if isinstance(obj, dict) else ((None, v) for v in obj)
        for k, v in pairs:
            if k is not None:
                _check_str(k, top)
            param = top if top is not None or k is None else k
            if isinstance(v, str):
                _check_str(v, param)
            elif isinstance(v, (dict, list)):
                stack.append((v, depth + 1, param))


_DECODER = msgspec.json.Decoder()


def _parse_precisely(raw: bytes) -> Any:
    """The standard library's parse, which keeps lone surrogates and deep
    nesting so the checks can name the field at fault."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if isinstance(body, dict):
        _check_tree(body)
    return body


def _may_be_too_deep(body: dict, raw: bytes) -> bool:
    """Whether a parsed body may nest more than ``MAX_JSON_DEPTH`` levels:
    a walk over its first few thousand values (a long text prompt costs
    nothing), then, for bodies with more, whether it has that many brackets
    at all (a long token-id list)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    budget = 4096
    while stack:
        obj, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        values = obj.values() if isinstance(obj, dict) else obj
        budget -= len(values)
        if budget < 0:
            return raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
        stack.extend((v, depth + 1) for v in values if isinstance(v, (dict, list)))
    return False


def parse_json(raw: bytes) -> dict:
    """The body as a dict with finite numbers, valid strings and at most
    ``MAX_JSON_DEPTH`` levels. msgspec parses valid bodies (it refuses
    NaN, infinities and lone surrogates itself); anything it refuses is
    parsed again by ``json`` to say precisely what is wrong and where."""
    try:
        body = _DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        body = _parse_precisely(raw)
    else:
        if isinstance(body, dict) and _may_be_too_deep(body, raw):
            _check_tree(body)  # raises, naming the field
    if not isinstance(body, dict):
        raise OpenAIError(400, "request body must be a JSON object", code="invalid_json")
    return body


def typed(body: dict, key: str, types: tuple, default: Any = None, allow_none: bool = True) -> Any:
    if key not in body or (body[key] is None and allow_none):
        return default
    v = body[key]
    if isinstance(v, bool) and bool not in types:
        raise OpenAIError(400, f"'{key}' must be of type {'/'.join(t.__name__ for t in types)}", param=key)
    if not isinstance(v, types):
        raise OpenAIError(400, f"'{key}' must be of type {'/'.join(t.__name__ for t in types)}, got {type(v).__name__}",
                          param=key)
    return v


def _show(v: int) -> str:
    s = str(v)
    return s if len(s) <= 24 else f"{s[:12]}... ({len(s)} digits)"


def _int(body: dict, key: str, default: Optional[int] = None, lo: int = INT64_MIN, hi: int = INT64_MAX) -> Any:
    v = typed(body, key, (int,), default)
    if v is not None and not lo <= v <= hi:
        bounds = f"at least {lo}" if hi == INT64_MAX and v < lo else f"between {lo} and {hi}"
        raise OpenAIError(400, f"'{key}' must be {bounds}, got {_show(v)}", param=key)
    return v


def _float(body: dict, key: str, default: float) -> float:
    v = typed(body, key, NUM, default)
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise OpenAIError(400, f"'{key}' must be a finite number", param=key)
    return f


def token_id_list(v: object, param: str, vocab_size: int, allow_empty: bool = False) -> list[int]:
    """A list of token ids of this model, or a 400 naming ``param``."""
    if not isinstance(v, list) or not (v or allow_empty):
        raise OpenAIError(400, f"'{param}' must be a {'' if allow_empty else 'non-empty '}list of token ids",
                          param=param)
    if not v:
        return v
    for t in v:
        if type(t) is not int:  # a bool is not a token id
            raise OpenAIError(400, f"'{param}' must hold integer token ids, got {type(t).__name__}", param=param)
    lo, hi = min(v), max(v)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise OpenAIError(400, f"token id {_show(bad)} in '{param}' is outside the vocabulary (0..{vocab_size - 1})",
                          param=param)
    return v


NUM = (int, float)

# Accepted and intentionally ignored: they do not change generation.
IGNORED = {"user", "service_tier", "store", "metadata", "parallel_tool_calls"}

# Asking for any of these at a value other than "nothing" needs behaviour
# this server does not have yet.
NOT_BUILT = {
    "audio": "audio output",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "guided_whitespace_pattern": "a whitespace pattern for structured outputs",
    "structural_tag": "structural tags",
    "documents": "documents",
    "mm_processor_kwargs": "multimodal inputs",
    "logits_processors": "logits processors",
}

# Speculative settings sent in a body: vLLM's (its engine arguments, old and
# new, and speculative_config's keys) and this server's (speculative.*).
# Drafting is the deployment's (speculative=ngram|draft_model), never a request's.
PER_DEPLOYMENT_SPECULATIVE = ("speculative_config", "num_speculative_tokens", "speculative_model", "draft_model",
                              "prompt_lookup_min", "prompt_lookup_max", "ngram_prompt_lookup_min",
                              "ngram_prompt_lookup_max", "speculative_disable_by_batch_size",
                              "speculative_draft_tensor_parallel_size", "speculative_max_model_len",
                              "spec_decoding_acceptance_method")


def reject_unsupported(body: dict, chat: bool = True) -> None:
    """400 for any field that asks for behaviour not built yet; a field
    at a value that changes nothing (no tools, text output) is accepted."""
    def refuse(param: str, what: str) -> None:
        raise OpenAIError(400, f"'{param}' asks for {what}, which this server does not support yet", param=param,
                          code="unsupported_parameter")

    if not chat:
        for key in ("tools", "tool_choice", "functions", "function_call", "chat_template_kwargs", "reasoning_effort",
                    "continue_final_message"):
            if body.get(key) not in (None, [], {}, "none", False):
                raise OpenAIError(400, f"'{key}' is only available on /v1/chat/completions", param=key)
    backend = body.get("guided_decoding_backend")
    if backend not in (None, "auto", "xgrammar"):
        refuse("guided_decoding_backend", f"the structured-output backend {str(backend)[:40]!r} (this server has "
                                          f"'xgrammar')")
    if body.get("chat_template") is not None:
        raise OpenAIError(400, "'chat_template': a request cannot bring its own template text; the deployment sets "
                               "the chat template (model.chat_template, or the checkpoint's)", param="chat_template",
                          code="unsupported_parameter")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        refuse("modalities", "output modalities other than ['text']")
    for key in (*NOT_BUILT, *PER_DEPLOYMENT_SPECULATIVE):
        v = body.get(key)
        if v is None or v is False or v == [] or v == {}:
            continue
        if key in NOT_BUILT:
            refuse(key, NOT_BUILT[key])
        raise OpenAIError(400, f"'{key}' asks for speculative decoding per request; speculative decoding is "
                               f"configured per deployment (speculative=ngram or speculative=draft_model, with "
                               f"speculative.num_speculative_tokens)", param=key, code="unsupported_parameter")


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
    prompt_logprobs: bool = False  # the body asked for them: the response carries 'prompt_logprobs'
    data_parallel_rank: Optional[int] = None  # the engine core the client pinned (None: the least loaded)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: the usage so far on every chunk
    return_token_ids: bool = False  # vLLM's: the prompt's and the output's token ids in the response
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"


MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 256, 256


def _bad_words(body: dict) -> list[str]:
    words = typed(body, "bad_words", (list,), [])
    if len(words) > MAX_BAD_WORDS:
        raise OpenAIError(400, f"'bad_words' takes at most {MAX_BAD_WORDS} words", param="bad_words")
    for w in words:
        if not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
            raise OpenAIError(400, f"'bad_words' must hold words: non-blank strings of at most {MAX_BAD_WORD_CHARS} "
                                   f"characters", param="bad_words")
    return words


def _logprobs_fields(body: dict, chat: bool) -> tuple[Optional[int], Optional[int], Optional[str]]:
    """(top logprobs per output token or None, per prompt token or None, the response's logprobs shape)."""
    logprobs_mode = None
    if chat:
        want = typed(body, "logprobs", (bool,), False)
        top = _int(body, "top_logprobs", lo=0, hi=20)
        if top is not None and not want:
            raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        n_lp = (top or 0) if want else None
        logprobs_mode = "chat" if want else None
    else:
        n_lp = _int(body, "logprobs", lo=0, hi=20)
        logprobs_mode = "completion" if n_lp is not None else None
    n_prompt_lp = _int(body, "prompt_logprobs", lo=0, hi=20)
    if n_prompt_lp is not None and typed(body, "stream", (bool,), False):
        raise OpenAIError(400, "'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs")
    if not chat and n_lp is not None and n_prompt_lp is None and typed(body, "echo", (bool,), False):
        n_prompt_lp = n_lp  # the echoed prompt's tokens get logprobs too, as the output's
    return n_lp, n_prompt_lp, logprobs_mode


def sampling_from_body(body: dict, *, chat: bool, vocab_size: int) -> tuple[SamplingParams, Optional[str]]:
    max_tokens = _int(body, "max_tokens", lo=1)
    if chat:
        mct = _int(body, "max_completion_tokens", lo=1)
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
    logit_bias = {}
    for k, v in typed(body, "logit_bias", (dict,), {}).items():
        digits = k[1:] if k[:1] == "-" else k
        if not (digits.isascii() and digits.isdigit() and len(digits) <= 20):
            raise OpenAIError(400, f"'logit_bias' keys must be token ids, got {k[:40]!r}", param="logit_bias")
        tok = int(k)
        if not 0 <= tok < vocab_size:
            raise OpenAIError(400, f"token id {tok} in 'logit_bias' is outside the vocabulary (0..{vocab_size - 1})",
                              param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, NUM) or not -100 <= v <= 100:
            raise OpenAIError(400, f"'logit_bias' values must be numbers in [-100, 100], got {str(v)[:40]} for token "
                                   f"{tok}", param="logit_bias")
        logit_bias[tok] = float(v)
    allowed = body.get("allowed_token_ids")
    allowed = None if allowed is None else token_id_list(allowed, "allowed_token_ids", vocab_size)
    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else token_id_list(stop_ids, "stop_token_ids", vocab_size, allow_empty=True)
    n_lp, n_prompt_lp, logprobs_mode = _logprobs_fields(body, chat)
    n = _int(body, "n", 1, lo=1, hi=MAX_N)
    if _int(body, "best_of", 1) not in (1, n):
        raise OpenAIError(400, "'best_of' is not supported; use 'n'", param="best_of")
    try:
        params = SamplingParams(
            n=n,
            temperature=_float(body, "temperature", 1.0),
            top_p=_float(body, "top_p", 1.0),
            top_k=_int(body, "top_k", 0, lo=-1, hi=INT32_MAX),
            min_p=_float(body, "min_p", 0.0),
            seed=_int(body, "seed"),  # children draw with seed + k: still inside torch's 64-bit range
            max_tokens=max_tokens,
            min_tokens=_int(body, "min_tokens", 0, lo=0, hi=INT32_MAX),
            stop=stop,
            stop_token_ids=list(stop_ids),
            ignore_eos=typed(body, "ignore_eos", (bool,), False),
            include_stop_str_in_output=typed(body, "include_stop_str_in_output", (bool,), False),
            presence_penalty=_float(body, "presence_penalty", 0.0),
            frequency_penalty=_float(body, "frequency_penalty", 0.0),
            repetition_penalty=_float(body, "repetition_penalty", 1.0),
            logit_bias=logit_bias,
            allowed_token_ids=allowed,
            bad_words=_bad_words(body),
            logprobs=n_lp,
            prompt_logprobs=n_prompt_lp,
            skip_special_tokens=typed(body, "skip_special_tokens", (bool,), True),
            kv_transfer_params=typed(body, "kv_transfer_params", (dict,)) or None,
            use_beam_search=typed(body, "use_beam_search", (bool,), False),
            length_penalty=_float(body, "length_penalty", 1.0),
            early_stopping=body.get("early_stopping", False),  # true, false or "never": SamplingParams checks it
        )
    except SamplingParamsError as e:
        raise OpenAIError(400, str(e), param=e.param) from None
    return params, logprobs_mode


def check_kv_transfer(params: SamplingParams, stream: bool, num_prompts: int, connector: Optional[str], role: str,
                      block_size: int, internal: bool = False, trusted_producers: Sequence[str] = ()) -> None:
    """400 for ``kv_transfer_params`` this server cannot act on (see
    ``engine/kv_p2p.py``): no or another KV connector, the other role, a
    malformed producer answer, more than one sequence; a producer's answer
    comes in a whole response, not a stream; and, before anything connects
    anywhere, parameters that neither come from this deployment's router
    (``internal``: the request is signed with its internal key) nor name a
    producer in ``trusted_producers``."""
    p = params.kv_transfer_params
    if p is None:
        return
    problem = kv_transfer_problem(params, connector, role, block_size)
    if problem is None:
        problem = kv_transfer_trust_problem(p, internal, trusted_producers)
    if problem is None and num_prompts != 1:
        problem = "takes one prompt per request"
    if problem is None and stream and p.get("do_remote_decode"):
        problem = "do_remote_decode: the KV's whereabouts come with the whole response ('stream': false)"
    if problem is not None:
        raise OpenAIError(400, f"'kv_transfer_params' {problem}", param="kv_transfer_params")


def stream_options(body: dict) -> tuple[bool, bool, bool]:
    """``stream``, ``stream_options.include_usage`` (a last chunk with the
    usage) and ``stream_options.continuous_usage_stats`` (the usage so far on
    every chunk too, as vLLM's servers send it: a client that stops reading
    early still knows the prompt's tokens and what it got)."""
    stream = typed(body, "stream", (bool,), False)
    opts = typed(body, "stream_options", (dict,), {})
    if opts and not stream:
        raise OpenAIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    for key in opts:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise OpenAIError(400, f"'stream_options.{key[:40]}' is not supported; 'include_usage' and "
                                   f"'continuous_usage_stats' are", param="stream_options")
    include_usage, continuous = opts.get("include_usage"), opts.get("continuous_usage_stats")
    for key, v in (("include_usage", include_usage), ("continuous_usage_stats", continuous)):
        if v is not None and not isinstance(v, bool):
            raise OpenAIError(400, f"'stream_options.{key}' must be a boolean", param="stream_options")
    if continuous and not include_usage:
        raise OpenAIError(400, "'stream_options.continuous_usage_stats' needs 'include_usage': true (the usage "
                               "goes on every chunk as well as the last)", param="stream_options")
    return stream, bool(include_usage), bool(continuous)


def prompt_truncation(body: dict, max_model_len: int) -> Optional[int]:
    """vLLM's ``truncate_prompt_tokens``: keep a prompt's last k tokens (-1:
    the model's context length); None: no truncation."""
    k = _int(body, "truncate_prompt_tokens", lo=-1, hi=max_model_len)
    if k == 0:
        raise OpenAIError(400, "'truncate_prompt_tokens' must be -1 (the model's context length) or at least 1",
                          param="truncate_prompt_tokens")
    return max_model_len if k == -1 else k


def token_id_options(body: dict) -> tuple[bool, bool]:
    """vLLM's ``return_token_ids`` (the prompt's and output's ids in the
    response) and ``return_tokens_as_token_ids`` (logprobs name each token
    ``token_id:<id>``)."""
    return (typed(body, "return_token_ids", (bool,), False),
            typed(body, "return_tokens_as_token_ids", (bool,), False))


def common_extensions(body: dict) -> tuple[int, Optional[str]]:
    priority = _int(body, "priority", 0, lo=INT32_MIN, hi=INT32_MAX)
    salt = typed(body, "cache_salt", (str,))
    if salt is not None and not salt:
        raise OpenAIError(400, "'cache_salt' must not be empty", param="cache_salt")
    return priority, salt


DATA_PARALLEL_RANK_HEADER = "x-data-parallel-rank"


def data_parallel_rank(body: dict, header: Optional[str], size: int) -> Optional[int]:
    """The engine core a request pins: the ``X-Data-Parallel-Rank`` header or
    the ``data_parallel_rank`` field (both: they must agree), 0..size-1; None
    when neither is given."""
    field_rank = _int(body, "data_parallel_rank", lo=0, hi=size - 1)
    if header is None:
        return field_rank
    try:
        rank = int(header.strip())
    except ValueError:
        raise OpenAIError(400, f"the X-Data-Parallel-Rank header must be an integer, got {header[:40]!r}",
                          param="X-Data-Parallel-Rank") from None
    if not 0 <= rank < size:
        raise OpenAIError(400, f"the X-Data-Parallel-Rank header must be in 0..{size - 1} (this server runs {size} "
                               f"data-parallel engine core(s)), got {rank}", param="X-Data-Parallel-Rank")
    if field_rank is not None and field_rank != rank:
        raise OpenAIError(400, f"the X-Data-Parallel-Rank header ({rank}) and 'data_parallel_rank' ({field_rank}) "
                               f"disagree", param="data_parallel_rank")
    return rank


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u
