"""Structured outputs on xgrammar: constraints checked at the boundary,
grammars compiled off the step loop, one matcher per request, and the
token bitmask of each step.

- ``check(so)`` (tokenizer-free, milliseconds) turns a request's
  constraint into xgrammar's grammar or a ``SamplingParamsError`` naming the
  field: an invalid schema, regex or EBNF grammar carries the compiler's
  message; a JSON-schema keyword xgrammar would silently ignore
  (``UNSUPPORTED_KEYWORDS``, ``multipleOf`` on non-integers, unknown
  ``format`` values) is refused by name rather than left unenforced.
- ``Grammars`` (one per engine) compiles against the tokenizer on a thread
  pool, one compile per distinct constraint (``StructuredOutputsParams.key``),
  and keeps compiled grammars in an LRU bounded in bytes
  (``structured_output.cache_size_mib``). ``grammar_for(params)`` returns
  the request's ``RequestGrammar`` at once; the engine keeps the request
  waiting until ``ready()``.
- ``RequestGrammar`` holds the request's matcher, which has accepted exactly
  the request's output tokens (``sync`` rebuilds it from them if not, e.g.
  after a retried step). ``Grammars.bitmask`` fills one packed int32 row per
  sampled position: with drafts, a row per draft position (the matcher
  advanced through the drafts before it, then rolled back).
- ``StepBitmask.apply`` masks a step's logits in place with xgrammar's
  kernel (CPU, or Triton/CUDA when the logits are on a GPU).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any, Callable, Optional

from appliance.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams

if TYPE_CHECKING:
    import torch

log = logging.getLogger("appliance.structured")

# JSON-schema keywords xgrammar 0.2 accepts but does not enforce.
UNSUPPORTED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
                        "dependentRequired", "dependentSchemas", "dependencies")
SUPPORTED_FORMATS = ("email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6", "hostname", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def _xgr():
    import xgrammar

    return xgrammar


def unsupported_schema_features(schema: Any) -> list[str]:
    """Keywords of ``schema`` xgrammar would not enforce, as 'keyword at path'."""
    found: list[str] = []
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        for kw in UNSUPPORTED_KEYWORDS:
            if kw in node:
                found.append(f"'{kw}' at {path}")
        if "multipleOf" in node and node.get("type") != "integer":
            found.append(f"'multipleOf' on a non-integer at {path}")
        if "format" in node and node["format"] not in SUPPORTED_FORMATS:
            found.append(f"'format': {str(node['format'])[:40]!r} at {path}")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            found.append(f"'allOf' with more than one schema at {path}")
        for kw in _SUBSCHEMA_LISTS:
            if isinstance(node.get(kw), list):
                stack.extend((s, f"{path}/{kw}/{i}") for i, s in enumerate(node[kw]))
        for kw in _SUBSCHEMA_MAPS:
            if isinstance(node.get(kw), dict):
                stack.extend((s, f"{path}/{kw}/{k}") for k, s in node[kw].items())
        for kw in _SUBSCHEMAS:
            if isinstance(node.get(kw), dict):
                stack.append((node[kw], f"{path}/{kw}"))
    return sorted(found)


def _choice_grammar(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check(so: StructuredOutputsParams, max_whitespace: Optional[int] = None) -> Any:
    """``so`` as an xgrammar ``Grammar``; ``SamplingParamsError`` (with the
    field) when it is invalid or asks for what xgrammar does not enforce.
    ``max_whitespace``: the longest run of whitespace JSON may have between
    its tokens (None: unbounded), so a model cannot pad it until max_tokens."""
    xgr = _xgr()
    kind = so.kind
    ws = {"any_whitespace": not so.disable_any_whitespace, "max_whitespace_cnt": max_whitespace}
    param = f"structured_outputs.{kind}"
    try:
        if kind == "json":
            try:
                schema = json.loads(so.json)
            except ValueError as e:
                raise SamplingParamsError(f"the JSON schema is not valid JSON: {e}", param) from None
            if not isinstance(schema, (dict, bool)):
                raise SamplingParamsError("a JSON schema must be an object", param)
            if bad := unsupported_schema_features(schema):
                raise SamplingParamsError("the JSON schema uses features structured outputs cannot enforce: "
                                          + ", ".join(bad[:8]), param)
            return xgr.Grammar.from_json_schema(so.json, **ws)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **ws)
        if kind == "regex":
            return xgr.Grammar.from_regex(so.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_grammar(so.choice))
        return xgr.Grammar.from_ebnf(so.grammar)
    except RuntimeError as e:  # xgrammar's parse errors: "[time] file:line: message"
        message = str(e).strip().split(": ", 1)[-1] if "] /" in str(e) else str(e).strip()
        what = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "grammar": "grammar",
                "choice": "choice"}[kind]
        raise SamplingParamsError(f"invalid {what}: {message}", param) from None


class RequestGrammar:
    """One request's grammar: compiling (``ready()`` False), failed
    (``error``), or a matcher over the request's output tokens."""

    def __init__(self, future: Future):
        self._future = future
        self._matcher: Any = None
        self.num_accepted = 0

    def ready(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> Optional[str]:
        e = self._future.exception() if self._future.done() else None
        return None if e is None else f"{type(e).__name__}: {e}"

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            self._matcher = _xgr().GrammarMatcher(self._future.result())
        return self._matcher

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher's state the one after ``output_token_ids``."""
        if self.num_accepted == len(output_token_ids):
            return
        m = self.matcher
        m.reset()
        self.num_accepted = 0
        self.accept(output_token_ids)

    def accept(self, token_ids: list[int]) -> int:
        """Advance over ``token_ids``; how many were accepted (stops at the first refused)."""
        m = self.matcher
        for j, tok in enumerate(token_ids):
            if not m.accept_token(tok):
                return j
            self.num_accepted += 1
        return len(token_ids)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of ``drafts`` the grammar allows in a row (state unchanged)."""
        m = self.matcher
        n = 0
        for tok in drafts:
            if m.is_terminated() or not m.accept_token(tok):
                break
            n += 1
        if n:
            m.rollback(n)
        return n


class StepBitmask:
    """The packed bitmask rows of one step: ``rows[rid]`` is the first of
    the request's rows (one per sampled position)."""

    def __init__(self, tensor: torch.Tensor, rows: dict[str, tuple[int, int]], vocab_size: int):
        self.tensor = tensor
        self.rows = rows  # rid -> (first row, number of rows)
        self.vocab_size = vocab_size

    def apply(self, logits: torch.Tensor, logit_rows: dict[str, int], kernel: Optional[Callable] = None) -> None:
        """Mask ``logits`` in place; ``logit_rows[rid]`` is the first logits row of that request.
        ``kernel(logits, bitmask, [(logits row, bitmask row), ...], vocab_size)``
        masks fp32 CPU logits when given (the native one); xgrammar's kernel
        masks them otherwise."""
        import torch

        pairs = [(logit_rows[rid] + j, first + j) for rid, (first, n) in self.rows.items() if rid in logit_rows
                 for j in range(n)]
        if not pairs:
            return
        if kernel is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
            kernel(logits, self.tensor, pairs, self.vocab_size)
            return
        dst = [d for d, _ in pairs]
        full = torch.full((logits.shape[0], self.tensor.shape[1]), -1, dtype=torch.int32)
        full[dst] = self.tensor[[s for _, s in pairs]]
        _xgr().apply_token_bitmask_inplace(logits, full.to(logits.device), vocab_size=self.vocab_size, indices=dst)


class Grammars:
    """Compiles and caches grammars for one tokenizer; see the module docstring."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], num_threads: int = 2,
                 cache_size_bytes: int = 512 << 20, any_whitespace: bool = True, max_whitespace: Optional[int] = 16):
        xgr = _xgr()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()  # done compiles, least recently used first
        self._cache_bytes = 0
        self.cache_size_bytes = cache_size_bytes
        self.any_whitespace = any_whitespace  # for JSON constraints that do not say
        self.max_whitespace = max_whitespace
        self._lock = threading.Lock()
        self._compile_seconds: list[float] = []  # compiles finished since take_compile_seconds()
        self._pending: dict[tuple, Future] = {}  # compiles in flight, by key

    def grammar_for(self, params: SamplingParams) -> RequestGrammar:
        """The request's grammar, compiling unless cached; ``SamplingParamsError``
        (a ValueError) when the constraint is invalid."""
        so = params.structured_outputs
        assert so is not None
        if not self.any_whitespace and so.kind in ("json", "json_object") and not so.disable_any_whitespace:
            so = StructuredOutputsParams(**{**so.__dict__, "disable_any_whitespace": True})
        key = so.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return RequestGrammar(fut)
            fut = self._pending.get(key)
            if fut is not None:
                return RequestGrammar(fut)
        grammar = check(so, self.max_whitespace)
        fut = self._pool.submit(self._compile, grammar)
        with self._lock:
            self._pending[key] = fut
        fut.add_done_callback(lambda f: self._finished(key, f))
        return RequestGrammar(fut)

    def _compile(self, grammar: Any) -> Any:
        t0 = time.perf_counter()
        compiled = self._compiler.compile_grammar(grammar)
        with self._lock:
            self._compile_seconds.append(time.perf_counter() - t0)
        return compiled

    def _finished(self, key: tuple, fut: Future) -> None:
        with self._lock:
            self._pending.pop(key, None)
            if fut.cancelled() or fut.exception() is not None:
                log.error("compiling a grammar failed: %s", None if fut.cancelled() else fut.exception())
                return
            self._cache[key] = fut
            self._cache_bytes += fut.result().memory_size_bytes
            while self._cache_bytes > self.cache_size_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.result().memory_size_bytes

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes (at most ``timeout`` seconds)."""
        with self._lock:
            pending = list(self._pending.values())
        if pending:
            wait_futures(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    def take_compile_seconds(self) -> list[float]:
        """Compile times finished since the last call (each reported once)."""
        with self._lock:
            out, self._compile_seconds = self._compile_seconds, []
        return out

    def bitmask(self, entries: list[tuple[str, RequestGrammar, list[int], list[int]]]) -> StepBitmask:
        """Rows for (request id, grammar, output tokens, drafts) of the requests
        sampled this step: one per draft position and one past them."""
        xgr = _xgr()
        total = sum(1 + len(drafts) for *_, drafts in entries)
        tensor = xgr.allocate_token_bitmask(total, self.vocab_size)
        rows: dict[str, tuple[int, int]] = {}
        r = 0
        for rid, g, outputs, drafts in entries:
            g.sync(outputs)
            m = g.matcher
            rows[rid] = (r, 1 + len(drafts))
            fed = 0
            for j in range(len(drafts) + 1):
                if m.is_terminated():  # past the end: only what already ended it (rows stay all-allowed)
                    break
                m.fill_next_token_bitmask(tensor, r + j)
                if j < len(drafts):
                    if not m.accept_token(drafts[j]):
                        break
                    fed += 1
            if fed:
                m.rollback(fed)
            r += 1 + len(drafts)
        return StepBitmask(tensor, rows, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
