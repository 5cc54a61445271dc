"""The engine-core process: a busy loop over ZeroMQ.

The front end pushes ``messages.ToCore`` (add, abort, reset_prefix_cache,
shutdown); the core pushes ``messages.FromCore``: ``Ready`` after loading
and one real warm-up generation, ``Outputs`` (deltas and stats) after every
step that ran or changed anything, ``RequestError``,
``ResetPrefixCacheResult``, and ``Fatal`` before it exits non-zero. See
``messages.py``.

The loop sends a ``Heartbeat`` whenever ``heartbeat_interval_s`` has passed
since the last one, between steps and while idle (an idle loop comes round
every 50 ms or sooner), so the front end can tell a frozen or stuck core from a quiet
one: a core it has not heard from for ``server.core_heartbeat_timeout_s``
is unresponsive (``client.py``).

A request the core fails on (not the client's doing) ends with a delta of
finish_reason "error"; the traceback goes to the core's log and the core
goes on serving the others.

The loop blocks on its input socket only while it has nothing to run, so
HTTP work in the front end overlaps model work here.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING, Callable

import msgspec

from appliance.config.deployment import Deployment
from appliance.engine.core import EngineCore
from appliance.engine.outputs import RequestOutputDelta
from appliance.engine.token_budget import TokenBudget
from appliance.sampling_params import SamplingParams
from appliance.server.messages import (
    AbortRequests,
    AddRequest,
    Fatal,
    Heartbeat,
    Outputs,
    Ready,
    RequestError,
    ResetPrefixCache,
    ResetPrefixCacheResult,
    Shutdown,
    decode_to_core,
    encode,
)

if TYPE_CHECKING:
    import zmq
    from transformers import PreTrainedTokenizerBase

# The composition root's engine factory (``appliance.runner.build_engine``); it
# runs in the core process, so it must be a module-level function (pickled).
BuildEngine = Callable[[Deployment], "tuple[EngineCore, PreTrainedTokenizerBase]"]

WARMUP_PROMPT = "Hello"
HEARTBEAT_EVERY_S = 1.0  # the longest gap between heartbeats of a loop that comes round

log = logging.getLogger("appliance.engine")


def heartbeat_interval_s(timeout_s: float) -> float:
    """How often the loop sends a heartbeat: every second, or four times per
    ``server.core_heartbeat_timeout_s`` when that is shorter."""
    return min(HEARTBEAT_EVERY_S, timeout_s / 4)


def run_core(deployment: Deployment, build_engine: BuildEngine, in_addr: str, out_addr: str) -> None:
    import signal

    import zmq

    # The front end owns shutdown: a terminal's Ctrl-C or a process-group
    # SIGTERM must not kill the core under in-flight requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(out_addr)
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    try:
        engine, tokenizer = build_engine(deployment)
        _warm_up(engine, tokenizer)
        push.send(encode(Ready(num_kv_blocks=engine.num_kv_blocks, block_size=engine.block_size,
                               backend=deployment.execution.backend or "", pid=os.getpid())))
        _loop(engine, pull, push, heartbeat_interval_s(deployment.cfg.server.core_heartbeat_timeout_s))
        if engine.kv_events is not None:
            engine.kv_events.close()  # what is queued goes out before the core exits
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        push.send(encode(Fatal(f"{type(e).__name__}: {e}")))
        push.close(linger=1000)
        sys.exit(1)
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()


def _warm_up(engine: EngineCore, tokenizer: PreTrainedTokenizerBase) -> None:
    """One real generation before /ready (with lock-step peers, every core's
    at once, the steps taken together); under a latency objective
    (``scheduler.target_itl_ms``, ``scheduler.max_itl_ratio``) then a prompt of the token budget's first
    estimate, whose step times give the budget its first fit; then a clean
    cache and counters from zero."""
    ids = tokenizer.encode(WARMUP_PROMPT)
    _run_alone(engine, "__warmup__", ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    n = engine.begin_budget_calibration()  # the first steps ran cold: the budget forgets them
    if n is not None:
        prompt = (ids * (n // max(1, len(ids)) + 1))[:n]
        _run_alone(engine, "__calibrate__", prompt,
                   SamplingParams(max_tokens=TokenBudget.MIN_SAMPLES, temperature=0, ignore_eos=True))
    engine.reset_prefix_cache()
    engine.reset_stats()


def _run_alone(engine: EngineCore, request_id: str, ids: list[int], params: SamplingParams) -> None:
    """Step ``engine`` until its only request (and, in lock step, every peer's) is done."""
    engine.add_request(request_id, ids, params)
    lockstep = engine.lockstep
    while True:
        local = engine.has_unfinished_requests()
        if lockstep is not None:
            any_work, _ = lockstep.agree(local, False)
            if not any_work:
                break
            if not local:
                lockstep.idle_step()
                continue
        elif not local:
            break
        if any(d.finish_reason == "error" for d in engine.step()):  # the engine logged why
            raise RuntimeError(f"the warm-up generation {request_id} failed")


def _loop(engine: EngineCore, pull: zmq.Socket, push: zmq.Socket, heartbeat_s: float) -> None:
    import zmq

    shutting_down = False
    parent = os.getppid()
    lockstep = engine.lockstep
    idle_ms = 50 if lockstep is None else lockstep.idle_poll_ms  # lock-step peers agree between polls
    last_beat = time.monotonic()
    while True:
        if os.getppid() != parent:
            return  # the front end died without a word: nobody to serve
        now = time.monotonic()
        if now - last_beat >= heartbeat_s:
            push.send(encode(Heartbeat()))
            last_beat = now
        timeout = 0 if engine.has_unfinished_requests() else idle_ms
        changed = False
        while pull.poll(timeout, zmq.POLLIN):
            timeout = 0
            raw = pull.recv()
            try:
                msg = decode_to_core(raw)
            except msgspec.MsgspecError as e:  # a front-end bug: drop the message, keep serving the others
                log.error("dropping a message the core cannot read (%s): %r", e, raw[:200])
                continue
            changed = True
            if isinstance(msg, AddRequest):
                try:
                    engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params, priority=msg.priority,
                                       cache_salt=msg.cache_salt)
                except ValueError as e:
                    push.send(encode(RequestError(msg.request_id, str(e))))
                except Exception:  # not the client's doing: this request fails, the core goes on
                    log.exception("adding request %s failed", msg.request_id)
                    failed = RequestOutputDelta(msg.request_id, [], "", True, finish_reason="error")
                    push.send(encode(Outputs([failed], engine.stats(0))))
            elif isinstance(msg, AbortRequests):
                engine.abort(msg.request_ids)
            elif isinstance(msg, ResetPrefixCache):
                push.send(encode(ResetPrefixCacheResult(engine.reset_prefix_cache())))
            elif isinstance(msg, Shutdown):
                shutting_down = True
        local = engine.has_unfinished_requests()
        if lockstep is not None:  # step when any peer has work; stop when all stop with none left
            any_work, all_stopping = lockstep.agree(local, shutting_down and not local)
            if not any_work and all_stopping:
                push.send(encode(Outputs([], engine.stats(0))))
                return
            if any_work and not local:
                lockstep.idle_step()
        elif shutting_down and not local:
            push.send(encode(Outputs([], engine.stats(0))))
            return
        if local:
            deltas = engine.step()
            push.send(encode(Outputs(deltas, engine.last_stats)))
        elif engine.has_kv_transfers():  # learn when KV a connector moves arrives or is released (every idle_ms)
            engine.step()
            if changed:
                push.send(encode(Outputs([], engine.stats(0))))
        elif changed:
            push.send(encode(Outputs([], engine.stats(0))))
