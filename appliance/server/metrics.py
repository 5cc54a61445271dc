"""Prometheus metrics under the ``appliance:`` prefix, with the names vLLM
users' dashboards know. Every series carries ``model_name``, ``profile``,
``config_hash`` (the declarative config) and ``deployment`` (the config as
resolved on this machine: dtype, KV dtype, backend, host).

Only the front-end process exports: the engine core reports its counters
and gauges with every output batch, so there is one registry and no
multi-process aggregation to get wrong. The same stats give a log line
every ``LOG_INTERVAL_S`` while the engine works (``describe_interval``).
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from appliance.engine.outputs import StepStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
EPLB_RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LOG_INTERVAL_S = 10.0

log = logging.getLogger("appliance.stats")


def spec_summary(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> str:
    """Acceptance over some steps of speculative decoding, in words ('' without drafts)."""
    if not drafts:
        return ""
    per = ", ".join(f"{a / drafts:.2f}" for a in per_pos)
    return (f"spec decode: acceptance rate {accepted / max(1, draft_tokens):.1%} ({accepted}/{draft_tokens} draft "
            f"tokens), mean acceptance length {1 + accepted / drafts:.2f}, per position [{per}]")


def describe_interval(old: StepStats, new: StepStats) -> str:
    """The engine between two stats: load, KV, prefix hits, speculative acceptance."""
    queries = new.prefix_queries - old.prefix_queries
    hits = new.prefix_hits - old.prefix_hits
    per_pos = [a - (old.spec_accepted_per_pos[i] if i < len(old.spec_accepted_per_pos) else 0)
               for i, a in enumerate(new.spec_accepted_per_pos)]
    spec = spec_summary(new.spec_drafts - old.spec_drafts, new.spec_draft_tokens - old.spec_draft_tokens,
                        new.spec_accepted_tokens - old.spec_accepted_tokens, per_pos)
    return (f"running {new.num_running}, waiting {new.num_waiting}, KV cache {new.kv_usage:.1%}, prefix cache hit "
            f"rate {hits / queries if queries else 0:.1%}, preemptions {new.num_preemptions - old.num_preemptions}"
            + (f"; {spec}" if spec else ""))


class Metrics:
    """The registry. Series carry an ``engine`` label (the data-parallel
    rank, "0" with one core), as vLLM's do: what each engine core reports,
    and the request latencies and outcomes the front end measures, by the
    core that served the request (``requests(engine)``); prompt tokens are
    counted per request, before a core is picked."""

    def __init__(self, model_name: str, profile: str, config_hash: str, deployment: str, num_engines: int = 1):
        self.registry = CollectorRegistry()
        labels = ["model_name", "profile", "config_hash", "deployment"]
        self.label_values = {"model_name": model_name, "profile": profile, "config_hash": config_hash,
                             "deployment": deployment}
        r = self.registry
        per_engine = labels + ["engine"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"appliance:{name}", doc, per_engine, registry=r)

        def counter(name: str, doc: str, by_engine: bool = True) -> Counter:
            c = Counter(f"appliance:{name}", doc, per_engine if by_engine else labels, registry=r)
            return c if by_engine else c.labels(**self.label_values)

        def hist(name: str, doc: str, buckets: tuple[float, ...], by_engine: bool = False) -> Histogram:
            h = Histogram(f"appliance:{name}", doc, per_engine if by_engine else labels, buckets=buckets, registry=r)
            return h if by_engine else h.labels(**self.label_values)

        # engine-core series: families, one child per engine (``_engine``)
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        self.token_budget = gauge("token_budget", "Tokens the next engine step may schedule (follows "
                                                  "scheduler.target_itl_ms or max_itl_ratio when set)")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (recompute)")
        self.engine_restarts = counter("engine_restarts", "Engine-core processes started to replace one that died")
        self.kv_offload_corrupt_blocks = counter("kv_offload_corrupt_blocks", "KV offload tier files that failed "
                                                 "their checks on load (damaged, another block's, model's or KV "
                                                 "layout's, an older format): removed, their blocks recomputed")
        self.iteration_tokens = hist("iteration_tokens", "Tokens scheduled per engine step", TOKEN_BUCKETS, True)
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Speculative drafts verified")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self._accepted_per_pos = Counter("appliance:spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the draft (0 = first)",
                                         per_engine + ["position"], registry=r)
        self.grammar_compile_seconds = hist("grammar_compile_seconds", "Time to compile an output constraint's "
                                            "grammar (a compile-cache miss)", LATENCY_BUCKETS, True)
        # expert-parallel load balancing (parallel.eplb)
        self.eplb_balancedness = gauge("eplb_balancedness", "Mean over max of the expert-parallel ranks' expert "
                                                            "loads in the load balancer's window (1: even)")
        self.eplb_rebalances = counter("eplb_rebalances", "Expert placements recomputed and weights moved")
        self.eplb_rebalance_seconds = counter("eplb_rebalance_seconds", "Time spent placing experts and moving "
                                                                        "their weights between ranks")
        self._expert_load = Gauge("appliance:expert_load", "Tokens routed to each logical expert in the load "
                                  "balancer's window, over all sparse layers", per_engine + ["expert"], registry=r)
        self.eplb_slot_load_ratio = hist("eplb_slot_load_ratio", "Each expert slot's load over the mean slot load "
                                         "of its layer, when a rebalance reads the window", EPLB_RATIO_BUCKETS, True)
        # what the front end measures of each request, by the engine core that served it
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed", by_engine=False)
        self.trace_spans_dropped = counter("trace_spans_dropped", "Trace spans not exported (server.otlp_traces_"
                                           "endpoint): the export queue was full or the collector failed",
                                           by_engine=False)
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self._success = Counter("appliance:request_success", "Finished requests by finish reason",
                                per_engine + ["finished_reason"], registry=r)
        self.time_to_first_token_seconds = hist("time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS,
                                                True)
        self.inter_token_latency_seconds = hist("inter_token_latency_seconds", "Time between tokens", LATENCY_BUCKETS,
                                                True)
        self.e2e_request_latency_seconds = hist("e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS,
                                                True)
        self.request_queue_time_seconds = hist("request_queue_time_seconds", "Time waiting before first scheduled",
                                               LATENCY_BUCKETS, True)
        self.num_engines = num_engines
        self._requests: dict[int, RequestSeries] = {}
        self._logged: dict[int, tuple[StepStats, float]] = {}  # engine -> (stats last logged, when)
        for engine in range(num_engines):  # every engine's series exported from the start, at 0
            for family in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc,
                           self.token_budget, self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions,
                           self.engine_restarts, self.kv_offload_corrupt_blocks, self.iteration_tokens,
                           self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens,
                           self.spec_decode_num_accepted_tokens):
                self._engine(family, engine)
            self.requests(engine)

    def _engine(self, family, engine: int):
        return family.labels(**self.label_values, engine=str(engine))

    def requests(self, engine: int = 0) -> "RequestSeries":
        """The request series of engine core ``engine``."""
        series = self._requests.get(engine)
        if series is None:
            series = self._requests[engine] = RequestSeries(self, engine)
        return series

    def engine_restarted(self, engine: int = 0) -> None:
        self._engine(self.engine_restarts, engine).inc()

    def on_core_stats(self, old: StepStats, new: StepStats, engine: int = 0) -> None:
        """Engine ``engine``'s stats went from ``old`` to ``new``: gauges set, counters by the difference."""
        def e(family):
            return self._engine(family, engine)

        e(self.num_requests_running).set(new.num_running)
        e(self.num_requests_waiting).set(new.num_waiting)
        e(self.kv_cache_usage_perc).set(new.kv_usage)
        e(self.token_budget).set(new.token_budget)
        e(self.prefix_cache_queries).inc(max(0, new.prefix_queries - old.prefix_queries))
        e(self.prefix_cache_hits).inc(max(0, new.prefix_hits - old.prefix_hits))
        e(self.num_preemptions).inc(max(0, new.num_preemptions - old.num_preemptions))
        e(self.kv_offload_corrupt_blocks).inc(max(0, new.kv_offload_corrupt_blocks - old.kv_offload_corrupt_blocks))
        if new.iteration_tokens:
            e(self.iteration_tokens).observe(new.iteration_tokens)
        e(self.spec_decode_num_drafts).inc(max(0, new.spec_drafts - old.spec_drafts))
        e(self.spec_decode_num_draft_tokens).inc(max(0, new.spec_draft_tokens - old.spec_draft_tokens))
        e(self.spec_decode_num_accepted_tokens).inc(max(0, new.spec_accepted_tokens - old.spec_accepted_tokens))
        for pos, accepted in enumerate(new.spec_accepted_per_pos):
            before = old.spec_accepted_per_pos[pos] if pos < len(old.spec_accepted_per_pos) else 0
            self._accepted_per_pos.labels(**self.label_values, engine=str(engine), position=str(pos)).inc(
                max(0, accepted - before))
        for seconds in new.grammar_compile_seconds:
            e(self.grammar_compile_seconds).observe(seconds)
        if new.expert_load:
            e(self.eplb_balancedness).set(new.eplb_balancedness)
            e(self.eplb_rebalances).inc(max(0, new.eplb_rebalances - old.eplb_rebalances))
            e(self.eplb_rebalance_seconds).inc(max(0.0, new.eplb_rebalance_seconds - old.eplb_rebalance_seconds))
            for expert, tokens in enumerate(new.expert_load):
                self._expert_load.labels(**self.label_values, engine=str(engine), expert=str(expert)).set(tokens)
            for ratio in new.eplb_slot_load_ratios:
                e(self.eplb_slot_load_ratio).observe(ratio)
        now = time.monotonic()
        logged, at = self._logged.get(engine) or (StepStats(), now)
        if new.prefix_queries < logged.prefix_queries or new.spec_drafts < logged.spec_drafts:
            logged = StepStats()  # the core's counters restarted (reset_stats, a new core)
        if now - at >= LOG_INTERVAL_S:
            log.info("%s%s", f"engine {engine}: " if self.num_engines > 1 else "", describe_interval(logged, new))
            logged, at = new, now
        self._logged[engine] = (logged, at)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestSeries:
    """One engine core's request series, bound (what a generation records)."""

    def __init__(self, m: Metrics, engine: int):
        def bound(family):
            return m._engine(family, engine)

        self.time_to_first_token_seconds = bound(m.time_to_first_token_seconds)
        self.inter_token_latency_seconds = bound(m.inter_token_latency_seconds)
        self.e2e_request_latency_seconds = bound(m.e2e_request_latency_seconds)
        self.request_queue_time_seconds = bound(m.request_queue_time_seconds)
        self.generation_tokens = bound(m.generation_tokens)
        self._success = {reason: m._success.labels(**m.label_values, engine=str(engine), finished_reason=reason)
                         for reason in ("stop", "length", "abort")}  # exported from the start, at 0
        self._family, self._labels = m._success, {**m.label_values, "engine": str(engine)}

    def request_success(self, reason: str) -> None:
        child = self._success.get(reason)
        if child is None:
            child = self._success[reason] = self._family.labels(**self._labels, finished_reason=reason)
        child.inc()
