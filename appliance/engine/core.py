"""The engine core: scheduler + model runner + detokenization, one step at a time.

    step():  schedule() -> {req_id: n_tokens}
             runner.execute(sched_out) -> sampled tokens
             detokenize, find stop strings
             scheduler.update_from_output(...) -> finished requests freed

The same object runs inside the offline ``LLM`` and inside the server's
engine-core process.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence, Union, cast, runtime_checkable

import msgspec

from appliance.engine.detokenizer import IncrementalDetokenizer
from appliance.engine.kv_connector import KVConnectorOutput
from appliance.engine.kv_p2p import kv_transfer_problem
from appliance.engine.request import Request, RequestStatus
from appliance.engine.scheduler import Scheduler, SchedulerOutput
from appliance.engine.token_budget import TokenBudget, attention_pairs
from appliance.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("appliance.engine")


class TokenLogprob(msgspec.Struct):
    """Log-probability of one sampled token and the top candidates of its step."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = []


class RequestOutputDelta(msgspec.Struct):
    """What one step added to one request. A msgspec Struct: it crosses the
    engine-core process boundary as it is (see ``server/messages.py``)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None  # "stop_string", the stop token id, or None (EOS, length)
    logprobs: list[Optional[TokenLogprob]] = []
    # with the request's first delta, when it asked for them: one per prompt token (the first None)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time: Optional[float] = None  # on the first delta with tokens: seconds waiting before first scheduled
    # on the last delta, when a KV connector holds the request's KV for a peer: what the peer needs to fetch it
    kv_transfer_params: Optional[dict[str, Any]] = None


class StepStats(msgspec.Struct):
    """Gauges and counters of the core after a step (sent to the front end)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    iteration_tokens: int = 0  # tokens scheduled by the last step (0: no step ran)
    token_budget: int = 0  # tokens the next step may schedule
    spec_drafts: int = 0  # speculative decoding: drafts verified,
    spec_draft_tokens: int = 0  # the draft tokens in them,
    spec_accepted_tokens: int = 0  # how many of those were accepted,
    spec_accepted_per_pos: list[int] = []  # and accepted at each draft position (0 = first)
    grammar_compile_seconds: list[float] = []  # grammars compiled since the previous stats (each reported once)
    # expert-parallel load balancing (parallel.eplb; balancedness 0: none)
    eplb_balancedness: float = 0.0  # mean over max of the ranks' expert loads in the window
    eplb_rebalances: int = 0
    eplb_rebalance_seconds: float = 0.0  # spent placing experts and moving their weights, all rebalances
    expert_load: list[int] = []  # tokens each logical expert took in the window, all sparse layers
    eplb_slot_load_ratios: list[float] = []  # each rebalance's slot loads over their mean (each reported once)
    kv_offload_corrupt_blocks: int = 0  # offload tier files that failed their checks on load (removed, recomputed)


class SampledLogprob(Protocol):
    """What the model runner reports per sampled token (``worker.sampler.TokenLogprobs``)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


class StepOutput(Protocol):
    """What ``runner.execute`` returns (``worker.model_runner.RunnerOutput``)."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[Optional[SampledLogprob]]]
    spec_token_ids: dict[str, list[int]]  # drafts proposed for the next step (speculative decoding)
    # (the prompt index of the first token scored, logprobs from it on) for requests asking for prompt logprobs
    prompt_logprobs: dict[str, tuple[int, list[SampledLogprob]]]
    expert_stats: Optional[dict]  # expert load balancing's figures (models/eplb.py Eplb.stats); None: no balancer
    kv_connector_output: Optional[KVConnectorOutput]  # what a KV connector's worker side finished; None: none


class RequestGrammar(Protocol):
    """One request's output constraint (``structured_output.RequestGrammar``):
    a matcher that has accepted the request's output tokens."""

    error: Optional[str]  # why compiling failed

    def ready(self) -> bool: ...  # compiled (or failed)

    def accept(self, token_ids: list[int]) -> int: ...  # how many were accepted, in order

    def is_terminated(self) -> bool: ...

    def valid_prefix(self, drafts: list[int]) -> int: ...


class GrammarSource(Protocol):
    """Compiles constraints and masks steps (``structured_output.Grammars``)."""

    def grammar_for(self, params: SamplingParams) -> RequestGrammar: ...  # ValueError: an invalid constraint

    def bitmask(self, entries: list[tuple[str, RequestGrammar, list[int], list[int]]]) -> object: ...

    def wait(self, timeout: float) -> None: ...

    def take_compile_seconds(self) -> list[float]: ...


