"""Beam search (``SamplingParams.use_beam_search``), torch-free: the
algorithm of transformers' ``generate(num_beams=n)`` run on the engine's
requests.

A search over one prompt keeps ``n`` running beams. Each step, every
running beam is a one-token *step request* of its tokens so far: it
computes one position and returns the top K log-probabilities of the next
token (K = max(2, 1 + number of stop tokens) x n, transformers'
``beams_to_keep``). When all of a step's requests are back,
``BeamSearch.advance`` ranks the candidates (a beam's summed
log-probabilities plus a token's), finishes the best ones that end on a
stop token or at the length limit, and picks the next running beams. Each
continues from its parent's KV by a fork (``KVCacheManager.fork``): the
parent's blocks are shared and the partly filled last one is copied on
write, so a step costs one decoded token per beam. Step requests are
requests like any other: they take the step's token budget, seats and
blocks, wait for them, and are preempted (and recomputed) as the scheduler
decides.

Scores: a finished beam's is its summed log-probabilities over its length
(its tokens, the stop token included) to the power ``length_penalty``.
``early_stopping``: True ends the search once n beams finished; False
once the best running beam, at its current length, cannot beat the worst
of n finished; "never" as False but at the longest length the limit
allows when the penalty is positive (the canonical bound). The beams come
back best first, each with its tokens and text.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

from appliance.engine.outputs import BeamSequence, RequestOutputDelta
from appliance.engine.request import Request, RequestStatus
from appliance.sampling_params import SamplingParams

if TYPE_CHECKING:
    from appliance.engine.scheduler import Scheduler

def _f32(x: float) -> float:
    """``x`` rounded to float32: the scores are float32 sums and quotients, as transformers keeps them."""
    return struct.unpack("f", struct.pack("f", x))[0]


def num_candidates(num_beams: int, num_stop_ids: int) -> int:
    """Candidates ranked each step (the top-logprobs each beam returns): transformers' beams_to_keep."""
    return max(2, 1 + num_stop_ids) * num_beams


@dataclass
class Beam:
    token_ids: list[int]  # generated so far
    score: float  # their summed log-probabilities


@dataclass
class Hypothesis:
    token_ids: list[int]
    score: float  # summed log-probabilities / length ** length_penalty
    finish_reason: str  # "stop" (a stop token ended it) or "length"
    stop_reason: Optional[int] = None  # the stop token id, when not the EOS


class BeamSearch:
    """One prompt's search, step by step: ``advance`` with each running
    beam's top next tokens until ``done``; ``results`` then."""

    def __init__(self, num_beams: int, max_new_tokens: int, stop_ids: Sequence[int], eos_token_id: Optional[int],
                 length_penalty: float = 1.0, early_stopping: Union[bool, str] = False):
        self.num_beams, self.max_new_tokens = num_beams, max_new_tokens
        self.stop_ids, self.eos_token_id = frozenset(stop_ids), eos_token_id
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.num_candidates = num_candidates(num_beams, len(self.stop_ids))
        self.running = [Beam([], 0.0)]
        self.finished: list[Hypothesis] = []  # the best num_beams so far, best first
        self.improvable = True  # whether a running beam may still beat the worst finished one
        self.done = False

    def advance(self, tops: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, int]]:
        """``tops[i]``: running beam i's top next tokens as (token id, logprob).
        The next running beams as (index of the parent beam, token), best
        first; none once the search is done."""
        if self.done or len(tops) != len(self.running):
            raise ValueError(f"advance takes the top tokens of each of the {len(self.running)} running beams")
        nb, lp = self.num_beams, self.length_penalty
        generated = len(self.running[0].token_ids)
        cands = sorted(((_f32(b.score + logprob), i, tok)
                        for i, (b, top) in enumerate(zip(self.running, tops)) for tok, logprob in top),
                       key=lambda c: -c[0])[: self.num_candidates]
        at_limit = generated + 1 >= self.max_new_tokens
        full = len(self.finished) == nb
        accepts = self.improvable and not (full and self.early_stopping is True)
        new: list[Hypothesis] = []
        nxt: list[tuple[int, int, float]] = []
        for rank, (score, i, tok) in enumerate(cands):
            stops = tok in self.stop_ids
            if stops or at_limit:
                if rank < nb and accepts:  # only the top n may finish (the rest keep n beams running)
                    norm = _f32(score / _f32((generated + 1) ** lp))
                    new.append(Hypothesis(self.running[i].token_ids + [tok], norm, "stop" if stops else "length",
                                          tok if stops and tok != self.eos_token_id else None))
            elif len(nxt) < nb:
                nxt.append((i, tok, score))
        self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:nb]
        self.running = [Beam(self.running[i].token_ids + [tok], score) for i, tok, score in nxt]
        generated += 1
        if len(self.finished) == nb and self.running:
            longest = self.max_new_tokens if self.early_stopping == "never" and lp > 0 else generated
            best = _f32(self.running[0].score / _f32(longest ** lp))
            self.improvable = self.improvable and best > min(h.score for h in self.finished)
        all_stopped = all(tok in self.stop_ids or at_limit for _, _, tok in cands)
        self.done = (not self.running or not self.improvable or all_stopped
                     or (len(self.finished) == nb and self.early_stopping is True))
        return [] if self.done else [(i, tok) for i, tok, _ in nxt]

    def results(self) -> list[Hypothesis]:
        """The n best finished beams, best first (running ones fill in, scored at their length, if fewer finished)."""
        out = list(self.finished)
        for b in self.running[: self.num_beams - len(out)]:
            n = max(1, len(b.token_ids))
            out.append(Hypothesis(b.token_ids, _f32(b.score / _f32(n ** self.length_penalty)), "length"))
        return sorted(out, key=lambda h: -h.score)


