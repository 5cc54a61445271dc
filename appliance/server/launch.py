"""`appliance run`: start the engine core, then serve HTTP until SIGTERM.

The core is started (model loaded, one warm-up generation done) before the
listener opens, so a server that accepts connections is ready.

SIGTERM starts a drain: the listener stays open, ``/ready`` answers 503 and
new work 503 with Retry-After (responses say ``Connection: close``), while
admitted requests finish for up to ``server.shutdown_timeout_s``; then what
is left is cut (a stream ends with an error event and ``[DONE]``, a whole
response is a 503), the connections close, the core is stopped and the
process exits 0. A second signal cuts at once. When the engine core cannot
be kept up (see ``client.py``), the server exits 1.

Connections are guarded by ``transport.py`` (head, body and keep-alive
timeouts, a connection limit); tokenization runs on a small thread pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Optional

from appliance.config.deployment import Deployment, ExpertGroupAddress

if TYPE_CHECKING:
    from appliance.server.core_proc import BuildEngine
    from appliance.server.metrics import Metrics
    from appliance.server.state import ServerState
    from appliance.server.tracing import Tracing

log = logging.getLogger("appliance.server")

CUT_GRACE_S = 2.0  # after a drain's cut, how long responses get to send their last event
CLOSE_TIMEOUT_S = 3  # then uvicorn's wait for connections to close before it cancels what is left


class Drain:
    """The SIGTERM drain, advanced by the server's 0.1 s tick: done when no
    request runs; past ``server.shutdown_timeout_s`` (or at a second signal)
    in-flight generations are cut and get ``CUT_GRACE_S`` to answer."""

    def __init__(self, state: ServerState, timeout_s: float):
        self.state, self.timeout_s = state, timeout_s
        self.started: Optional[float] = None
        self.cut_at: Optional[float] = None

    def begin(self, sig: int) -> None:
        now = time.monotonic()
        if self.started is None:
            self.started = now
            self.state.shutting_down = True
            log.info("signal %d: draining; /ready and new requests answer 503, %d running request(s) get up to %g s",
                     sig, self.state.in_flight, self.timeout_s)
        elif self.cut_at is None:
            self._cut(now, f"signal {sig} again")

    def _cut(self, now: float, why: str) -> None:
        from appliance.server.generation import cut_generations

        self.cut_at = now
        n = cut_generations(self.state, f"the server is shutting down ({why}); the request was aborted")
        log.warning("draining: %s; cut %d running request(s)", why, n)

    def finished(self, running_tasks: int) -> bool:
        if self.started is None:
            return False
        if not running_tasks and not self.state.in_flight:
            return True
        now = time.monotonic()
        if self.cut_at is None:
            if now - self.started < self.timeout_s:
                return False
            self._cut(now, f"still running after server.shutdown_timeout_s={self.timeout_s:g} s")
        assert self.cut_at is not None  # _cut set it
        return now - self.cut_at >= CUT_GRACE_S


def serve_forever(deployment: Deployment, build_engine: BuildEngine,
                  make_segment: Optional[Callable[[int], ExpertGroupAddress]] = None) -> int:
    """Serve ``deployment``; ``build_engine(deployment)`` builds the engine in
    the engine-core process, ``make_segment(n)`` makes where ``n``
    lock-step engine cores exchange (both the composition
    root's functions)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return asyncio.run(_serve(deployment, build_engine, make_segment))


def _lower_priority() -> None:
    """Tokenizer threads yield the CPU to the event loop and the engine core:
    a burst of huge prompts to refuse must not slow the streams being served."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))
    except OSError:
        pass


def _tracing(deployment: Deployment, metrics: Metrics) -> Optional[Tracing]:
    """The deployment's tracer when server.otlp_traces_endpoint is set."""
    endpoint = deployment.cfg.server.otlp_traces_endpoint
    if endpoint is None:
        return None
    from appliance.server.tracing import Tracing

    cfg = deployment.cfg
    tracing = Tracing(endpoint, {"appliance.deployment": deployment.fingerprint,
                                 "appliance.config_hash": deployment.resolved.hash, "appliance.profile": cfg.profile,
                                 "appliance.model": deployment.model_name},
                      dropped=metrics.trace_spans_dropped.inc)
    log.info("tracing: a span per request to %s", endpoint)
    return tracing


def _uvicorn_server(cfg: Any, app: Any, state: Any, drain: Drain, fatal: list[str]) -> Any:
    """The HTTP server over ``app``: connection limits and timeouts from
    ``server.*``, a signal starting the drain instead of stopping it at once,
    and its loop ending once drained or on a fatal engine error."""
    import uvicorn

    from appliance.server.transport import ConnectionLimits, guarded_protocol

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
            # Not uvicorn's: it would stop listening at once, so a load balancer
            # would never see /ready turn 503. The tick below ends the drain (and
            # no signal is captured for uvicorn to re-raise: a drained SIGTERM exits 0).
            drain.begin(sig)

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter) or fatal:
                return True
            return drain.finished(len(self.server_state.tasks))

    limits = ConnectionLimits(header_timeout_s=cfg.server.header_timeout_s, body_timeout_s=cfg.server.body_timeout_s,
                              max_connections=cfg.server.max_connections, draining=lambda: state.shutting_down)
    return Server(uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, log_level="warning",
                                 http=guarded_protocol(limits), timeout_keep_alive=cfg.server.keep_alive_timeout_s,
                                 timeout_graceful_shutdown=CLOSE_TIMEOUT_S, lifespan="off"))


