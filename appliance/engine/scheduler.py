"""The token-budget scheduler (torch-free), after vLLM V1's.

Each ``schedule()`` hands out ``{request_id: num_tokens}`` under one token
budget (``max_num_batched_tokens``) and ``max_num_seqs``; a prefill chunk, a
decode and a prefix hit are only different token counts. A step is two
phases over one ``_Budget``: running requests, then waiting ones. KV blocks
are allocated inside the decision (the KV manager alone does the block
arithmetic); when they do not fit, a running request is preempted by
recompute: its blocks are freed and it returns to the front of the queue.

Victims: under FCFS the most recently scheduled running request; under
priority the one with the largest (priority, arrival_time). Unlike vLLM V1
(issue #40004), a waiting request of strictly higher priority (smaller
value) may preempt a running one even when running is at ``max_num_seqs``
or the pool is full.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Union

from appliance.engine.kv_connector import KVConnectorOutput
from appliance.engine.kv_cache.manager import GroupBlocks, KVCacheManager
from appliance.engine.request import Request, RequestStatus
from appliance.engine.request_queue import FCFSQueue, PriorityQueue
from appliance.engine.scheduler_output import CachedRequestData, NewRequestData, RequestUpdate, SchedulerOutput

if TYPE_CHECKING:  # the protocol sits beside the engine's others; the core imports this module
    from appliance.engine.interfaces import KVConnectorScheduler

_rank = attrgetter("priority", "arrival_time")  # preemption victims: the largest first


@dataclass
class _Budget:
    """What one step may still take (tokens, unfinished prefills) and what it
    took: a request preempted later in the step gives its tokens back."""

    tokens: int
    partial_slots: int  # prefills the step may still leave unfinished...
    long_partial_slots: int  # ...of which long ones (prompt over long_threshold)
    long_threshold: int  # 0: no chunk cap, nothing is long
    reqs: int = 1 << 62  # requests the step may still take
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)  # of running requests, per group
    preempted: list[Request] = field(default_factory=list)

    def cap(self, num_new: int) -> int:
        if self.long_threshold > 0:
            num_new = min(num_new, self.long_threshold)
        return min(num_new, self.tokens)

    def is_long(self, req: Request) -> bool:
        return 0 < self.long_threshold < req.num_prompt_tokens

    def admits(self, req: Request, num_new: int, num_hits: int = 0) -> bool:
        """Whether a free partial-prefill slot exists, if ``req`` needs one
        (``num_hits`` prefix-cache tokens count as computed)."""
        if req.num_computed_tokens + num_hits + num_new >= req.num_tokens:
            return True
        return self.partial_slots > 0 and not (self.is_long(req) and self.long_partial_slots <= 0)

    def take(self, req: Request, num_new: int) -> None:
        if req.num_computed_tokens + num_new < req.num_tokens:
            self.partial_slots -= 1
            self.long_partial_slots -= self.is_long(req)
        self.num_scheduled[req.request_id] = num_new
        self.tokens -= num_new
        self.reqs -= 1

    def preempt(self, req: Request) -> None:
        """Record a victim, returning its tokens (a partial-prefill slot stays taken)."""
        self.preempted.append(req)
        if req.request_id in self.num_scheduled:
            self.tokens += self.num_scheduled.pop(req.request_id)
            self.reqs += 1
            self.new_block_ids.pop(req.request_id, None)


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, policy: str = "fcfs", enable_chunked_prefill: bool = True,
                 long_prefill_token_threshold: int = 0, max_num_partial_prefills: int = 1,
                 max_long_partial_prefills: int = 1, num_lookahead_tokens: int = 0,
                 connector: Optional[KVConnectorScheduler] = None, long_rope_from: Optional[int] = None):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.kv, self.max_num_batched_tokens, self.max_num_seqs = kv_cache_manager, max_num_batched_tokens, max_num_seqs
        self.max_model_len, self.policy, self.enable_chunked_prefill = max_model_len, policy, enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_num_partial_prefills, self.max_long_partial_prefills = (max_num_partial_prefills,
                                                                         max_long_partial_prefills)
        self.num_lookahead_tokens = num_lookahead_tokens
        self.connector = connector  # a KV connector's scheduler side (engine/kv_connector.py), or None
        # a LongRoPE model's original context: a sequence longer than this takes the long frequencies at every
        # position (Request.long_rope), one that grows past it is computed again with them (_restarts_long)
        self.long_rope_from = long_rope_from
        self.send_token_ids = False  # ranks that do not sample (pipeline stages before the last) need the tokens
        self._in_flight: set[str] = set()  # requests of steps not back yet: not preempted (see schedule)
        self.requests: dict[str, Request] = {}
        self.waiting: FCFSQueue | PriorityQueue = PriorityQueue() if policy == "priority" else FCFSQueue()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self._held: dict[str, Request] = {}  # finished requests whose blocks a KV connector still needs
        self._fetched: dict[str, None] = {}  # waiting requests whose remote KV arrived: first in the queue

    # ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(f"prompt of {request.num_tokens} tokens leaves no room below "
                             f"max_model_len={self.max_model_len}")
        need = self.kv.most_blocks(request.num_tokens + 1 + self.num_lookahead_tokens, self.max_num_batched_tokens)
        if need > self.kv.num_blocks - 1:  # it would wait (or preempt itself) for ever
            raise ValueError(f"prompt of {request.num_tokens} tokens needs {need} KV cache blocks to run; the cache "
                             f"has {self.kv.num_blocks - 1}")
        request.long_rope = self.long_rope_from is not None and request.num_tokens > self.long_rope_from
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def add_forked(self, request: Request) -> None:
        """A request whose KV its table holds already (a beam's fork, ``KVCacheManager.fork``), first in the queue."""
        self.requests[request.request_id] = request
        self.waiting.prepend(request)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            (self.running if req.status == RequestStatus.RUNNING else self.waiting).remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(req)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(len(self.waiting))

    # ------------------------------------------------------------------------
    def schedule(self, max_reqs: Optional[int] = None, in_flight: Iterable[str] = (),
                 token_budget: Optional[int] = None) -> SchedulerOutput:
        """Decide one step: tokens per request, blocks allocated, victims preempted.

        With steps in flight (pipeline stages working on several), a
        request whose step has not come back is not scheduled until it has
        (unless it has prompt left to compute), and the ones in ``in_flight``
        are never preempted: their outputs are still to come. ``max_reqs``
        caps the requests the step takes (None: no cap but ``max_num_seqs``'s
        on running requests); ``token_budget`` the tokens it schedules (None:
        ``max_num_batched_tokens``; a latency objective sets it per step)."""
        out = SchedulerOutput()
        tokens = self.max_num_batched_tokens if token_budget is None else token_budget
        budget = _Budget(tokens=tokens, partial_slots=self.max_num_partial_prefills,
                         long_partial_slots=self.max_long_partial_prefills,
                         long_threshold=self.long_prefill_token_threshold)
        if max_reqs is not None:
            budget.reqs = max_reqs
        self._in_flight = set(in_flight)
        self._schedule_running(budget)
        # A step that had to preempt admits nobody, unless a strictly higher
        # priority makes room for itself.
        if self.policy == "priority" or not budget.preempted:
            self._schedule_waiting(budget, out)
        for rid, block_ids in budget.new_block_ids.items():
            req = self.requests[rid]
            new_ids = None
            if self.send_token_ids:
                end = min(req.num_tokens, req.num_computed_tokens + budget.num_scheduled[rid])
                new_ids = req.all_token_ids[req.num_tokens_sent : end]
                req.num_tokens_sent = max(end, req.num_tokens_sent)
            out.scheduled_cached_reqs.append(CachedRequestData(rid, block_ids, req.num_computed_tokens, new_ids))
            if req.spec_token_ids:
                out.scheduled_spec_decode_tokens[rid] = list(req.spec_token_ids)
        out.num_scheduled_tokens = budget.num_scheduled
        out.total_num_scheduled_tokens = sum(budget.num_scheduled.values())
        if out.num_scheduled_tokens:  # the forks' block copies, done before this step's layers write
            out.blocks_to_copy = self.kv.take_copies()
        # A victim readmitted later in the step is running again.
        out.preempted_req_ids = {r.request_id for r in budget.preempted if r.status == RequestStatus.PREEMPTED}
        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        assert out.total_num_scheduled_tokens <= tokens
        assert len(self.running) <= self.max_num_seqs
        # Advance computed tokens now, as if the step already ran (vLLM V1).
        for rid, n in budget.num_scheduled.items():
            self.requests[rid].num_computed_tokens += n
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(budget.num_scheduled, self.requests,
                                                                            self.kv.connector_block_ids)
        return out

    def _schedule_running(self, budget: _Budget) -> None:
        """Phase 1, in running order; a request the pool cannot fit preempts
        the newest (FCFS) or the largest rank (priority), maybe itself."""
        for req in list(self.running):
            if budget.tokens <= 0 or budget.reqs <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted to make room for an earlier one
            num_new = budget.cap(req.num_tokens_with_spec - req.num_computed_tokens)
            num_new = min(num_new, self.max_model_len - 1 - req.num_computed_tokens)
            if self.long_rope_from is not None and self._restarts_long(req, num_new, budget):
                continue
            # Drafts past what the budget or the length allows are dropped, not verified.
            del req.spec_token_ids[max(0, req.num_computed_tokens + num_new - req.num_tokens):]
            if num_new <= 0 or not budget.admits(req, num_new):
                continue
            allocate = partial(self.kv.allocate_slots, req, num_new, num_lookahead_tokens=self._lookahead(req, num_new))
            while (blocks := allocate()) is None:
                victim = self._victim()
                if victim is None:  # the others' steps are in flight: it waits for one to end
                    break
                self._preempt(victim, budget)
                if victim is req:
                    break
            if blocks is not None:
                budget.take(req, num_new)
                budget.new_block_ids[req.request_id] = tuple([[b.block_id for b in g] for g in blocks])

    def _schedule_waiting(self, budget: _Budget, out: SchedulerOutput) -> None:
        """Phase 2, in queue order: prefix hits first, then new blocks."""
        skipped: list[Request] = []  # over the partial-prefill limits, or compiling: they keep their place
        # Preempted this step: not readmitted. Refreshed on admission only, so a
        # victim of a seat made for a request that is then skipped may be.
        barred = {r.request_id for r in budget.preempted}
        self._fetched_first()
        while len(self.waiting) and budget.tokens > 0 and budget.reqs > 0:
            req = self.waiting.peek()
            if req.request_id in barred:
                break
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(self.waiting.pop())
                continue
            if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                assert req.grammar is not None  # it waits for its grammar
                if not req.grammar.ready():
                    skipped.append(self.waiting.pop())
                    continue
                req.status = RequestStatus.WAITING
            if not self._has_seat() and not self._preempt_lower_priority(req, budget, self._has_seat):
                break
            hits, num_hit_tokens = (self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0
                                    else (self.kv.empty(), 0))
            num_external, load_async = 0, False  # tokens past the pool's hits that the KV connector supplies
            if self.connector is not None and req.num_computed_tokens == 0 \
                    and req.sampling_params.prompt_logprobs is None:
                num_external, load_async = self.connector.get_num_new_matched_tokens(req, num_hit_tokens)
            if load_async:
                if not self._start_remote_load(req, hits, num_hit_tokens, num_external):
                    break
                skipped.append(self.waiting.pop())
                continue
            num_local_hits, num_hit_tokens = num_hit_tokens, num_hit_tokens + num_external
            if req.num_computed_tokens == 0:  # else its remote KV arrived: _start_remote_load counted it
                req.num_external_tokens = num_external
            num_new = req.num_tokens - req.num_computed_tokens - num_hit_tokens
            if not self.enable_chunked_prefill and num_new > budget.tokens:
                break
            num_new = budget.cap(num_new)
            if not budget.admits(req, num_new, num_hit_tokens) or num_new <= 0:
                skipped.append(self.waiting.pop())
                continue
            args = (req, num_new, num_hit_tokens, hits, self._lookahead(req, num_hit_tokens + num_new))
            fits = partial(self.kv.can_allocate, *args)
            if not fits() and not self._preempt_lower_priority(req, budget, fits):
                break
            self.kv.allocate_slots(*args)
            if num_external:
                assert self.connector is not None  # only a connector supplies external tokens
                self.connector.update_state_after_alloc(req, self.kv.connector_block_ids(req.request_id),
                                                        num_local_hits, num_external)
            self.waiting.pop()
            resumed = req.status == RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.num_computed_tokens += num_hit_tokens
            budget.take(req, num_new)
            self.running.append(req)
            out.scheduled_new_reqs.append(NewRequestData(
                req.request_id, list(req.all_token_ids), req.num_prompt_tokens, self.kv.get_block_ids(req.request_id),
                req.num_computed_tokens, req.sampling_params, resumed, req.num_external_tokens))
            req.num_tokens_sent, req.num_external_tokens = req.num_tokens, 0
            barred.update(r.request_id for r in budget.preempted)
        for req in reversed(skipped):
            self.waiting.prepend(req)

    def _start_remote_load(self, req: Request, hits: GroupBlocks, num_hit_tokens: int, num_external: int) -> bool:
        """Blocks for the pool's hits and ``num_external`` tokens a KV
        connector fills in the background: the request waits for them in
        WAITING_FOR_REMOTE_KVS, taking nothing from this step's budget.
        Their prefix-cache entries wait for the KV too. False when the pool
        cannot fit them now."""
        args = (req, num_external + 1, num_hit_tokens, hits)  # the last token's slot too: then it always fits
        if not self.kv.can_allocate(*args):
            return False
        self.kv.allocate_slots(*args, delay_cache_blocks=True)
        assert self.connector is not None  # only a connector loads in the background
        self.connector.update_state_after_alloc(req, self.kv.connector_block_ids(req.request_id), num_hit_tokens,
                                                num_external)
        req.num_computed_tokens = num_hit_tokens
        req.num_cached_tokens = num_hit_tokens + num_external
        req.num_external_tokens = num_external
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        return True

    def _fetched_first(self) -> None:
        """Requests whose remote KV arrived go to the front of the queue:
        they hold every block they need, and a request ahead of them that
        cannot fit must not keep them (and their blocks) waiting."""
        for rid in reversed(list(self._fetched)):
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.WAITING:
                del self._fetched[rid]
                continue
            self.waiting.remove(req)
            self.waiting.prepend(req)

    def update_from_connector_output(self, output: Optional[KVConnectorOutput]) -> None:
        """What the KV connector's worker side finished: a request whose
        remote KV arrived is waiting to run its last prompt token; one whose
        load failed gives its blocks back and computes its prompt; a
        finished request's blocks a connector held are freed."""
        if self.connector is None:
            return
        self._apply_connector_report(output)
        late = self.connector.overdue()
        if late is not None:
            self._apply_connector_report(late)

    def _apply_connector_report(self, output: Optional[KVConnectorOutput]) -> None:
        connector = self.connector
        assert connector is not None  # reports come from a connector's worker side
        if output is not None and output.by_rank is not None:  # an engine core's ranks each reported
            output = connector.combine_ranks(output)
        for rid in output.finished_recving if output is not None else ():
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                req.num_computed_tokens = connector.recving[rid]
                req.status = RequestStatus.WAITING
                self._fetched[rid] = None
            self._release(rid)
        for rid in output.failed_recving if output is not None else ():
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.kv.free(req)
                req.num_computed_tokens, req.num_cached_tokens, req.num_external_tokens = 0, -1, 0
                req.status = RequestStatus.WAITING
            self._release(rid)
        for rid in output.finished_sending if output is not None else ():
            self._release(rid)
        connector.update_connector_output(output)

    def _release(self, rid: str) -> None:
        """Free a finished request's blocks that a KV connector held."""
        req = self._held.pop(rid, None)
        if req is not None:
            self.kv.free(req)

    def _lookahead(self, req: Request, num_new: int) -> int:
        """Slots reserved past this step's tokens (for a draft model's KV), never past max_model_len."""
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - (req.num_computed_tokens + num_new)))

    def _victim(self) -> Optional[Request]:
        """Whom to preempt for room: the most recently scheduled running request
        (FCFS) or the largest rank (priority), of those with no step in flight."""
        free = [r for r in self.running if r.request_id not in self._in_flight] if self._in_flight else self.running
        if not free:
            return None
        return max(free, key=_rank) if self.policy == "priority" else free[-1]

    def _has_seat(self) -> bool:
        return len(self.running) < self.max_num_seqs

    def _preempt_lower_priority(self, req: Request, budget: _Budget, fits: Callable[[], bool]) -> bool:
        """Under priority, preempt running requests of strictly lower priority
        (larger value), largest rank first, until ``fits()`` (a seat, or the
        blocks for ``req``). False when it still does not fit."""
        while self.policy == "priority" and not fits():
            victims = [r for r in self.running if r.priority > req.priority and r.request_id not in self._in_flight]
            if not victims:
                return False
            self._preempt(max(victims, key=_rank), budget)
        return fits()

    def _preempt(self, victim: Request, budget: _Budget, counted: bool = True) -> None:
        """Preempt by recompute: free its KV, back to the front of the queue (counted: as a preemption)."""
        self.running.remove(victim)
        budget.preempt(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += counted
        self.num_preemptions += counted
        self.waiting.prepend(victim)

    def _restarts_long(self, req: Request, num_new: int, budget: _Budget) -> bool:
        """Whether this step takes a short-rope sequence past a LongRoPE context: then (none of it in flight) it is
        computed again on the long frequencies (transformers' Phi-3 drops its cache there), hashed as long."""
        original = self.long_rope_from
        if original is None or req.long_rope or req.num_computed_tokens + num_new <= original:
            return False
        if req.request_id not in self._in_flight:
            req.long_rope, req.block_hashes = True, []
            self._preempt(req, budget, counted=False)
        return True

    # ------------------------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput, sampled_token_ids: dict[str, list[int]],
                           stopped_by_caller: Optional[dict[str, tuple[int, Union[str, int, None]]]] = None,
                           draft_token_ids: Optional[dict[str, list[int]]] = None) -> list[RequestUpdate]:
        """Append sampled tokens and apply stop conditions.

        ``sampled_token_ids`` has an entry for every scheduled request that
        reached the end of its known tokens (a prefill chunk in the middle
        of a prompt samples nothing). With speculative decoding an entry may
        hold several accepted tokens, appended one by one with the stop
        checks after each. ``stopped_by_caller`` maps a request the caller
        ends (a stop string in the detokenized text, a grammar that
        terminated) to (how many of this step's tokens to keep, the stop reason): the tokens after those are not
        appended. ``draft_token_ids`` are the drafts proposed for the next step of requests still running."""
        stopped_by_caller = stopped_by_caller or {}
        draft_token_ids = draft_token_ids or {}
        updates = []
        for rid in sched_out.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran, or (a step before it failed) to be recomputed
            tokens = sampled_token_ids.get(rid, [])
            if num_spec := len(sched_out.scheduled_spec_decode_tokens.get(rid, [])):
                # Rejected draft tokens' KV is recomputed: roll back computed tokens.
                req.num_computed_tokens -= num_spec + 1 - len(tokens)
                req.spec_token_ids = []
            new_tokens: list[int] = []
            status = None
            keep, caller_reason = stopped_by_caller.get(rid, (len(tokens), None))
            for tok in tokens[:keep]:
                req.append_output_token(tok)
                new_tokens.append(tok)
                status, reason = self._stop(req, tok, req.num_output_tokens, req.num_tokens)
                if status is not None:
                    req.stop_reason = reason
                    break
            if rid in stopped_by_caller and status is None:
                req.stop_reason = caller_reason
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            else:
                req.spec_token_ids = list(draft_token_ids.get(rid, ()))
            updates.append(RequestUpdate(req, new_tokens, status is not None))
        return updates

    def num_kept(self, req: Request, tokens: list[int]) -> int:
        """How many of ``tokens`` (sampled this step) ``update_from_output``
        appends before a stop condition ends the request (all if none):
        the caller looks for stop strings in those only."""
        for j, tok in enumerate(tokens, 1):
            if self._stop(req, tok, req.num_output_tokens + j, req.num_tokens + j)[0] is not None:
                return j
        return len(tokens)

    def _stop(self, req: Request, tok: int, num_output: int, num_tokens: int):
        """(status, stop_reason) once ``tok`` is appended as output token
        ``num_output`` (``num_tokens`` in all); (None, None) to go on."""
        sp = req.sampling_params
        if num_output >= sp.min_tokens:
            if not sp.ignore_eos and tok == req.eos_token_id:
                return RequestStatus.FINISHED_STOPPED, None
            if tok in sp.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, tok
        if num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        if sp.max_tokens is not None and num_output >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        held = False
        if self.connector is not None:
            held, req.kv_transfer_params = self.connector.request_finished(req,
                                                                           self.kv.connector_block_ids(req.request_id))
        if held:
            self._held[req.request_id] = req
        else:
            self.kv.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]
