"""Running an admitted request: admission against the queue limit, the
``n`` fan-out (``engine.parallel_sampling``, shared with the offline
``LLM``), the request timeout, metrics and logs per child, cutting on a
drain, and the mapping of every failure to an OpenAI error."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Optional, Union

from litestar import Request

from appliance.engine.outputs import RequestOutputDelta
from appliance.engine.parallel_sampling import Child, ParentRequest
from appliance.server.client import EngineDeadError, EngineRestartingError, RequestRejected
from appliance.server.metrics import RequestSeries
from appliance.server.protocol import GenerationRequest, OpenAIError
from appliance.server.state import ServerState
from appliance.server.tracing import EngineRequestTiming, RequestSpan

log = logging.getLogger("appliance.server")

# Engine failures are logged, never sent to clients.
ENGINE_FAILED = "the engine failed; see the server log"
ENGINE_RESTARTING = "the engine failed and is restarting; retry after the Retry-After interval (see the server log)"


class RequestTimeout(Exception):
    pass


class RequestFailed(Exception):
    """The engine core failed on this request (finish_reason "error"); it logged why."""


class ServerShutdown(Exception):
    """A drain cut the request (server.shutdown_timeout_s passed, or a second signal)."""


def map_engine_error(e: BaseException, quiet: bool = False) -> OpenAIError:
    """The OpenAI error a failure is answered with; an unexpected one is logged (unless ``quiet``)."""
    if isinstance(e, EngineRestartingError):
        return OpenAIError(503, ENGINE_RESTARTING, code="engine_restarting",
                           headers={"Retry-After": str(e.retry_after_s)})
    if isinstance(e, ServerShutdown):
        return OpenAIError(503, str(e), code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, ENGINE_FAILED, code="engine_dead", headers={"Retry-After": "30"})
    if isinstance(e, RequestFailed):
        return OpenAIError(500, str(e), code="engine_error")
    if isinstance(e, RequestRejected):
        return OpenAIError(400, str(e))
    if isinstance(e, RequestTimeout):
        return OpenAIError(408, str(e), code="request_timeout")
    if isinstance(e, OpenAIError):
        return e
    if not quiet:
        log.error("request failed", exc_info=e)
    return OpenAIError(500, f"internal server error ({type(e).__name__}); see the server log", code=500)


class Admission:
    """Admits a request's children (prompts x n) against server.max_queue_len
    (400 when they could never fit, 503 queue_full while the queue is too
    full) and counts them from that moment (before any task runs) until they
    end; released once, by the generation or by garbage collection if it
    never ran."""

    def __init__(self, st: ServerState, n: int, param: str = "n"):
        self.st, self.n = st, 0
        if n > st.max_queue_len:
            raise OpenAIError(400, f"this request asks for {n} sequences (prompts x n); the server queues at most "
                                   f"server.max_queue_len={st.max_queue_len}", param=param, code="too_many_sequences")
        waiting = st.in_flight - st.client.stats.num_running
        if waiting + n > st.max_queue_len:
            raise OpenAIError(503, f"too many waiting requests ({waiting} waiting, this request adds {n}; limit "
                                   f"server.max_queue_len={st.max_queue_len})", code="queue_full",
                              headers={"Retry-After": "1"})
        self.n = n
        st.in_flight += n

    def release(self) -> None:
        if self.n:
            self.st.in_flight -= self.n
            self.n = 0

    __del__ = release


# What the children put on a generation's merged queue: (child, delta), (child,
# exception), (child, None) when a child is done, (None, ServerShutdown) on a cut.
_Item = tuple[Optional[Child], Union[RequestOutputDelta, BaseException, None]]


def cut_generations(st: ServerState, reason: str) -> int:
    """End every running generation with ``ServerShutdown`` (streams send it as an
    error event, then [DONE]); later ones end the same way at once. How many were cut."""
    st.cut_reason = reason
    for gen in list(st.generations):
        gen.cut(reason)
    return len(st.generations)


class Generation:
    """One admitted request: its children (prompts x n), counted against the
    queue limit from construction until ``deltas()`` ends."""

    def __init__(self, st: ServerState, g: GenerationRequest, request_id: str, param: str = "n",
                 span: Optional[RequestSpan] = None):
        self.st, self.request = st, g
        self.admission = Admission(st, len(g.prompts) * g.params.n, param)
        self.parent = ParentRequest(request_id, len(g.prompts), g.params)
        self._merged: Optional[asyncio.Queue[_Item]] = None
        self.span = span  # the request's trace span: a child span per engine request, ended with the generation
        if span is not None:
            span.set_attribute("appliance.request_id", request_id)

    @property
    def request_id(self) -> str:
        return self.parent.request_id

    def cut(self, reason: str) -> None:
        if self._merged is not None:
            self._merged.put_nowait((None, ServerShutdown(reason)))

    async def _child(self, child: Child, merged: asyncio.Queue[_Item]) -> None:
        st, g, rid = self.st, self.request, child.request_id
        arrival = time.monotonic()
        first = last = None
        finished = False
        m: Optional[RequestSeries] = None  # the series of the engine core that serves it
        timing = EngineRequestTiming(rid, 0, arrival)
        try:
            rank = timing.engine = st.client.pick_rank(g.data_parallel_rank)
            m = st.metrics.requests(rank)
            async for d in st.client.generate(rid, g.prompts[child.prompt_index], child.params, g.priority,
                                              g.cache_salt, rank):
                t = time.monotonic()
                if d.new_token_ids:
                    if first is None:
                        first = timing.first_token = t
                        m.time_to_first_token_seconds.observe(t - arrival)
                    elif last is not None:
                        per = (t - last) / len(d.new_token_ids)
                        for _ in d.new_token_ids:
                            m.inter_token_latency_seconds.observe(per)
                    last = t
                if d.queue_time is not None:
                    timing.queue_time = d.queue_time
                    m.request_queue_time_seconds.observe(d.queue_time)
                timing.prompt_tokens, timing.cached_tokens = d.num_prompt_tokens, d.num_cached_tokens
                timing.output_tokens = d.num_output_tokens
                if d.finish_reason == "error":
                    finished = True
                    m.request_success("error")
                    log.error("request_id=%s failed in the engine core", rid)
                    raise RequestFailed("the engine failed to process this request; see the server log")
                for c, dc in self.parent.split(child, d):  # a beam search's beams: one to each of the prompt's
                    await merged.put((c, dc))
                if d.finished:
                    finished = True
                    timing.end, timing.finish_reason = t, d.finish_reason or "abort"
                    m.e2e_request_latency_seconds.observe(t - arrival)
                    m.generation_tokens.inc(d.num_output_tokens)
                    m.request_success(d.finish_reason or "abort")
                    log.info(
                        "request_id=%s prompt_tokens=%d output_tokens=%d cached_tokens=%d ttft_s=%.4f total_s=%.4f "
                        "finish_reason=%s", rid, d.num_prompt_tokens, d.num_output_tokens, d.num_cached_tokens,
                        (first or t) - arrival, t - arrival, d.finish_reason)
        except asyncio.CancelledError:
            if not finished:  # client went away: the generator aborted it in the core
                timing.error = "aborted: the client went away or the request ended"
                if m is not None:
                    m.request_success("abort")
                log.info("request_id=%s aborted after %.4f s", rid, time.monotonic() - arrival)
            raise
        except Exception as e:  # delivered to the consumer
            timing.error = map_engine_error(e, quiet=True).message
            await merged.put((child, e))
        finally:
            merged.put_nowait((child, None))
            if self.span is not None:
                self.span.engine_request(timing, st.model_name, g.params)

    async def deltas(self) -> AsyncIterator[tuple[Child, RequestOutputDelta]]:
        """Run every child; yield (child, delta) as they arrive; past
        server.request_timeout_s every child is aborted and RequestTimeout raised."""
        st = self.st
        merged: asyncio.Queue[_Item] = asyncio.Queue()
        self._merged = merged
        st.generations.add(self)
        if st.cut_reason is not None:
            merged.put_nowait((None, ServerShutdown(st.cut_reason)))
        for ids in self.request.prompts:
            st.metrics.prompt_tokens.inc(len(ids))
        tasks = [asyncio.create_task(self._child(c, merged)) for c in self.parent.engine_children]
        remaining = len(tasks)
        timeout_s = st.cfg.server.request_timeout_s
        deadline = time.monotonic() + timeout_s
        outcome: tuple[int, Optional[str]] = (200, None)  # what the request's span ends with
        try:
            while remaining:
                try:
                    child, item = await asyncio.wait_for(merged.get(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise RequestTimeout(f"the request ran longer than server.request_timeout_s={timeout_s:g} s "
                                         f"and was aborted") from None
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                assert child is not None  # only a cut comes without its child, as an exception
                yield child, item
        except BaseException as e:
            if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
                outcome = (499, "the client went away")
            else:
                err = map_engine_error(e, quiet=True)
                outcome = (err.status, err.message)
            raise
        finally:
            st.generations.discard(self)
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            self.admission.release()
            if self.span is not None:
                self.span.end(*outcome)

    async def collect(self, request: Request) -> list[Child]:
        """Non-streaming: every child to its end, in index order; a client disconnect aborts them."""

        async def run() -> None:
            async for child, d in self.deltas():
                child.add(d)

        gen = asyncio.create_task(run())
        watch = asyncio.create_task(_until_disconnect(request))
        try:
            await asyncio.wait({gen, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not gen.done():
                gen.cancel()
                await asyncio.gather(gen, return_exceptions=True)
                log.info("client disconnected; request %s aborted", self.request_id)
        if gen.cancelled():
            raise OpenAIError(499, "client disconnected")
        exc = gen.exception()
        if exc is not None:
            raise map_engine_error(exc)
        return self.parent.children


async def _until_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