class EngineDeadError(RuntimeError):
    """The model side cannot run steps any more (a worker process died, or
    a step outlasted its timeout, e.g. a hung collective): no request's
    fault, and no retry helps; the engine stops (a server's supervisor
    starts a new core). A server's client raises it too, to the requests
    of a core that died (``EngineRestartingError`` while a new one starts)."""


class Lockstep(Protocol):
    """Engine cores that must run their forwards together (expert
    parallelism across data-parallel cores, ``worker.lockstep``): the host's
    loop asks ``agree`` before each step and runs ``idle_step`` when others
    have work and this core has none."""

    idle_poll_ms: int  # how long an idle core waits for input between agreements

    def agree(self, has_work: bool, stopping: bool) -> tuple[bool, bool]: ...  # (any has work, all stopping)

    def idle_step(self) -> None: ...


class EventSink(Protocol):
    """Where the block pool's events go after each step (``server.kv_events.KVEventPublisher``)."""

    def publish(self, events: list) -> None: ...

    def close(self) -> None: ...


class StepRunner(Protocol):
    """The model side of a step (``worker.model_runner.ModelRunner``).

    A runner over pipeline stages (``worker.executor``) also has
    ``num_stages``, ``max_batches_in_flight`` (one per stage, unless the
    steps must pair up with other cores'), ``submit(sched_out)`` and
    ``collect()`` (the oldest submitted step's output): the core keeps
    that many steps in flight so the stages overlap."""

    def execute(self, sched_out: SchedulerOutput) -> StepOutput: ...


class PipelinedStepRunner(StepRunner, Protocol):
    """A step runner over pipeline stages (``worker.executor``): the core keeps up to
    ``max_batches_in_flight`` steps submitted and collects them oldest first."""

    num_stages: int
    max_batches_in_flight: int

    def submit(self, sched_out: SchedulerOutput) -> None: ...

    def collect(self) -> StepOutput: ...


@runtime_checkable
class KVConnectorScheduler(Protocol):
    """A KV connector's scheduler side (vLLM V1's scheduler-role connector),
    which the scheduler and the core call: ``engine/kv_connector.
    OffloadConnector`` and ``engine/kv_p2p.P2PConnector``; the runner builds
    one per ``kv_transfer.connector`` (``config/kv_connectors.py``), with
    its worker side beside the model. Every step it answers which tokens it
    can supply past the pool's hits, takes the blocks allocated for them,
    turns the step into instructions for its worker side, and learns what
    the worker side finished; a finished request's blocks may stay held
    while a peer still needs them."""

    name: str  # kv_transfer.connector
    role: str  # kv_transfer.role
    recving: dict[str, int]  # requests loading in the background -> their computed tokens once the load is in
    first_loaded_block: dict[str, int]  # this step's synchronous loads: each request's first loaded block
    corrupt_blocks: int  # stored blocks that failed their checks on load (recomputed)
    has_pending_meta: bool  # instructions not handed to the worker side yet: one more step is due
    has_transfers: bool  # KV moving (or held for a peer) that an idle engine must keep stepping for

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]: ...

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_tokens: int,
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduled: dict[str, int], requests: dict[str, Request],
                             block_ids: Callable[[str], list[int]]) -> object: ...

    def update_connector_output(self, output: Optional[KVConnectorOutput]) -> None: ...

    def combine_ranks(self, output: KVConnectorOutput) -> KVConnectorOutput: ...

    def overdue(self) -> Optional[KVConnectorOutput]: ...

    def step_failed(self, meta: object) -> None: ...  # what its build_connector_meta made for the step

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]: ...


def _token_logprobs(lps: Sequence[Optional[SampledLogprob]]) -> list[Optional[TokenLogprob]]:
    return [lp if lp is None or type(lp) is TokenLogprob else TokenLogprob(lp.token_id, lp.logprob, lp.rank, lp.top)
            for lp in lps]


