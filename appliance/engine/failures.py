"""Failure containment: which requests a failed step blames, and running
them one at a time until the one at fault is found.

A step that raises puts its requests back to the front of the queue,
recomputed from scratch (``requeue``), after dropping from the prefix
cache the blocks the step registered but may never have written
(``forget_step_kv``). Each of them is then a suspect: the engine runs the
suspects alone, one step each (``schedule_alone``), before anything else;
one that fails alone is ended with an error. A request that was part of
``MAX_STRIKES`` failed steps ends too, so a batch that always fails cannot
keep its requests running for ever. A step that failed for no request's
fault (``retry_requests``: a KV tier's unreadable block) runs its requests
again without a strike."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from appliance.engine.request import RequestStatus

if TYPE_CHECKING:
    from appliance.engine.request import Request
    from appliance.engine.scheduler import Scheduler
    from appliance.engine.scheduler_output import SchedulerOutput


class Suspects:
    """The requests to run alone after a failed step, in order, and each
    request's failed steps so far."""

    MAX_STRIKES = 3  # failed steps a request may be part of before it is ended

    def __init__(self) -> None:
        self.order: list[str] = []
        self.strikes: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.order)

    def forget(self, request_id: str) -> None:
        """The request ended (or was aborted)."""
        self.strikes.pop(request_id, None)
        if request_id in self.order:
            self.order.remove(request_id)

    def cleared(self, request_id: str) -> None:
        """The request ran alone to a sample (or out of the step): not at fault."""
        if request_id in self.order:
            self.order.remove(request_id)

    def next(self, requests: dict[str, Request]) -> Optional[str]:
        """The next suspect still running (ended ones are dropped)."""
        while self.order:
            req = requests.get(self.order[0])
            if req is not None and not req.is_finished:
                return req.request_id
            self.order.pop(0)
        return None

    def blame(self, batch: list[Request], alone: bool, retry_all: bool) -> tuple[list[Request], list[Request]]:
        """(to end, to run again) of a failed step's running requests
        ``batch``: all of them to run again when no request is to blame
        (``retry_all``); all ended when the step ran one request (``alone``,
        or a batch of one); else each takes a strike and those at
        ``MAX_STRIKES`` end. The ones to run again become the first suspects."""
        ended: list[Request] = []
        retry: list[Request] = []
        if retry_all:
            retry = batch
        elif alone or len(batch) == 1:
            return batch, []
        else:
            for req in batch:
                strikes = self.strikes.get(req.request_id, 0) + 1
                self.strikes[req.request_id] = strikes
                (ended if strikes >= self.MAX_STRIKES else retry).append(req)
        retry_ids = [r.request_id for r in retry]
        self.order = retry_ids + [rid for rid in self.order if rid not in retry_ids]
        return ended, retry


def schedule_alone(scheduler: Scheduler, request_id: str, token_budget: Optional[int]) -> SchedulerOutput:
    """One ``schedule()`` that sees only ``request_id``; the other requests wait, keeping their KV."""
    s = scheduler
    req = s.requests[request_id]
    running, waiting = s.running, s.waiting
    s.waiting = type(waiting)()
    if req in running:
        s.running = [req]
    else:
        waiting.remove(req)
        s.waiting.add(req)
        s.running = []
    try:
        return s.schedule(token_budget=token_budget)
    finally:
        s.running = [r for r in running if r is not req] + s.running
        for r in s.waiting:
            waiting.prepend(r)
        s.waiting = waiting


def forget_step_kv(scheduler: Scheduler, sched_out: SchedulerOutput, batch: list[Request],
                   later: Sequence[SchedulerOutput] = ()) -> None:
    """Drop from the prefix cache the blocks a failed step registered for
    ``batch`` (it may never have written them), and those a KV connector
    loaded in it (they may be unreadable too). ``later``: steps submitted
    after it (pipeline stages), whose tokens the computed counts include."""
    kv = scheduler.kv
    loaded = scheduler.connector.first_loaded_block if scheduler.connector is not None else {}
    for req in batch:
        since = sum(so.num_scheduled_tokens.get(req.request_id, 0) for so in (sched_out, *later))
        first = (req.num_computed_tokens - since) // kv.block_size
        kv.uncache_blocks(req.request_id, min(first, loaded.get(req.request_id, first)))


def requeue(scheduler: Scheduler, reqs: list[Request]) -> None:
    """Back to the front of the queue, in order, recomputed from scratch when run."""
    s = scheduler
    for req in reversed(reqs):
        if req in s.running:
            s.running.remove(req)
        s.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        s.waiting.prepend(req)