def _log_start(deployment: Deployment, ready: Any) -> None:
    cfg, ex = deployment.cfg, deployment.execution
    dp = deployment.layout.data_parallel_size
    log.info("profile %s (config %s, deployment %s), model %s, backend %s, dtype %s, kv cache %s, host %s",
             cfg.profile, deployment.resolved.hash, deployment.fingerprint, deployment.model_name, ex.backend, ex.dtype,
             ex.kv_cache_dtype, ex.host)
    log.info("KV cache: %d blocks x %d tokens%s, max_model_len %d", ready.num_kv_blocks, ready.block_size,
             f" in each of {dp} data-parallel engine cores" if dp > 1 else "", deployment.max_model_len)
    log.info("serving on http://%s:%d/v1", cfg.server.host, cfg.server.port)


async def _serve(deployment: Deployment, build_engine: BuildEngine,
                 make_segment: Optional[Callable[[int], ExpertGroupAddress]]) -> int:
    from appliance.models.loader import load_tokenizer
    from appliance.server.auth import load_api_keys, load_internal_key
    from appliance.server.app import create_app
    from appliance.server.client import EngineDeadError
    from appliance.server.data_parallel import DataParallelClient
    from appliance.server.harmony import HarmonyUnavailable, harmony_chat
    from appliance.server.metrics import Metrics
    from appliance.server.state import ServerState

    cfg = deployment.cfg
    # prepare (convert/generate) once, before the core starts
    tokenizer = load_tokenizer(cfg.model, cfg.quantization.method)
    try:
        harmony = harmony_chat(cfg, tokenizer)  # before the core starts, as the keys below
    except HarmonyUnavailable as e:
        print(f"appliance run: error: {e}", file=sys.stderr)
        return 1
    api_keys = load_api_keys(cfg.server)  # before the core starts: an unreadable key file stops nothing half-started
    internal_key = load_internal_key(cfg.server)
    dp = deployment.layout.data_parallel_size
    metrics = Metrics(deployment.model_name, cfg.profile, deployment.resolved.hash, deployment.fingerprint, dp)
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        state.shutting_down = True

    client = DataParallelClient(deployment, build_engine,
                                on_stats=lambda rank, old, new: metrics.on_core_stats(old, new, engine=rank),
                                on_restart=metrics.engine_restarted, on_fatal=on_fatal, make_segment=make_segment)
    try:
        await client.start()
    except EngineDeadError as e:
        print(f"appliance run: error: {e}", file=sys.stderr)
        await client.shutdown()
        return 1
    tokenize_pool = ThreadPoolExecutor(cfg.server.tokenizer_threads, thread_name_prefix="appliance-tokenize",
                                       initializer=_lower_priority)
    state = ServerState(deployment=deployment, client=client, tokenizer=tokenizer, metrics=metrics, api_keys=api_keys,
                        internal_key=internal_key, tracing=_tracing(deployment, metrics), tokenize_pool=tokenize_pool,
                        harmony=harmony)
    server = _uvicorn_server(cfg, create_app(state), state, Drain(state, cfg.server.shutdown_timeout_s), fatal)
    _log_start(deployment, client.ready_info)
    try:
        await server.serve()
    finally:
        state.shutting_down = True
        await client.shutdown(timeout_s=cfg.server.shutdown_timeout_s)
        tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if state.tracing is not None:
            state.tracing.shutdown()
    if fatal:
        log.error("exiting 1: the engine core could not be kept up: %s", fatal[0])
        return 1
    log.info("shut down cleanly")
    return 0