class EngineCore:
    """Failures are contained: a request whose admission fails is refused
    alone; when a step fails, the requests it ran are put back for
    recompute and run again one at a time, and only one that fails on its
    own is ended, with finish_reason "error" (the traceback is logged). The
    loop itself survives; only a failure outside any request (scheduler
    state) ends every request, and a failure of that clean-up is fatal."""

    MAX_STRIKES = 3  # failed steps a request may be part of before it is ended

    def __init__(self, scheduler: Scheduler, runner: StepRunner, tokenizer: PreTrainedTokenizerBase,
                 eos_token_id: Optional[int], vocab_size: int = 0, token_budget: Optional[TokenBudget] = None,
                 grammars: Optional[GrammarSource] = None, lockstep: Optional[Lockstep] = None,
                 kv_events: Optional[EventSink] = None):
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size  # 0: unchecked
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self.last_stats = StepStats()
        self._suspects: list[str] = []  # requests to run alone, after a failed step
        self._strikes: dict[str, int] = {}
        self.token_budget = token_budget  # None: every step may take the scheduler's configured budget
        self._objective_budget: Optional[int] = None  # the objective's, refitted before each step; None: configured
        # (preemptions, prefix queries, prefix hits, corrupt offload tier files) at reset_stats()
        self._counted_from = (0, 0, 0, 0)
        self._spec = [0, 0, 0]  # drafts, draft tokens, accepted tokens since reset_stats()
        self._spec_per_pos: list[int] = []
        self.grammars = grammars  # None: requests with structured_outputs are refused
        self._compiling: dict[str, Request] = {}  # requests waiting for their grammar
        self.lockstep = lockstep  # None: this core steps on its own
        self.kv_events = kv_events  # None: the block pool's events are not published
        self._experts: Optional[dict] = None  # the runner's last expert load balancing figures
        self._slot_ratios: list[float] = []
        # prompt logprobs gathered so far, until the request's first delta carries them
        self._prompt_lps: dict[str, list[Optional[TokenLogprob]]] = {}
        self.max_in_flight = getattr(runner, "max_batches_in_flight", 1)  # steps submitted, not yet collected
        self._in_flight: collections.deque[SchedulerOutput] = collections.deque()
        self._carried = SchedulerOutput()  # ids an empty step left for the next one the runner sees
        self._ran_alone_from: Optional[float] = None  # when the only step in flight was submitted, if it still is
        # only the last pipeline stage samples: the others learn the tokens from the scheduler
        scheduler.send_token_ids = getattr(runner, "num_stages", 1) > 1

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        arrival_time: Optional[float] = None,
    ) -> None:
        """Raises ValueError for a request the engine cannot run; nothing of it is kept."""
        self._check_token_ids(prompt_token_ids, params)
        c = self.scheduler.connector
        problem = kv_transfer_problem(params, c.name if c is not None else None, c.role if c is not None else "",
                                      self.block_size)
        if problem is not None:
            raise ValueError(f"kv_transfer_params {problem}")
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        grammar = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("this engine was built without structured outputs")
            grammar = self.grammars.grammar_for(params)
        req = Request(request_id, prompt_token_ids, params, eos_token_id=self.eos_token_id,
                      arrival_time=arrival_time, priority=priority, cache_salt=cache_salt, grammar=grammar)
        self.scheduler.add_request(req)
        self.detok[request_id] = detok
        if params.prompt_logprobs is not None:
            self._prompt_lps[request_id] = [None]  # the first prompt token has nothing before it
        if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
            self._compiling[request_id] = req

    def _check_token_ids(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        v = self.vocab_size
        if not v:
            return
        for name, ids in (("prompt", prompt_token_ids), ("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", params.logit_bias)):
            try:
                out_of_range = bool(ids) and (min(ids) < 0 or max(ids) >= v)
            except TypeError:
                raise ValueError(f"{name} must hold integer token ids") from None
            if out_of_range:
                raise ValueError(f"{name} holds a token id outside the vocabulary (0..{v - 1})")

    def abort(self, request_ids: list[str]) -> None:
        for req in self.scheduler.abort(request_ids):
            self.detok.pop(req.request_id, None)
            self._prompt_lps.pop(req.request_id, None)
            self._strikes.pop(req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, steps in flight, or a KV connector's instructions that the next step hands over."""
        c = self.scheduler.connector
        return (self.scheduler.has_unfinished_requests() or bool(self._in_flight)
                or (c is not None and c.has_pending_meta))

    def has_kv_transfers(self) -> bool:
        """KV a connector is moving (loads in flight, blocks held for a peer):
        an idle engine still steps now and then to learn when they end."""
        c = self.scheduler.connector
        return c is not None and c.has_transfers

    # -- what a host of the engine (the server's core process) reads and resets --
    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the KV pool (the null block included)."""
        return self.scheduler.kv.num_blocks

    @property
    def block_size(self) -> int:
        return self.scheduler.kv.block_size

    def begin_budget_calibration(self) -> Optional[int]:
        """Under a latency objective, before the first request: the steps the
        token budget kept (a warm-up's, cold) are dropped, and the length of
        the prompt to prefill alone so that its step times give the budget
        its first fit is returned: the budget's first estimate, within what
        one request may hold now (``max_model_len`` and the free KV, with room
        for the decodes that follow). None without an objective."""
        budget = self.token_budget
        if budget is None:
            return None
        budget.forget()
        s = self.scheduler
        room = min(s.max_model_len, s.kv.num_free_blocks * self.block_size) - TokenBudget.MIN_SAMPLES - 1
        return max(1, min(budget.calibration_prompt_len(), room))

    @property
    def step_token_budget(self) -> int:
        """The tokens a step may schedule: under a latency objective (``token_budget``)
        its budget for the next step, else the scheduler's configured one."""
        return self.scheduler.max_num_batched_tokens if self._objective_budget is None else self._objective_budget

    def stats(self, iteration_tokens: int = 0) -> StepStats:
        """Gauges now; counters since the engine was built or ``reset_stats``."""
        s, kv = self.scheduler, self.scheduler.kv
        p0, q0, h0, c0 = self._counted_from
        drafts, draft_tokens, accepted = self._spec
        stats = StepStats(len(s.running), len(s.waiting), kv.usage(), s.num_preemptions - p0,
                          kv.stats.queries - q0, kv.stats.hits - h0, iteration_tokens, self.step_token_budget,
                          drafts, draft_tokens, accepted, list(self._spec_per_pos),
                          self.grammars.take_compile_seconds() if self.grammars is not None else [])
        stats.kv_offload_corrupt_blocks = self._corrupt_tier_blocks() - c0
        if self._experts is not None:
            stats.eplb_balancedness = self._experts["balancedness"]
            stats.eplb_rebalances = self._experts["rebalances"]
            stats.eplb_rebalance_seconds = self._experts["rebalance_seconds"]
            stats.expert_load = list(self._experts["expert_load"])
            stats.eplb_slot_load_ratios, self._slot_ratios = self._slot_ratios, []
        return stats

    def _corrupt_tier_blocks(self) -> int:
        """Offload tier files that failed their checks on load since the engine was built."""
        c = self.scheduler.connector
        return c.corrupt_blocks if c is not None else 0

    def reset_prefix_cache(self) -> bool:
        """Drop every prefix-cache entry; False (nothing dropped) while requests hold blocks."""
        done = self.scheduler.kv.reset_prefix_cache()
        self._publish_events()
        return done

    def _publish_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.kv.pool.take_events())

    def reset_stats(self) -> None:
        """Count from zero again (after a warm-up: its work is not traffic)."""
        kv = self.scheduler.kv
        self._counted_from = (self.scheduler.num_preemptions, kv.stats.queries, kv.stats.hits,
                              self._corrupt_tier_blocks())
        self._spec, self._spec_per_pos = [0, 0, 0], []
        self.last_stats = self.stats()

    def step(self) -> list[RequestOutputDelta]:
        try:
            return self._step()
        except EngineDeadError:
            raise
        except Exception:
            log.exception("engine step failed outside any one request; ending every request")
            deltas = self._fail(list(self.scheduler.requests.values()))
            self.last_stats = self.stats()
            return deltas
        finally:
            self._publish_events()  # one batch per step, whatever the step did

    def _step(self) -> list[RequestOutputDelta]:
        failed_compiles = self._compiled() if self._compiling else []
        if self._in_flight or (self.max_in_flight > 1 and not self._suspects):
            return failed_compiles + self._pipelined_step()
        alone = self._next_suspect()
        return failed_compiles + self._run_now(self._schedule(alone), alone)

    def _run_now(self, sched_out: SchedulerOutput, alone: Optional[str]) -> list[RequestOutputDelta]:
        """Run one step and apply it (nothing else in flight)."""
        t0 = time.perf_counter()
        try:
            runner_out = self.runner.execute(sched_out)
        except EngineDeadError:
            raise
        except Exception as e:
            return self._failed_step(sched_out, alone, e)
        if self.token_budget is not None and alone is None:
            self._observe_step(sched_out, time.perf_counter() - t0)
        return self._apply(sched_out, runner_out, alone)

    def _schedule(self, alone: Optional[str], max_reqs: Optional[int] = None,
                  in_flight: frozenset[str] = frozenset()) -> SchedulerOutput:
        """The next step (``alone``: only that request; ``in_flight``: requests of steps
        not collected yet), its structured-output masks made."""
        if self.token_budget is not None and alone is None:
            self._objective_budget = self._next_budget()
        sched_out = (self._schedule_alone(alone) if alone is not None
                     else self.scheduler.schedule(max_reqs, in_flight, token_budget=self._objective_budget))
        carried = self._carried
        if carried.finished_req_ids or carried.preempted_req_ids:
            sched_out.finished_req_ids |= carried.finished_req_ids
            sched_out.preempted_req_ids |= carried.preempted_req_ids
            self._carried = SchedulerOutput()
        if not sched_out.num_scheduled_tokens and self._compiling and not self._in_flight:
            assert self.grammars is not None  # requests compile only where there are grammars
            self.grammars.wait(0.005)  # nothing to run but grammars to wait for: do not spin
        if self.grammars is not None:
            try:
                self._mask(sched_out)
            except Exception:
                connector = self.scheduler.connector
                if connector is not None:  # its instructions go with the next step
                    connector.step_failed(sched_out.kv_connector_metadata)
                raise
        return sched_out

    def _pipelined_step(self) -> list[RequestOutputDelta]:
        """Up to ``max_in_flight`` steps at once (vLLM's batch queue), so each
        pipeline stage works on its own: while there is room, schedule the
        requests whose steps are not in flight, a share of them so that the
        rest fill the other stages' steps, and submit; when full, or when
        nothing more can run, collect the oldest step and apply it. No
        step is scheduled while requests wait to run alone after a failure."""
        s = self.scheduler
        if len(self._in_flight) < self.max_in_flight and not self._suspects:
            in_flight = frozenset(rid for so in self._in_flight for rid in so.num_scheduled_tokens)
            # ready to run: requests not in flight, and ones in flight with prompt left to compute
            ready = len(s.waiting) + sum(1 for r in s.running
                                         if r.request_id not in in_flight or r.num_computed_tokens < r.num_tokens)
            sched_out = self._schedule(None, max(1, -(-ready // (self.max_in_flight - len(self._in_flight)))),
                                       in_flight)
            if sched_out.num_scheduled_tokens:
                self._ran_alone_from = None if self._in_flight else time.perf_counter()
                cast(PipelinedStepRunner, self.runner).submit(sched_out)
                self._in_flight.append(sched_out)
                if len(self._in_flight) < self.max_in_flight:
                    return []
            elif self._in_flight:  # its finished and preempted ids go with the next step the runner sees
                self._carried.finished_req_ids |= sched_out.finished_req_ids
                self._carried.preempted_req_ids |= sched_out.preempted_req_ids
            else:  # nothing in flight, nothing to run: an empty step, as without stages
                return self._run_now(sched_out, None)
        if not self._in_flight:
            return []
        sched_out = self._in_flight.popleft()
        try:
            runner_out = cast(PipelinedStepRunner, self.runner).collect()
        except EngineDeadError:
            raise
        except Exception as e:
            return self._failed_step(sched_out, None, e)
        if self.token_budget is not None and self._ran_alone_from is not None:  # its time was its own
            self._observe_step(sched_out, time.perf_counter() - self._ran_alone_from)
        self._ran_alone_from = None
        return self._apply(sched_out, runner_out, None)

    def _failed_step(self, sched_out: SchedulerOutput, alone: Optional[str],
                     error: Exception) -> list[RequestOutputDelta]:
        """A step that raised: its requests back for recompute (see
        ``_step_failed``). Steps in flight after it are collected first and
        applied after, without the requests that are to be recomputed (what
        they computed for those built on this step's KV)."""
        later: list[tuple[SchedulerOutput, Any]] = []
        while self._in_flight:
            so = self._in_flight.popleft()
            try:
                later.append((so, cast(PipelinedStepRunner, self.runner).collect()))
            except EngineDeadError:
                raise
            except Exception as e:  # noqa: BLE001 (applied below, in order)
                later.append((so, e))
        deltas = self._step_failed(sched_out, alone, retry_all=getattr(error, "retry_requests", False),
                                   later=[so for so, _ in later])
        report = getattr(error, "kv_connector_output", None)
        if report is not None:  # what the connector finished before the step failed is not lost with it
            self.scheduler.update_from_connector_output(report)
        for k, (so, out) in enumerate(later):
            if isinstance(out, Exception):
                deltas += self._step_failed(so, None, later=[so2 for so2, _ in later[k + 1:]])
            else:
                deltas += self._apply(so, out, None)
        self.last_stats = self.stats()
        return deltas

    def _apply(self, sched_out: SchedulerOutput, runner_out: StepOutput,
               alone: Optional[str]) -> list[RequestOutputDelta]:
        """A step's output: tokens appended, stops found, text detokenized."""
        connector = self.scheduler.connector
        if connector is not None:
            self.scheduler.update_from_connector_output(runner_out.kv_connector_output)
            if not sched_out.num_scheduled_tokens and connector.has_transfers:
                time.sleep(0.002)  # nothing runs until remote KV arrives: do not spin
        experts = runner_out.expert_stats
        if experts is not None:
            self._experts = experts
            self._slot_ratios += experts["slot_load_ratios"]
        if alone is not None and (alone in runner_out.sampled_token_ids or alone not in sched_out.num_scheduled_tokens):
            self._suspects.remove(alone)  # it ran on its own to a sample: cleared
        if self._prompt_lps:
            requests = self.scheduler.requests
            self._gather_prompt_logprobs({rid: scored for rid, scored in
                                          runner_out.prompt_logprobs.items()
                                          if rid in requests and requests[rid].status == RequestStatus.RUNNING})
        stopped: dict[str, tuple[int, Union[str, int, None]]] = {}
        failed: dict[str, Request] = {}
        for rid, toks in runner_out.sampled_token_ids.items():
            req = self.scheduler.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran, or (a step before it failed) to be recomputed
            try:
                # Text only up to the first stop condition; a stop string cuts at the token that completes it.
                kept = self.scheduler.num_kept(req, toks)
                if req.grammar is not None and (ended := self._advance_grammar(req, toks[:kept])):
                    kept = ended
                    stopped[rid] = (ended, None)
                for j, tok in enumerate(toks[:kept], 1):
                    if self.detok[rid].add_tokens([tok]) is not None:
                        stopped[rid] = (j, "stop_string")
                        break
            except Exception:
                log.exception("processing the tokens of request %s failed", rid)
                failed[rid] = req
        self._count_spec(sched_out, runner_out.sampled_token_ids)
        updates = self.scheduler.update_from_output(sched_out, runner_out.sampled_token_ids, stopped,
                                                    runner_out.spec_token_ids)
        for u in updates:
            req = u.request
            if req.grammar is not None and req.spec_token_ids and not u.finished:
                del req.spec_token_ids[req.grammar.valid_prefix(req.spec_token_ids):]  # drafts the grammar allows
        deltas = []
        for u in updates:
            req = u.request
            if req.request_id in failed:
                continue
            try:
                d = self.detok[req.request_id]
                if u.finished:
                    if req.request_id not in stopped:
                        d.flush()
                    del self.detok[req.request_id]
                    if self._strikes:
                        self._strikes.pop(req.request_id, None)
                new_text = d.take_delta(u.finished)
            except Exception:
                log.exception("detokenizing request %s failed", req.request_id)
                failed[req.request_id] = req
                continue
            deltas.append(RequestOutputDelta(
                request_id=req.request_id,
                new_token_ids=u.new_token_ids,
                new_text=new_text,
                finished=u.finished,
                finish_reason=req.finish_reason if u.finished else None,
                stop_reason=req.stop_reason if u.finished else None,
                logprobs=_token_logprobs(runner_out.logprobs.get(req.request_id, ())[: len(u.new_token_ids)]),
                prompt_logprobs=self._take_prompt_logprobs(req) if self._prompt_lps else None,
                num_prompt_tokens=req.num_prompt_tokens,
                num_output_tokens=req.num_output_tokens,
                num_cached_tokens=max(0, req.num_cached_tokens),
                queue_time=(req.first_scheduled_time - req.arrival_time)
                if u.new_token_ids and req.num_output_tokens == len(u.new_token_ids) and req.first_scheduled_time
                else None,
                kv_transfer_params=req.kv_transfer_params if u.finished else None,
            ))
        if failed:
            deltas += self._fail([r for r in failed.values() if r is not None])
        self.last_stats = self.stats(sched_out.total_num_scheduled_tokens)
        return deltas

    def _gather_prompt_logprobs(self, scored: dict[str, tuple[int, Sequence[SampledLogprob]]]) -> None:
        """Append what this step scored of each prompt; positions scored before
        (the prompt runs again after a preemption or a failed step) are skipped."""
        for rid, (first, lps) in scored.items():
            got = self._prompt_lps.get(rid)
            if got is not None and first <= len(got) < first + len(lps):
                got += _token_logprobs(lps[len(got) - first:])

    def _take_prompt_logprobs(self, req: Request) -> Optional[list[Optional[TokenLogprob]]]:
        """A request's prompt logprobs, once all are in (for its first delta with tokens)."""
        got = self._prompt_lps.get(req.request_id)
        if got is None or len(got) < req.num_prompt_tokens:
            return None
        return self._prompt_lps.pop(req.request_id)

    # -- structured outputs ----------------------------------------------------
    def _compiled(self) -> list[RequestOutputDelta]:
        """Requests whose grammar finished compiling become schedulable; one
        that failed to compile ends with an error (the cause is logged)."""
        failed = []
        for rid, req in list(self._compiling.items()):
            g = req.grammar
            assert g is not None  # a compiling request has its grammar
            if req.is_finished or g.ready():
                del self._compiling[rid]
                if not req.is_finished and g.error is not None:
                    log.error("request %s: its grammar did not compile: %s", rid, g.error)
                    failed.append(req)
        return self._fail(failed) if failed else []

    def _mask(self, sched_out: SchedulerOutput) -> None:
        """The grammar bitmask of the requests this step samples (a row per
        sampled position: with drafts, one per draft and one past them)."""
        requests = self.scheduler.requests
        entries = []
        for rid in sched_out.num_scheduled_tokens:
            req = requests[rid]
            if req.grammar is not None and req.num_computed_tokens >= req.num_tokens:
                entries.append((rid, req.grammar, req.output_token_ids,
                                sched_out.scheduled_spec_decode_tokens.get(rid, [])))
        if entries:
            assert self.grammars is not None  # a request has a grammar only where there are grammars
            sched_out.grammar_bitmask = self.grammars.bitmask(entries)

    @staticmethod
    def _advance_grammar(req: Request, tokens: list[int]) -> int:
        """The matcher takes the tokens the request keeps; returns how many
        it keeps when the grammar terminates among them (the request then
        ends there, finish_reason stop), else 0."""
        g = req.grammar
        assert g is not None  # called for requests with a grammar
        for j, tok in enumerate(tokens, 1):
            if g.accept([tok]) != 1:
                raise RuntimeError(f"the grammar refused token {tok}, which its own mask allowed")
            if g.is_terminated():
                return j
        return 0

    def _count_spec(self, sched_out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Drafts verified this step, and how many of each were accepted (every
        sampled token but the last: the target's own)."""
        for rid, drafts in sched_out.scheduled_spec_decode_tokens.items():
            if rid not in sampled:
                continue
            accepted = len(sampled[rid]) - 1
            self._spec[0] += 1
            self._spec[1] += len(drafts)
            self._spec[2] += accepted
            if len(self._spec_per_pos) < len(drafts):
                self._spec_per_pos += [0] * (len(drafts) - len(self._spec_per_pos))
            for pos in range(accepted):
                self._spec_per_pos[pos] += 1

    # -- failure containment -------------------------------------------------
    def _next_budget(self) -> int:
        """The token budget for the next step (``scheduler.target_itl_ms``): the
        running decodes (with their drafts) first, the rest for a prefill chunk
        from where the first unfinished prompt stands; with no stream decoding
        nobody waits for a next token, so prompts prefill at the cap
        (``scheduler.max_num_batched_tokens``)."""
        decodes, pairs, chunk_context = 0, 0, 0
        for req in self.scheduler.running:
            if req.num_computed_tokens >= req.num_tokens - 1:
                n = 1 + len(req.spec_token_ids)
                decodes += n
                pairs += attention_pairs(n, req.num_computed_tokens + n)
            elif not chunk_context:
                chunk_context = req.num_computed_tokens
        budget = self.token_budget
        assert budget is not None  # called with an objective only
        return budget.cap if not decodes else budget.next_budget(decodes, pairs, chunk_context)

    def _observe_step(self, sched_out: SchedulerOutput, seconds: float) -> None:
        requests = self.scheduler.requests
        pairs = sum(attention_pairs(n, requests[rid].num_computed_tokens)
                    for rid, n in sched_out.num_scheduled_tokens.items() if rid in requests)
        assert self.token_budget is not None  # called with an objective only
        self.token_budget.observe(sched_out.total_num_scheduled_tokens, pairs, seconds)

    def _next_suspect(self) -> Optional[str]:
        while self._suspects:
            req = self.scheduler.requests.get(self._suspects[0])
            if req is not None and not req.is_finished:
                return req.request_id
            self._suspects.pop(0)
        return None

    def _schedule_alone(self, rid: str) -> SchedulerOutput:
        """One schedule() that sees only ``rid``; the other requests wait, keeping their KV."""
        s = self.scheduler
        req = s.requests[rid]
        running, waiting = s.running, s.waiting
        s.waiting = type(waiting)()
        if req in running:
            s.running = [req]
        else:
            waiting.remove(req)
            s.waiting.add(req)
            s.running = []
        try:
            return s.schedule(token_budget=self._objective_budget)
        finally:
            s.running = [r for r in running if r is not req] + s.running
            for r in s.waiting:
                waiting.prepend(r)
            s.waiting = waiting

    def _step_failed(self, sched_out: SchedulerOutput, alone: Optional[str], retry_all: bool = False,
                     later: Sequence[SchedulerOutput] = ()) -> list[RequestOutputDelta]:
        """``later``: steps submitted after this one (pipeline stages), whose
        tokens the requests' computed counts include already."""
        s = self.scheduler
        batch = [s.requests[rid] for rid in sched_out.num_scheduled_tokens
                 if rid in s.requests and s.requests[rid].status == RequestStatus.RUNNING]
        log.exception("engine step over %d request(s) failed: %s", len(batch), [r.request_id for r in batch])
        # The runner may not have dropped the rows of requests that ended before this step.
        s.finished_req_ids |= sched_out.finished_req_ids
        # KV this step registered in the prefix cache may never have been written.
        kv = s.kv
        loaded = s.connector.first_loaded_block if s.connector is not None else {}
        for req in batch:
            since = sum(so.num_scheduled_tokens.get(req.request_id, 0) for so in (sched_out, *later))
            first = (req.num_computed_tokens - since) // kv.block_size
            # blocks a KV connector loaded this step may be unreadable too
            kv.uncache_blocks(req.request_id, min(first, loaded.get(req.request_id, first)))
        if s.connector is not None:
            s.connector.step_failed(sched_out.kv_connector_metadata)
        if alone is not None and not batch:
            self._suspects.remove(alone)
        ended: list[Request] = []
        retry: list[Request] = []
        if retry_all:  # no request is to blame: every one runs again, without a strike
            retry = batch
        elif alone is not None or len(batch) == 1:
            return self._fail(batch)
        else:
            for req in batch:
                strikes = self._strikes.get(req.request_id, 0) + 1
                self._strikes[req.request_id] = strikes
                (ended if strikes >= self.MAX_STRIKES else retry).append(req)
        for req in reversed(retry):  # back to the front of the queue, recomputed from scratch when run
            if req in s.running:
                s.running.remove(req)
            kv.free(req)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            req.spec_token_ids = []
            s.waiting.prepend(req)
        retry_ids = [r.request_id for r in retry]
        self._suspects = retry_ids + [rid for rid in self._suspects if rid not in retry_ids]
        return self._fail(ended) if ended else []

    def _fail(self, reqs: list[Request]) -> list[RequestOutputDelta]:
        """End ``reqs`` (live or just finished) with finish_reason "error"."""
        self.scheduler.abort([r.request_id for r in reqs])
        deltas = []
        for req in reqs:
            self.detok.pop(req.request_id, None)
            self._prompt_lps.pop(req.request_id, None)
            self._strikes.pop(req.request_id, None)
            if req.request_id in self._suspects:
                self._suspects.remove(req.request_id)
            deltas.append(RequestOutputDelta(
                request_id=req.request_id, new_token_ids=[], new_text="", finished=True, finish_reason="error",
                num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                num_cached_tokens=max(0, req.num_cached_tokens)))
        if reqs:
            log.error("ended %d request(s) with an error: %s", len(reqs), [r.request_id for r in reqs])
        return deltas

