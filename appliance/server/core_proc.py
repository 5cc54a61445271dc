"""The engine-core process: a busy loop over ZeroMQ.

Front end -> core (PUSH/PULL, msgpack):
    {"type": "add", "request_id", "prompt_token_ids", "params", "priority", "cache_salt"}
    {"type": "abort", "request_ids": [...]}
    {"type": "reset_prefix_cache"}
    {"type": "shutdown"}
Core -> front end:
    {"type": "ready", "num_kv_blocks", "backend", ...}   after loading and one real warm-up generation
    {"type": "outputs", "outputs": [delta...], "stats": {...}}
    {"type": "request_error", "request_id", "message"}
    {"type": "reset_prefix_cache", "ok": bool}
    {"type": "fatal", "message"}                           then the process exits non-zero

A request the core fails on (not the client's doing) ends with a delta of
finish_reason "error"; the traceback goes to the core's log and the core
goes on serving the others.

The loop blocks on its input socket only while it has nothing to run, so
HTTP work in the front end overlaps model work here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import traceback
from typing import Any, Callable

import msgspec

from appliance.config.deployment import Deployment
from appliance.sampling_params import SamplingParams

WARMUP_PROMPT = "Hello"

log = logging.getLogger("appliance.engine")


def encode(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def decode(raw: bytes) -> Any:
    return msgspec.msgpack.decode(raw, strict=False)


def params_to_dict(p: SamplingParams) -> dict:
    d = dataclasses.asdict(p)
    d["logit_bias"] = {int(k): v for k, v in p.logit_bias.items()}
    return d


def params_from_dict(d: dict) -> SamplingParams:
    d = dict(d)
    d["logit_bias"] = {int(k): v for k, v in (d.get("logit_bias") or {}).items()}
    return SamplingParams(**d)


def delta_to_dict(d: Any) -> dict:
    out = dataclasses.asdict(d)
    out["logprobs"] = [dataclasses.asdict(lp) if lp is not None else None for lp in d.logprobs]
    return out


def run_core(deployment: Deployment, build_engine: Callable[[Deployment], tuple[Any, Any]], in_addr: str,
             out_addr: str) -> None:
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
        kv = engine.scheduler.kv
        push.send(encode({
            "type": "ready",
            "num_kv_blocks": kv.pool.num_blocks,
            "block_size": kv.block_size,
            "backend": deployment.execution.backend,
            "pid": os.getpid(),
        }))
        _loop(engine, pull, push)
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        push.send(encode({"type": "fatal", "message": f"{type(e).__name__}: {e}"}))
        push.close(linger=1000)
        sys.exit(1)
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()


def _warm_up(engine: Any, tokenizer: Any) -> None:
    """One real generation before /ready; then start from a clean cache."""
    ids = tokenizer.encode(WARMUP_PROMPT)
    engine.add_request("__warmup__", ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        if any(d.finish_reason == "error" for d in engine.step()):  # the engine logged why
            raise RuntimeError("the warm-up generation failed")
    kv = engine.scheduler.kv
    kv.reset_prefix_cache()
    from appliance.engine.kv_cache.manager import PrefixCacheStats

    kv.stats = PrefixCacheStats()


def _stats(engine: Any, iteration_tokens: int = 0) -> dict:
    return dataclasses.asdict(engine.stats(iteration_tokens))


def _loop(engine: Any, pull: Any, push: Any) -> None:
    import zmq

    from appliance.engine.core import RequestOutputDelta

    shutting_down = False
    parent = os.getppid()
    while True:
        if os.getppid() != parent:
            return  # the front end died without a word: nobody to serve
        timeout = 0 if engine.has_unfinished_requests() else 50
        changed = False
        while pull.poll(timeout, zmq.POLLIN):
            timeout = 0
            msg = decode(pull.recv())
            kind = msg["type"]
            changed = True
            if kind == "add":
                try:
                    engine.add_request(msg["request_id"], msg["prompt_token_ids"], params_from_dict(msg["params"]),
                                       priority=msg.get("priority", 0), cache_salt=msg.get("cache_salt"))
                except ValueError as e:
                    push.send(encode({"type": "request_error", "request_id": msg["request_id"], "message": str(e)}))
                except Exception:  # not the client's doing: this request fails, the core goes on
                    log.exception("adding request %s failed", msg["request_id"])
                    failed = RequestOutputDelta(msg["request_id"], [], "", True, finish_reason="error")
                    push.send(encode({"type": "outputs", "outputs": [delta_to_dict(failed)],
                                      "stats": _stats(engine, 0)}))
            elif kind == "abort":
                engine.abort(msg["request_ids"])
            elif kind == "reset_prefix_cache":
                push.send(encode({"type": "reset_prefix_cache", "ok": engine.scheduler.kv.reset_prefix_cache()}))
            elif kind == "shutdown":
                shutting_down = True
        if shutting_down and not engine.has_unfinished_requests():
            push.send(encode({"type": "outputs", "outputs": [], "stats": _stats(engine, 0)}))
            return
        if engine.has_unfinished_requests():
            deltas = engine.step()
            push.send(encode({"type": "outputs", "outputs": [delta_to_dict(d) for d in deltas],
                              "stats": dataclasses.asdict(engine.last_stats)}))
        elif changed:
            push.send(encode({"type": "outputs", "outputs": [], "stats": _stats(engine, 0)}))
