"""Sampling parameters of one request (torch-free; shared by engine and API)."""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

# What torch.Generator.manual_seed takes.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def _finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond float range
        return False


class SamplingParamsError(ValueError):
    """An invalid parameter; ``param`` names it for the API's error body."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's ``structured_outputs``): exactly one
    of a JSON schema (``json``: a dict or its JSON text), a regular
    expression, a list of strings to choose from, an EBNF grammar, or any
    JSON object. ``disable_any_whitespace``: JSON without free whitespace
    between its tokens (compact)."""

    json: Union[str, dict, None] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            try:
                # key order kept: the grammar writes properties in the schema's order
                self.json = _json.dumps(self.json, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise SamplingParamsError(f"structured_outputs.json is not a JSON schema: {e}",
                                          "structured_outputs.json") from None
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs takes exactly one of " + ", ".join(STRUCTURED_KINDS)
                + (f"; got {', '.join(given)}" if given else ""), "structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError("structured_outputs.choice must be a non-empty list of non-empty strings",
                                      "structured_outputs.choice")
        for name in ("json", "regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise SamplingParamsError(f"structured_outputs.{name} must be a non-empty string",
                                          f"structured_outputs.{name}")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on (the compile cache's key)."""
        spec = getattr(self, self.kind)
        return self.kind, tuple(spec) if isinstance(spec, list) else spec, self.disable_any_whitespace


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: Optional[list[int]] = None  # vLLM's: only these may be sampled (null: any)
    # vLLM's: words never generated. Each is tokenized as it stands and after a space (bad_words_token_ids, filled
    # by the engine from its tokenizer: ``resolve_bad_words``); a one-token word is never sampled, a longer word's
    # last token never right after the rest of it in the output
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: Optional[int] = None  # number of top logprobs besides the sampled one
    # the log-probability of each prompt token given those before it (the first: None), with this many top
    # candidates besides it; such a request computes its whole prompt (no prefix-cache hits), as vLLM's does
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None
    # vLLM's kv_transfer_params, for a KV connector (engine/kv_p2p.py): {"do_remote_decode": true} asks a
    # producer to hold the prefill's KV for a consumer; what the producer returned asks a consumer to fetch it
    kv_transfer_params: Optional[dict[str, Any]] = None
    # beam search (engine/beam_search.py): n beams, the n best returned; a finished beam scores its summed
    # log-probabilities over its length ** length_penalty; early_stopping True, False or "never" (transformers')
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.verify()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def _verify_beam_search(self, bad: Callable[[str, str], None]) -> None:
        for name, used in _NOT_WITH_BEAMS:
            if used(self):
                bad(f"'{name}' does not apply to beam search (not built yet for 'use_beam_search': true)", name)
        per_beam = 2 + len(set(self.stop_token_ids))  # transformers' max(2, 1 + stop tokens), the EOS one of them
        if self.n * per_beam > MAX_BEAM_CANDIDATES:
            bad(f"beam search ranks n x {per_beam} candidates a step (n beams, {per_beam} each with "
                f"{len(set(self.stop_token_ids))} stop_token_ids), at most {MAX_BEAM_CANDIDATES}: n={self.n} is too "
                f"many", "n")

    def verify(self) -> None:
        """vLLM's checks, plus finiteness (NaN passes every comparison) and
        64-bit seeds: whatever passes here is safe to encode and to sample with."""

        def bad(msg: str, param: str) -> None:
            raise SamplingParamsError(msg, param)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not _finite(getattr(self, name)):
                bad(f"{name} must be a finite number, got {getattr(self, name)}", name)
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}", "n")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            bad(f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}", "top_k")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            bad("seed must fit in 64 bits", "seed")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be positive, got {self.repetition_penalty}", "repetition_penalty")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}", "prompt_logprobs")
        if any(not s for s in self.stop):
            bad("stop strings must not be empty", "stop")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be token ids (non-negative)", "stop_token_ids")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids must not be empty (null allows every token)", "allowed_token_ids")
        if any(t < 0 for t in self.allowed_token_ids or ()):
            bad("allowed_token_ids must be token ids (non-negative)", "allowed_token_ids")
        if any(not w.strip() for w in self.bad_words):
            bad("bad_words must not be empty or only spaces", "bad_words")
        if any(not ids or min(ids) < 0 for ids in self.bad_words_token_ids):
            bad("bad_words_token_ids must be non-empty lists of token ids", "bad_words")
        if not _finite(self.length_penalty):
            bad(f"length_penalty must be a finite number, got {self.length_penalty}", "length_penalty")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            bad(f"early_stopping must be true, false or \"never\", got {str(self.early_stopping)[:40]}", "early_stopping")
        if self.use_beam_search:
            self._verify_beam_search(bad)
        elif self.length_penalty != 1.0 or self.early_stopping is not False:
            bad("length_penalty and early_stopping apply to beam search only ('use_beam_search': true)",
                "length_penalty" if self.length_penalty != 1.0 else "early_stopping")
        for tok, bias in self.logit_bias.items():
            if tok < 0:
                bad(f"logit_bias keys must be token ids (non-negative), got {tok}", "logit_bias")
            if not -100 <= bias <= 100:
                bad(f"logit_bias for token {tok} must be in [-100, 100], got {bias}", "logit_bias")


# What beam search does not take: it ranks beams by the model's own log-probabilities (temperature 1; 0 is
# taken as "deterministic") and ends them on stop tokens or the length limit.
_NOT_WITH_BEAMS = (("temperature", lambda p: p.temperature not in (0.0, 1.0)), ("top_p", lambda p: p.top_p < 1.0),
                   ("top_k", lambda p: p.top_k > 0), ("min_p", lambda p: p.min_p > 0.0),
                   ("seed", lambda p: p.seed is not None), ("min_tokens", lambda p: p.min_tokens > 0),
                   ("stop", lambda p: bool(p.stop)), ("presence_penalty", lambda p: p.presence_penalty != 0.0),
                   ("frequency_penalty", lambda p: p.frequency_penalty != 0.0),
                   ("repetition_penalty", lambda p: p.repetition_penalty != 1.0),
                   ("logit_bias", lambda p: bool(p.logit_bias)), ("allowed_token_ids", lambda p: p.allowed_token_ids),
                   ("bad_words", lambda p: bool(p.bad_words)), ("logprobs", lambda p: p.logprobs is not None),
                   ("prompt_logprobs", lambda p: p.prompt_logprobs is not None),
                   ("structured_outputs", lambda p: p.structured_outputs is not None),
                   ("kv_transfer_params", lambda p: p.kv_transfer_params is not None))
MAX_BEAM_CANDIDATES = 20  # ranked a step: each beam's top logprobs (vLLM's limit on them, as its beam search)


def resolve_bad_words(params: SamplingParams, encode: Callable[[str], list[int]]) -> None:
    """``params.bad_words`` as token ids (vLLM's rule): each word without its
    leading spaces, and again after one space where that makes other tokens
    of the same count (the word inside a sentence), ``encode`` being the
    tokenizer without special tokens."""
    out: list[list[int]] = []
    for word in params.bad_words:
        bare = encode(word.lstrip())
        if not bare:
            continue
        out.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    params.bad_words_token_ids = out
