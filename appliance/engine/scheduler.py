"""The token-budget scheduler (torch-free), after vLLM V1's.

Each ``schedule()`` hands out ``{request_id: num_tokens}`` under one budget
(``max_num_batched_tokens``) and ``max_num_seqs``; a prefill chunk, a decode
and a prefix hit are only different token counts. Running requests go
first, then waiting ones. KV blocks are allocated inside the decision; when
``allocate_slots`` fails, a running request is preempted by recompute: its
blocks are freed and it returns to the front of the waiting queue.

Victims: under FCFS the most recently scheduled running request; under
priority the one with the largest (priority, arrival_time). Unlike vLLM V1
(issue #40004), a waiting request of strictly higher priority (smaller
value) may preempt a running one even when running is at ``max_num_seqs``
or the pool is full.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

from appliance.engine.kv_cache.manager import KVCacheManager
from appliance.engine.request import Request, RequestStatus


# -- queues -------------------------------------------------------------------
class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, r: Request) -> None:
        self._q.append(r)

    def prepend(self, r: Request) -> None:
        self._q.appendleft(r)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, r: Request) -> None:
        self._q.remove(r)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)


class PriorityQueue:
    """Min-heap on (priority, arrival_time): smaller priority is served first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, r: Request) -> None:
        heapq.heappush(self._heap, (r.priority, r.arrival_time, next(self._seq), r))

    prepend = add  # a preempted request keeps its (priority, arrival) rank

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, r: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not r]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (e[3] for e in sorted(self._heap))


