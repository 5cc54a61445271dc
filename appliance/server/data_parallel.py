"""The front end's handle on every engine core: one per data-parallel rank.

``parallel.data_parallel_size`` engine cores run behind one server, each
with the whole model (over its own ``tp x pp`` ranks), its own KV cache
and prefix cache, on its share of the host (``runner.ranks.place_data_parallel_rank``).
Each core has its own ``EngineClient`` and supervisor: a core that dies is
restarted while the others keep serving.

A request goes to the rank its client pinned (the ``X-Data-Parallel-Rank``
header or the ``data_parallel_rank`` field), else to the rank that can take
work with the lowest ``4 x waiting + running`` (ties to the lowest rank),
as vLLM balances its engines. ``running`` is what the core reported with
its last outputs; ``waiting`` is every request the front end has sent that
rank and not seen finish, less the running ones, so a burst is spread
before any core has answered. A rank whose core is unresponsive (no
heartbeat for ``server.core_heartbeat_timeout_s``) gets no new requests
while another can take them.

What the probes read: ``/health`` fails when a rank is dead for good, when
every rank is down (restarting, or its process ending), and when any rank is
unresponsive: a core that died is restarted here, but a frozen one is not,
so the server as a whole needs its orchestrator. ``/ready`` fails when no
rank can take work (``serving``): with several ranks, one frozen or
restarting rank leaves the server ready on the others.

With expert parallelism across the cores (``parallel=dp2_ep``) the cores
run their forwards in lock-step and exchange rows over a shared-memory
segment this object makes (``ExpertGroupSegments``): a core that dies
leaves the others waiting in an exchange, so every core is restarted with
it, onto a fresh segment.

One rank is the same object with one client: the server always speaks to
this one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from functools import partial
from typing import AsyncIterator, Callable, Optional

from appliance.config.deployment import Deployment, ExpertGroupAddress
from appliance.engine.outputs import RequestOutputDelta, StepStats
from appliance.sampling_params import SamplingParams
from appliance.server.client import EngineClient, EngineDeadError
from appliance.server.core_proc import BuildEngine
from appliance.server.messages import Ready

log = logging.getLogger("appliance.server")

WAITING_WEIGHT = 4  # a waiting request counts four times a running one when picking a rank


def balance_score(pending: int, running: int) -> int:
    """How loaded a rank is: ``4 x waiting + running``, where waiting is what
    the front end has in flight there beyond what the core runs."""
    return WAITING_WEIGHT * max(0, pending - running) + running


class DataParallelClient:
    def __init__(self, deployment: Deployment, build_engine: BuildEngine,
                 on_stats: Optional[Callable[[int, StepStats, StepStats], None]] = None,
                 on_restart: Optional[Callable[[int], None]] = None, on_fatal: Optional[Callable[[str], None]] = None,
                 make_segment: Optional[Callable[[int], ExpertGroupAddress]] = None):
        """``on_stats(rank, old, new)`` and ``on_restart(rank)`` name the rank;
        ``on_fatal(reason)``: a rank's restarts are exhausted;
        ``make_segment(n)``: where ``n`` lock-step cores (expert parallelism
        across them) meet, made anew for each generation of them."""
        self.deployment = deployment
        self.clients = [
            EngineClient(deployment.for_data_parallel_rank(r), build_engine,
                         on_stats=partial(on_stats, r) if on_stats else None,
                         on_restart=partial(on_restart, r) if on_restart else None,
                         on_fatal=on_fatal, rank=r if deployment.layout.data_parallel_size > 1 else None)
            for r in range(deployment.layout.data_parallel_size)
        ]
        self.segments = None
        if deployment.layout.experts_across_cores:
            if make_segment is None:
                raise ValueError("engine cores that split the experts need make_segment")
            self.segments = ExpertGroupSegments(self.clients, make_segment)

    @property
    def size(self) -> int:
        return len(self.clients)

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        """Start every rank's core at once; EngineDeadError (the first rank's
        reason) when any does not come up."""
        results = await asyncio.gather(*(c.start() for c in self.clients), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        await asyncio.gather(*(c.shutdown(timeout_s) for c in self.clients))
        if self.segments is not None:
            self.segments.close()

    # -- state the handlers read -------------------------------------------------
    @property
    def dead(self) -> bool:
        """A rank is dead for good (its restarts did not keep it up): the server exits."""
        return any(c.dead for c in self.clients)

    @property
    def restarting(self) -> bool:
        """No rank can take work: every one is restarting."""
        return all(c.restarting for c in self.clients)

    @property
    def lost(self) -> bool:
        """Every rank is down: restarting, or its process ending before its supervisor noticed."""
        return all(c.restarting or c.exiting for c in self.clients)

    @property
    def serving(self) -> bool:
        """Some rank can take work: up, its process not ending, heard from within the heartbeat timeout."""
        return any(c.up and not c.unresponsive and not c.exiting for c in self.clients)

    def unresponsive_reason(self) -> Optional[str]:
        """Why ``/health`` fails while the cores run: the ranks not heard from in time (None: none)."""
        silent = [reason for reason in (c.silence() for c in self.clients) if reason]
        return "; ".join(silent) if silent else None

    @property
    def ready_info(self) -> Optional[Ready]:
        """Rank 0's start-up answer (every rank has the same layout); None until it came up."""
        return self.clients[0].ready_info

    @property
    def stats(self) -> StepStats:
        """The ranks' load summed (running and waiting requests)."""
        return StepStats(num_running=sum(c.stats.num_running for c in self.clients),
                         num_waiting=sum(c.stats.num_waiting for c in self.clients))

    def retry_after_s(self) -> int:
        return min(c.retry_after_s() for c in self.clients)

    # -- requests ----------------------------------------------------------------
    def pick_rank(self, pinned: Optional[int] = None) -> int:
        """The rank a request goes to: ``pinned``, else the least loaded one
        that is up (and responsive, while any is). Raises the pinned (or
        first) rank's error when none can take it."""
        if pinned is not None:
            if not 0 <= pinned < self.size:
                raise ValueError(f"data-parallel rank {pinned} outside 0..{self.size - 1}")
            self.clients[pinned].check_up()
            return pinned
        up = [r for r, c in enumerate(self.clients) if c.up]
        if not up:
            self.clients[0].check_up()
            raise EngineDeadError("the engine is shutting down")
        up = [r for r in up if not self.clients[r].unresponsive] or up
        return min(up, key=lambda r: (balance_score(len(self.clients[r].pending), self.clients[r].stats.num_running),
                                      r))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
                       cache_salt: Optional[str] = None,
                       data_parallel_rank: Optional[int] = None) -> AsyncIterator[RequestOutputDelta]:
        """Output deltas of one request from the rank ``pick_rank`` chooses."""
        client = self.clients[self.pick_rank(data_parallel_rank)]
        async for d in client.generate(request_id, prompt_token_ids, params, priority, cache_salt):
            yield d

    async def reset_prefix_cache(self) -> bool:
        """Reset every rank's prefix cache; False when any is in use."""
        for c in self.clients:
            c.check_up()
        return all(await asyncio.gather(*(c.reset_prefix_cache() for c in self.clients)))



