"""Grammars compiled off the step loop, one matcher per request, and each
step's token bitmask (see the package docstring)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from appliance.sampling_params import SamplingParams
from appliance.structured_output.check import (ConstraintLimits, TokenSpelling, _xgr, check, check_writable,
                                               effective_constraint, tokenizer_info)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("appliance.structured")

@dataclass(frozen=True)
class ReasoningTags:
    """Token ids of a reasoning parser's tags (``server.reasoning_parser``):
    a request's grammar applies to its answer, after the end tag."""

    start: tuple[int, ...]
    end: tuple[int, ...]

    def ended_in(self, ids: Sequence[int]) -> bool:
        """Whether the last tag in ``ids`` (a prompt) is the end tag: a
        template that closed the reasoning itself (Qwen3's
        ``enable_thinking: false``) leaves the whole output to the grammar."""
        s, e = list(self.start), list(self.end)
        for i in range(len(ids), 0, -1):
            if ids[i - 1] == e[-1] and list(ids[max(0, i - len(e)):i]) == e:
                return True
            if ids[i - 1] == s[-1] and list(ids[max(0, i - len(s)):i]) == s:
                return False
        return False


class ReasoningGate:
    """Where a request's reasoning ends: the tokens before (and of) the end
    tag are the reasoning's, unconstrained; the grammar takes the rest."""

    def __init__(self, tags: ReasoningTags, ended_in_prompt: bool):
        self.end = list(tags.end)
        self.initial = ended_in_prompt
        self.ended = ended_in_prompt
        self.tail: list[int] = []  # the last tokens of the reasoning, as many as the end tag has

    def reset(self) -> None:
        self.ended, self.tail = self.initial, []

    def take(self, tok: int) -> None:
        self.tail = (self.tail + [tok])[-len(self.end):]
        self.ended = self.tail == self.end

    def ends_within(self, drafts: list[int]) -> Optional[int]:
        """How many of ``drafts`` end the reasoning (the last of them completes the end tag); None: none do."""
        tail = self.tail
        for j, tok in enumerate(drafts, 1):
            tail = (tail + [tok])[-len(self.end):]
            if tail == self.end:
                return j
        return None


class RequestGrammar:
    """One request's grammar: compiling (``ready()`` False), failed
    (``error``), or a matcher over the request's output tokens (over its
    answer, after the reasoning, with a ``ReasoningGate``)."""

    def __init__(self, future: Future, gate: Optional[ReasoningGate] = None):
        self._future = future
        self._matcher: Any = None
        self.gate = gate
        self.num_accepted = 0  # output tokens taken, the reasoning's included

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

    @property
    def answering(self) -> bool:
        """The grammar applies to the next token (no reasoning, or it ended)."""
        return self.gate is None or self.gate.ended

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher's state the one after ``output_token_ids``."""
        if self.num_accepted == len(output_token_ids):
            return
        self.matcher.reset()
        if self.gate is not None:
            self.gate.reset()
        self.num_accepted = 0
        self.accept(output_token_ids)

    def accept(self, token_ids: list[int]) -> int:
        """Advance over ``token_ids``; how many were accepted (stops at the
        first the grammar refuses; reasoning takes any)."""
        for j, tok in enumerate(token_ids):
            if not self.answering:
                assert self.gate is not None  # not answering: reasoning
                self.gate.take(tok)
            elif not self.matcher.accept_token(tok):
                return j
            self.num_accepted += 1
        return len(token_ids)

    def is_terminated(self) -> bool:
        return self.answering and self.matcher.is_terminated()

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of ``drafts`` the grammar allows in a row (state
        unchanged); in reasoning, those up to the one that ends it."""
        if not self.answering:
            assert self.gate is not None
            ends = self.gate.ends_within(drafts)
            return len(drafts) if ends is None else ends
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
                 cache_size_bytes: int = 512 << 20, any_whitespace: bool = True, max_whitespace: Optional[int] = 16,
                 limits: Optional[ConstraintLimits] = None, reasoning: Optional[ReasoningTags] = None):
        xgr = _xgr()
        self.reasoning = reasoning
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.limits = limits or ConstraintLimits()
        self._spelling: Optional[TokenSpelling] = None  # made for the first choice constraint
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=num_threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()  # done compiles, least recently used first
        self._cache_bytes = 0
        self.cache_size_bytes = cache_size_bytes
        self.any_whitespace = any_whitespace  # for JSON constraints that do not say
        self.max_whitespace = max_whitespace
        self._lock = threading.Lock()
        self._compile_seconds: list[float] = []  # compiles finished since take_compile_seconds()
        self._pending: dict[tuple, Future] = {}  # compiles in flight, by key

    def grammar_for(self, params: SamplingParams, prompt_token_ids: Sequence[int] = ()) -> RequestGrammar:
        """The request's grammar, compiling unless cached; ``SamplingParamsError``
        (a ValueError) when the constraint is invalid. With ``reasoning`` tags
        it applies after the output's end tag, or from the start when the
        prompt's last tag is the end tag."""
        gate = None if self.reasoning is None else ReasoningGate(self.reasoning,
                                                                  self.reasoning.ended_in(prompt_token_ids))
        return self._grammar(params, gate)

    def _grammar(self, params: SamplingParams, gate: Optional[ReasoningGate]) -> RequestGrammar:
        so = params.structured_outputs
        assert so is not None
        so = effective_constraint(so, self.any_whitespace)
        key = so.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return RequestGrammar(fut, gate)
            fut = self._pending.get(key)
            if fut is not None:
                return RequestGrammar(fut, gate)
        grammar = check(so, self.max_whitespace, self.limits)
        if so.kind == "choice":
            if self._spelling is None:
                self._spelling = TokenSpelling(self.info)
            check_writable(so, self._spelling)
        fut = self._pool.submit(self._compile, grammar)
        with self._lock:
            self._pending[key] = fut
        fut.add_done_callback(lambda f: self._finished(key, f))
        return RequestGrammar(fut, gate)

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
            first = 0  # rows before the answer's first stay all-allowed (reasoning)
            if not g.answering:
                assert g.gate is not None
                ends = g.gate.ends_within(drafts)
                first = len(drafts) + 1 if ends is None else ends
            fed = 0
            for j in range(first, len(drafts) + 1):
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
