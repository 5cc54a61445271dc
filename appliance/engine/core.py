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
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union, cast

from appliance.engine.beam_search import BeamSearches
from appliance.engine.constraints import advance_grammar, mask_step
from appliance.engine.detokenizer import IncrementalDetokenizer
from appliance.engine.failures import Suspects, forget_step_kv, requeue, schedule_alone
from appliance.engine.interfaces import (
    EngineDeadError,
    EventSink,
    GrammarSource,
    Lockstep,
    PipelinedStepRunner,
    StepOutput,
    StepRunner,
)
from appliance.engine.kv_p2p import kv_transfer_problem
from appliance.engine.outputs import RequestOutputDelta, StepStats
from appliance.engine.request import Request, RequestStatus
from appliance.engine.scheduler import Scheduler
from appliance.engine.scheduler_output import RequestUpdate, SchedulerOutput
from appliance.engine.step_accounting import PromptLogprobs, StepCounters, token_logprobs
from appliance.engine.token_budget import TokenBudget
from appliance.sampling_params import SamplingParams, resolve_bad_words

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("appliance.engine")


class EngineCore:
    """Failures are contained: a request whose admission fails is refused
    alone; when a step fails, the requests it ran are put back for
    recompute and run again one at a time, and only one that fails on its
    own is ended, with finish_reason "error" (the traceback is logged). The
    loop itself survives; only a failure outside any request (scheduler
    state) ends every request, and a failure of that clean-up is fatal."""

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
        self.beams = BeamSearches(scheduler, eos_token_id,
                                  lambda ids, skip: str(tokenizer.decode(ids, skip_special_tokens=skip)))
        self.last_stats = StepStats()
        self._suspects = Suspects()  # requests to run alone, after a failed step
        self.token_budget = token_budget  # None: every step may take the scheduler's configured budget
        self._objective_budget: Optional[int] = None  # the objective's, refitted before each step; None: configured
        self._counters = StepCounters()
        self.grammars = grammars  # None: requests with structured_outputs are refused
        self._compiling: dict[str, Request] = {}  # requests waiting for their grammar
        self.lockstep = lockstep  # None: this core steps on its own
        self.kv_events = kv_events  # None: the block pool's events are not published
        self._prompt_lps = PromptLogprobs()
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
        if params.bad_words:
            resolve_bad_words(params, lambda w: self.tokenizer.encode(w, add_special_tokens=False))
        self._check_token_ids(prompt_token_ids, params)
        c = self.scheduler.connector
        problem = kv_transfer_problem(params, c.name if c is not None else None, c.role if c is not None else "",
                                      self.block_size)
        if problem is not None:
            raise ValueError(f"kv_transfer_params {problem}")
        if params.use_beam_search:  # its steps are requests of their own (engine/beam_search.py)
            self.beams.add(request_id, prompt_token_ids, params, priority, cache_salt, arrival_time)
            return
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        grammar = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("this engine was built without structured outputs")
            grammar = self.grammars.grammar_for(params, prompt_token_ids)
        req = Request(request_id, prompt_token_ids, params, eos_token_id=self.eos_token_id,
                      arrival_time=arrival_time, priority=priority, cache_salt=cache_salt, grammar=grammar)
        self.scheduler.add_request(req)
        self.detok[request_id] = detok
        if params.prompt_logprobs is not None:
            self._prompt_lps.start(request_id)
        if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
            self._compiling[request_id] = req

    def _check_token_ids(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        v = self.vocab_size
        if not v:
            return
        for name, ids in (("prompt", prompt_token_ids), ("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", list(params.logit_bias)), ("allowed_token_ids", params.allowed_token_ids or []),
                          ("bad_words", [t for w in params.bad_words_token_ids for t in w])):
            try:
                out_of_range = bool(ids) and (min(ids) < 0 or max(ids) >= v)
            except TypeError:
                raise ValueError(f"{name} must hold integer token ids") from None
            if out_of_range:
                raise ValueError(f"{name} holds a token id outside the vocabulary (0..{v - 1})")

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.beams.abort(rid)
        for req in self.scheduler.abort(request_ids):
            self.detok.pop(req.request_id, None)
            self._prompt_lps.discard(req.request_id)
            self._suspects.forget(req.request_id)

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
        return budget.calibration_prompt_within(s.max_model_len, s.kv.num_free_blocks * self.block_size)

    @property
    def step_token_budget(self) -> int:
        """The tokens a step may schedule: under a latency objective (``token_budget``)
        its budget for the next step, else the scheduler's configured one."""
        return self.scheduler.max_num_batched_tokens if self._objective_budget is None else self._objective_budget

    def stats(self, iteration_tokens: int = 0) -> StepStats:
        """Gauges now; counters since the engine was built or ``reset_stats``."""
        return self._counters.stats(self.scheduler, iteration_tokens, self.step_token_budget,
                                    self.grammars.take_compile_seconds() if self.grammars is not None else [])

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
        self._counters.reset(self.scheduler)
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
        alone = self._suspects.next(self.scheduler.requests)
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
            self.token_budget.observe_step(sched_out, self.scheduler.requests, time.perf_counter() - t0)
        return self._apply(sched_out, runner_out, alone)

    def _schedule(self, alone: Optional[str], max_reqs: Optional[int] = None,
                  in_flight: frozenset[str] = frozenset()) -> SchedulerOutput:
        """The next step (``alone``: only that request; ``in_flight``: requests of steps
        not collected yet), its structured-output masks made."""
        if self.token_budget is not None and alone is None:
            self._objective_budget = self.token_budget.budget_for(self.scheduler.running)
        sched_out = (schedule_alone(self.scheduler, alone, self._objective_budget) if alone is not None
                     else self.scheduler.schedule(max_reqs, in_flight, token_budget=self._objective_budget))
        if not sched_out.num_scheduled_tokens and not self._in_flight and self.beams.groups:
            self.beams.release_kv()  # what beams hold for their forks may be what keeps everything waiting
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
                mask_step(self.grammars, self.scheduler.requests, sched_out)
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
            self.token_budget.observe_step(sched_out, self.scheduler.requests,
                                           time.perf_counter() - self._ran_alone_from)
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
        self._counters.observe_experts(runner_out.expert_stats)
        if alone is not None and (alone in runner_out.sampled_token_ids or alone not in sched_out.num_scheduled_tokens):
            self._suspects.cleared(alone)  # it ran on its own to a sample
        if self._prompt_lps:
            requests = self.scheduler.requests
            self._prompt_lps.gather({rid: scored for rid, scored in
                                     runner_out.prompt_logprobs.items()
                                     if rid in requests and requests[rid].status == RequestStatus.RUNNING})
        stopped, failed = self._take_tokens(runner_out.sampled_token_ids)
        if self.beams.steps:  # the KV of beams' steps that end now outlives them, for the next beams' forks
            self.beams.hold(list(runner_out.sampled_token_ids))
        self._counters.count_spec(sched_out, runner_out.sampled_token_ids)
        updates = self.scheduler.update_from_output(sched_out, runner_out.sampled_token_ids, stopped,
                                                    runner_out.spec_token_ids)
        for u in updates:
            req = u.request
            if req.grammar is not None and req.spec_token_ids and not u.finished:
                del req.spec_token_ids[req.grammar.valid_prefix(req.spec_token_ids):]  # drafts the grammar allows
        deltas = []
        for u in updates:
            if self.beams.is_step(u.request.request_id):
                if u.finished:
                    lps = runner_out.logprobs.get(u.request.request_id) or [None]
                    deltas += self.beams.stepped(u.request, lps[0].top if lps[0] is not None else [])
            elif u.request.request_id not in failed:
                try:
                    deltas.append(self._delta(u, runner_out, u.request.request_id in stopped))
                except Exception:
                    log.exception("detokenizing request %s failed", u.request.request_id)
                    failed[u.request.request_id] = u.request
        if failed:
            deltas += self._fail(list(failed.values()))
        self.last_stats = self.stats(sched_out.total_num_scheduled_tokens)
        return deltas

    def _take_tokens(self, sampled: dict[str, list[int]]) -> tuple[dict[str, tuple[int, Union[str, int, None]]],
                                                                 dict[str, Request]]:
        """The step's sampled tokens through each running request's grammar and
        detokenizer, up to its first stop condition (a stop string cuts at the
        token that completes it): ({rid: (tokens kept, stop reason)} for
        those that stopped, {rid: request} for those whose processing failed)."""
        stopped: dict[str, tuple[int, Union[str, int, None]]] = {}
        failed: dict[str, Request] = {}
        for rid, toks in sampled.items():
            req = self.scheduler.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING or self.beams.is_step(rid):
                continue  # aborted while the step ran, or (a step before it failed) to be recomputed; a beam's step
            try:
                kept = self.scheduler.num_kept(req, toks)
                if req.grammar is not None and (ended := advance_grammar(req, toks[:kept])):
                    kept = ended
                    stopped[rid] = (ended, None)
                for j, tok in enumerate(toks[:kept], 1):
                    if (hit := self.detok[rid].add_tokens([tok])) is not None:
                        stopped[rid] = (j, hit)  # vLLM's stop_reason: the stop string matched
                        break
            except Exception:
                log.exception("processing the tokens of request %s failed", rid)
                failed[rid] = req
        return stopped, failed

    def _delta(self, u: RequestUpdate, runner_out: StepOutput, stopped: bool) -> RequestOutputDelta:
        """What a step added to request ``u.request`` (``stopped``: at a stop
        condition of its text or grammar, the detokenizer's text cut there)."""
        req = u.request
        d = self.detok[req.request_id]
        if u.finished:
            if not stopped:
                d.flush()
            del self.detok[req.request_id]
            self._suspects.forget(req.request_id)
        new_text = d.take_delta(u.finished)
        return RequestOutputDelta(
            request_id=req.request_id,
            new_token_ids=u.new_token_ids,
            new_text=new_text,
            finished=u.finished,
            finish_reason=req.finish_reason if u.finished else None,
            stop_reason=req.stop_reason if u.finished else None,
            logprobs=token_logprobs(runner_out.logprobs.get(req.request_id, ())[: len(u.new_token_ids)]),
            prompt_logprobs=self._prompt_lps.take(req) if self._prompt_lps else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=max(0, req.num_cached_tokens),
            queue_time=(req.first_scheduled_time - req.arrival_time)
            if u.new_token_ids and req.num_output_tokens == len(u.new_token_ids) and req.first_scheduled_time
            else None,
            kv_transfer_params=req.kv_transfer_params if u.finished else None,
        )

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

    # -- failure containment -------------------------------------------------
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
        forget_step_kv(s, sched_out, batch, later)
        if s.connector is not None:
            s.connector.step_failed(sched_out.kv_connector_metadata)
        if alone is not None and not batch:
            self._suspects.cleared(alone)
        ended, retry = self._suspects.blame(batch, alone is not None, retry_all)
        requeue(s, retry)
        return self._fail(ended) if ended else []

    def _fail(self, reqs: list[Request]) -> list[RequestOutputDelta]:
        """End ``reqs`` (live or just finished) with finish_reason "error"."""
        steps = {r.request_id for r in reqs if self.beams.is_step(r.request_id)}  # their searches end, once each
        self.scheduler.abort([r.request_id for r in reqs])
        deltas = []
        for req in reqs:
            self.detok.pop(req.request_id, None)
            self._prompt_lps.discard(req.request_id)
            self._suspects.forget(req.request_id)
            if req.request_id in steps:
                deltas += [d for d in (self.beams.fail(req.request_id),) if d is not None]
                continue
            deltas.append(RequestOutputDelta(
                request_id=req.request_id, new_token_ids=[], new_text="", finished=True, finish_reason="error",
                num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                num_cached_tokens=max(0, req.num_cached_tokens)))
        if reqs:
            log.error("ended %d request(s) with an error: %s", len(reqs), [r.request_id for r in reqs])
        return deltas