@dataclass
class _Group:
    """One request's search and its step requests in the engine."""

    request_id: str
    prompt: list[int]
    params: SamplingParams  # the request's
    step_params: SamplingParams  # each step request's: one token, the candidates' logprobs
    search: BeamSearch
    priority: int
    cache_salt: Optional[str]
    arrival_time: Optional[float]
    pending: dict[str, int] = field(default_factory=dict)  # step request id -> running beam index
    tops: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # beam index -> its top next tokens
    held: dict[int, str] = field(default_factory=dict)  # beam index -> the holder of its step request's KV
    num_cached_tokens: int = -1  # the first step's prefix-cache hit
    queue_time: Optional[float] = None


class BeamSearches:
    """The engine core's beam searches: each runs its steps as requests of
    the scheduler, forks their KV for the next beams, and reports one
    output when it ends (``RequestOutputDelta.beams``)."""

    def __init__(self, scheduler: Scheduler, eos_token_id: Optional[int],
                 decode: Callable[[list[int], bool], str]):
        self.scheduler = scheduler
        self.eos_token_id = eos_token_id
        self.decode = decode  # (token ids, skip_special_tokens) -> text
        self.groups: dict[str, _Group] = {}
        self.steps: dict[str, _Group] = {}  # step request id -> its search
        self._ids = itertools.count()
        self.num_kv_releases = 0  # times the held KV went back to let requests run (``release_kv``)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def is_step(self, request_id: str) -> bool:
        return request_id in self.steps

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int = 0,
            cache_salt: Optional[str] = None, arrival_time: Optional[float] = None) -> None:
        """Start a search; raises ValueError (nothing kept) for one the engine cannot run."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in the scheduler")
        stop_ids = list(dict.fromkeys(([] if params.ignore_eos or self.eos_token_id is None else [self.eos_token_id])
                                      + params.stop_token_ids))
        limit = self.scheduler.max_model_len - len(prompt)
        max_new = limit if params.max_tokens is None else min(params.max_tokens, limit)
        search = BeamSearch(params.n, max_new, stop_ids, self.eos_token_id, params.length_penalty,
                            params.early_stopping)
        step_params = replace(params, n=1, use_beam_search=False, length_penalty=1.0, early_stopping=False,
                              temperature=0.0, max_tokens=1, ignore_eos=True, stop_token_ids=[],
                              logprobs=search.num_candidates)
        g = _Group(request_id, list(prompt), params, step_params, search, priority, cache_salt, arrival_time)
        self._submit(g, 0, Request(self._step_id(g), g.prompt, step_params, eos_token_id=self.eos_token_id,
                                   arrival_time=arrival_time, priority=priority, cache_salt=cache_salt), fork=False)
        self.groups[request_id] = g

    def _step_id(self, g: _Group) -> str:
        return f"{g.request_id}#beam{next(self._ids)}"

    def _submit(self, g: _Group, beam: int, req: Request, fork: bool) -> None:
        if fork:
            self.scheduler.add_forked(req)
        else:
            self.scheduler.add_request(req)
        g.pending[req.request_id] = beam
        self.steps[req.request_id] = g

    # -- the engine core's hooks ------------------------------------------------
    def hold(self, sampled: Sequence[str]) -> None:
        """Before a step's tokens are applied: the KV of each step request
        that sampled outlives it (it finishes now; its beam may be forked)."""
        kv = self.scheduler.kv
        for rid in sampled:
            g = self.steps.get(rid)
            req = self.scheduler.requests.get(rid)
            if g is not None and req is not None and req.status == RequestStatus.RUNNING:
                holder = f"{rid}#kv"
                kv.hold(rid, holder)
                g.held[g.pending[rid]] = holder

    def stepped(self, req: Request, top: list[tuple[int, float]]) -> list[RequestOutputDelta]:
        """A step request ended with its beam's top next tokens; the search's
        output when this was its last step."""
        g = self.steps.pop(req.request_id)
        beam = g.pending.pop(req.request_id)
        g.tops[beam] = top
        if g.num_cached_tokens < 0:
            g.num_cached_tokens = max(0, req.num_cached_tokens)
            if req.first_scheduled_time is not None:
                g.queue_time = req.first_scheduled_time - req.arrival_time
        if g.pending:
            return []
        return self._advance(g)

    def _advance(self, g: _Group) -> list[RequestOutputDelta]:
        s = g.search
        beams = [s.running[i].token_ids for i in range(len(s.running))]
        nxt = s.advance([g.tops[i] for i in range(len(beams))])
        held, g.held, g.tops = g.held, {}, {}
        children: dict[int, list[tuple[int, int]]] = {}
        for k, (parent, tok) in enumerate(nxt):
            children.setdefault(parent, []).append((k, tok))
        kv = self.scheduler.kv
        for parent, tokens in enumerate(beams):
            holder = held.get(parent)
            kids = children.get(parent, [])
            for j, (k, tok) in enumerate(kids):
                req = Request(self._step_id(g), g.prompt + tokens + [tok], g.step_params,
                              eos_token_id=self.eos_token_id, arrival_time=g.arrival_time, priority=g.priority,
                              cache_salt=g.cache_salt)
                num_computed = len(g.prompt) + len(tokens)
                if holder is not None and j == len(kids) - 1:
                    kv.move(holder, req.request_id, num_computed)  # the last child: the parent's table as it stands
                    holder, forked = None, True
                else:
                    forked = holder is not None and kv.fork(holder, req.request_id, num_computed)
                if forked:
                    req.num_computed_tokens = req.num_cached_tokens = num_computed
                self._submit(g, k, req, fork=forked)  # not forked: computed again (prefix-cache hits count)
            if holder is not None:
                kv.free_held(holder)
        return [] if nxt else [self._finish(g)]

    def _finish(self, g: _Group) -> RequestOutputDelta:
        del self.groups[g.request_id]
        skip = g.params.skip_special_tokens
        beams = [BeamSequence(h.token_ids, self.decode(h.token_ids, skip), h.finish_reason, h.stop_reason, h.score)
                 for h in g.search.results()[: g.params.n]]
        best = beams[0]
        return RequestOutputDelta(
            request_id=g.request_id, new_token_ids=[], new_text="", finished=True, finish_reason=best.finish_reason,
            stop_reason=best.stop_reason, num_prompt_tokens=len(g.prompt),
            num_output_tokens=sum(len(b.token_ids) for b in beams), num_cached_tokens=max(0, g.num_cached_tokens),
            queue_time=g.queue_time, beams=beams)

    def release_kv(self) -> bool:
        """When nothing could run (the pool short of blocks): the KV the searches
        hold for forks goes back, and their next beams compute their tokens
        again (prefix-cache hits counted). Whether anything was released."""
        kv, released = self.scheduler.kv, False
        for g in self.groups.values():
            for holder in g.held.values():
                kv.free_held(holder)
                released = True
            g.held.clear()
        for rid in self.steps:
            req = self.scheduler.requests.get(rid)
            if req is not None and req.status == RequestStatus.WAITING and req.num_computed_tokens and kv.holds(rid):
                kv.free(req)  # a fork that has not run: from its first token, like a preempted request
                req.num_computed_tokens, req.num_cached_tokens = 0, -1
                released = True
        self.num_kv_releases += released
        return released

    def abort(self, request_id: str) -> None:
        """End a search: its step requests aborted, the KV it holds freed."""
        g = self.groups.pop(request_id, None)
        if g is None:
            return
        self.scheduler.abort(list(g.pending))
        for rid in g.pending:
            self.steps.pop(rid, None)
        for holder in g.held.values():
            self.scheduler.kv.free_held(holder)

    def fail(self, step_request_id: str) -> Optional[RequestOutputDelta]:
        """A step request failed: its search ends with an error (once)."""
        g = self.steps.get(step_request_id)
        if g is None or g.request_id not in self.groups:
            return None
        self.abort(g.request_id)
        return RequestOutputDelta(request_id=g.request_id, new_token_ids=[], new_text="", finished=True,
                                  finish_reason="error", num_prompt_tokens=len(g.prompt))