# -- scheduler output -----------------------------------------------------------
@dataclass
class NewRequestData:
    """A request the runner has not seen (or dropped at preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far (a resumed request recomputes them all)
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: object
    resumed: bool = False


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)


@dataclass
class RequestUpdate:
    """What one step did to one request, for the caller to stream out."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        policy: str = "fcfs",
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        max_num_partial_prefills: int = 1,
        max_long_partial_prefills: int = 1,
        num_lookahead_tokens: int = 0,
    ):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.kv = kv_cache_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_num_partial_prefills = max_num_partial_prefills
        self.max_long_partial_prefills = max_long_partial_prefills
        self.num_lookahead_tokens = num_lookahead_tokens
        self.requests: dict[str, Request] = {}
        self.waiting: FCFSQueue | PriorityQueue = PriorityQueue() if policy == "priority" else FCFSQueue()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0

    # ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt of {request.num_tokens} tokens leaves no room below max_model_len={self.max_model_len}"
            )
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(req)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(len(self.waiting))

    # ------------------------------------------------------------------------
    def _rank(self, r: Request) -> tuple:
        return (r.priority, r.arrival_time)

    def _is_long(self, r: Request) -> bool:
        return 0 < self.long_prefill_token_threshold < r.num_prompt_tokens

    def _preempt(self, victim: Request) -> None:
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        scheduled_waiting: list[Request] = []
        preempted: list[Request] = []
        partial = {"all": 0, "long": 0}

        def chunk_cap(req: Request, num_new: int) -> int:
            if self.long_prefill_token_threshold > 0:
                num_new = min(num_new, self.long_prefill_token_threshold)
            return min(num_new, budget)

        def partial_allowed(req: Request, num_new: int) -> bool:
            """A prefill that this step leaves unfinished counts against the
            partial-prefill limits."""
            if req.num_computed_tokens + num_new >= req.num_tokens:
                return True
            if partial["all"] >= self.max_num_partial_prefills:
                return False
            return not (self._is_long(req) and partial["long"] >= self.max_long_partial_prefills)

        def note_partial(req: Request, num_new: int) -> None:
            if req.num_computed_tokens + num_new < req.num_tokens:
                partial["all"] += 1
                partial["long"] += self._is_long(req)

        def unschedule(victim: Request) -> None:
            nonlocal budget
            if victim.request_id in num_scheduled:
                budget += num_scheduled.pop(victim.request_id)
                new_blocks.pop(victim.request_id, None)
                scheduled_running.remove(victim)

        # 1. Running requests.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = req.num_tokens_with_spec - req.num_computed_tokens
            num_new = chunk_cap(req, num_new)
            num_new = min(num_new, self.max_model_len - 1 - req.num_computed_tokens + len(req.spec_token_ids))
            if num_new <= 0 or not partial_allowed(req, num_new):
                i += 1
                continue
            while True:
                blocks = self.kv.allocate_slots(req, num_new, num_lookahead_tokens=self.num_lookahead_tokens)
                if blocks is not None:
                    break
                if self.policy == "priority":
                    idx = max(range(len(self.running)), key=lambda j: self._rank(self.running[j]))
                else:
                    idx = len(self.running) - 1
                victim = self.running.pop(idx)
                if idx < i:
                    i -= 1
                unschedule(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status == RequestStatus.PREEMPTED:
                # req itself was the victim; `running` shrank past it.
                continue
            note_partial(req, num_new)
            scheduled_running.append(req)
            num_scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = [b.block_id for b in blocks]
            budget -= num_new
            i += 1

        # 2. Waiting requests (not in a step that had to preempt, unless a
        #    strictly higher priority makes room for itself).
        skipped: list[Request] = []
        preempted_ids = {r.request_id for r in preempted}
        while len(self.waiting) and budget > 0 and (not preempted or self.policy == "priority"):
            req = self.waiting.peek()
            if req.request_id in preempted_ids:
                break
            if len(self.running) >= self.max_num_seqs and not self._make_room_by_priority(
                req, None, num_scheduled, unschedule, preempted
            ):
                break
            hits, num_hit_tokens = [], 0
            if req.num_computed_tokens == 0:
                hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - req.num_computed_tokens - num_hit_tokens
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = chunk_cap(req, num_new)
            if not partial_allowed(req, num_new) or num_new <= 0:
                skipped.append(self.waiting.pop())
                continue
            blocks = self.kv.allocate_slots(req, num_new, num_hit_tokens, hits, self.num_lookahead_tokens)
            if blocks is None and self._make_room_by_priority(req, num_new, num_scheduled, unschedule, preempted):
                blocks = self.kv.allocate_slots(req, num_new, num_hit_tokens, hits, self.num_lookahead_tokens)
            if blocks is None:
                break
            self.waiting.pop()
            resumed = req.status == RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.num_computed_tokens += num_hit_tokens
            note_partial(req, num_new)
            self.running.append(req)
            scheduled_waiting.append(req)
            num_scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = self.kv.get_block_ids(req.request_id)
            out.scheduled_new_reqs.append(
                NewRequestData(
                    req_id=req.request_id,
                    token_ids=list(req.all_token_ids),
                    num_prompt_tokens=req.num_prompt_tokens,
                    block_ids=new_blocks[req.request_id],
                    num_computed_tokens=req.num_computed_tokens,
                    sampling_params=req.sampling_params,
                    resumed=resumed,
                )
            )
            budget -= num_new
            preempted_ids = {r.request_id for r in preempted}
        for req in reversed(skipped):
            self.waiting.prepend(req)

        for req in scheduled_running:
            out.scheduled_cached_reqs.append(
                CachedRequestData(req.request_id, new_blocks[req.request_id], req.num_computed_tokens)
            )
            if req.spec_token_ids:
                out.scheduled_spec_decode_tokens[req.request_id] = list(req.spec_token_ids)
        out.num_scheduled_tokens = num_scheduled
        out.total_num_scheduled_tokens = sum(num_scheduled.values())
        out.preempted_req_ids = {r.request_id for r in preempted if r.status == RequestStatus.PREEMPTED}
        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        assert out.total_num_scheduled_tokens <= self.max_num_batched_tokens
        assert len(self.running) <= self.max_num_seqs
        # Advance computed tokens now, as if the step already ran (vLLM V1).
        for rid, n in num_scheduled.items():
            self.requests[rid].num_computed_tokens += n
        return out

    def _make_room_by_priority(self, req, num_new, num_scheduled, unschedule, preempted) -> bool:
        """Under priority, preempt running requests of strictly lower
        priority (larger value) until ``req`` fits: a seat when ``num_new``
        is None, else enough free blocks for ``num_new`` more tokens."""
        if self.policy != "priority":
            return False
        made_room = False
        while True:
            candidates = [r for r in self.running if r.priority > req.priority]
            if not candidates:
                return made_room
            if num_new is None and len(self.running) < self.max_num_seqs:
                return True
            if num_new is not None:
                need = -(-(req.num_computed_tokens + num_new + self.num_lookahead_tokens) // self.kv.block_size)
                if need - len(self.kv.req_to_blocks.get(req.request_id, [])) <= self.kv.num_free_blocks:
                    return made_room
            victim = max(candidates, key=self._rank)
            self.running.remove(victim)
            unschedule(victim)
            self._preempt(victim)
            preempted.append(victim)
            made_room = True
            if num_new is None and len(self.running) < self.max_num_seqs:
                return True

    # ------------------------------------------------------------------------
    def update_from_output(
        self,
        sched_out: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
        stopped_by_caller: Optional[dict[str, int]] = None,
    ) -> list[RequestUpdate]:
        """Append sampled tokens and apply stop conditions.

        ``sampled_token_ids`` has an entry for every scheduled request that
        reached the end of its known tokens (a prefill chunk in the middle
        of a prompt samples nothing). With speculative decoding an entry may
        hold several accepted tokens. ``stopped_by_caller`` maps a request to
        the number of this step's tokens to keep when the caller (who sees
        detokenized text) found a stop string.
        """
        stopped_by_caller = stopped_by_caller or {}
        updates = []
        for rid in sched_out.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue  # aborted while the step ran
            tokens = sampled_token_ids.get(rid, [])
            num_spec = len(sched_out.scheduled_spec_decode_tokens.get(rid, []))
            if num_spec:
                # Rejected draft tokens' KV is recomputed: roll back computed tokens.
                num_rejected = num_spec + 1 - len(tokens)
                req.num_computed_tokens -= num_rejected
                req.spec_token_ids = []
            new_tokens: list[int] = []
            status = None
            for tok in tokens:
                req.append_output_token(tok)
                new_tokens.append(tok)
                status = self._check_stop(req, tok)
                if status is not None:
                    break
            if rid in stopped_by_caller and status is None:
                keep = stopped_by_caller[rid]
                del req.output_token_ids[len(req.output_token_ids) - len(new_tokens) + keep :]
                del req.all_token_ids[len(req.all_token_ids) - len(new_tokens) + keep :]
                new_tokens = new_tokens[:keep]
                req.stop_reason = "stop_string"
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            updates.append(RequestUpdate(req, new_tokens, status is not None))
        return updates

    def _check_stop(self, req: Request, tok: int) -> Optional[RequestStatus]:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and tok == req.eos_token_id:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]