class ExpertGroupSegments:
    """Where the lock-step cores exchange, one per generation of cores
    (shared-memory segments, or torch.distributed addresses: the
    ``ExpertGroupAddress`` ``make_segment`` gives): each core is built on the current one; when any
    core is lost (or a replacement fails to come up) a new generation
    starts and the cores of the old one are killed, so their supervisors
    start them all again on the new segment. A segment's files are unlinked
    once every core of its generation is up (their mappings outlive them)."""

    def __init__(self, clients: list[EngineClient], make_segment: Callable[[int], ExpertGroupAddress]):
        self._create = make_segment
        self.clients = clients
        self.generation = 0
        self.path: Optional[ExpertGroupAddress] = make_segment(len(clients))
        self.built_on = [-1] * len(clients)  # the generation each client's current core was built on
        self.ready_on = [-1] * len(clients)  # the generation of each client's core that last came up
        for r, c in enumerate(clients):
            c.prepare = lambda r=r: self._prepare(r)
            c.on_lost = lambda r=r: self._lost(r)
            c.on_ready = lambda r=r: self._ready(r)

    def _prepare(self, rank: int):
        if self.path is None:  # unlinked: every core of this generation came up, and now one starts again
            self._new_generation(f"engine core {rank} starts after its peers came up")
        self.built_on[rank] = self.generation
        return dataclasses.replace(self.clients[rank].deployment, expert_group=self.path)

    def _lost(self, rank: int) -> None:
        if self.built_on[rank] == self.generation:  # the first loss of this generation
            self._new_generation(f"engine core {rank} is gone")

    def _new_generation(self, why: str) -> None:
        log.warning("%s: restarting every engine core (they split the experts and step together)", why)
        self._unlink()
        self.generation += 1
        self.path = self._create(len(self.clients))
        for c in self.clients:  # their supervisors see the exit and start them on the new segment
            if c.proc is not None and c.proc.is_alive():
                c.proc.kill()

    def _ready(self, rank: int) -> None:
        self.ready_on[rank] = self.built_on[rank]
        if all(g == self.generation for g in self.ready_on):  # every core of this generation has mapped it
            self._unlink()

    def _unlink(self) -> None:
        for path in self.path.files() if self.path is not None else []:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.path = None

    def close(self) -> None:
        self._unlink()
