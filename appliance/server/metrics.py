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

from appliance.engine.core import StepStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
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
    def __init__(self, model_name: str, profile: str, config_hash: str, deployment: str):
        self.registry = CollectorRegistry()
        labels = ["model_name", "profile", "config_hash", "deployment"]
        self.label_values = {"model_name": model_name, "profile": profile, "config_hash": config_hash,
                             "deployment": deployment}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"appliance:{name}", doc, labels, registry=r).labels(**self.label_values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"appliance:{name}", doc, labels, registry=r).labels(**self.label_values)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"appliance:{name}", doc, labels, buckets=buckets, registry=r).labels(**self.label_values)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        self.token_budget = gauge("token_budget", "Tokens the next engine step may schedule (follows "
                                                  "scheduler.target_itl_ms when set)")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (recompute)")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.engine_restarts = counter("engine_restarts", "Engine-core processes started to replace one that died")
        self._success = Counter("appliance:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):  # exported from the start, at 0
            self._success.labels(**self.label_values, finished_reason=reason)
        self.time_to_first_token_seconds = hist("time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.inter_token_latency_seconds = hist("inter_token_latency_seconds", "Time between tokens", LATENCY_BUCKETS)
        self.e2e_request_latency_seconds = hist("e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
        self.request_queue_time_seconds = hist("request_queue_time_seconds", "Time waiting before first scheduled",
                                               LATENCY_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens", "Tokens scheduled per engine step", TOKEN_BUCKETS)
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Speculative drafts verified")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self._accepted_per_pos = Counter("appliance:spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the draft (0 = first)",
                                         labels + ["position"], registry=r)
        self.grammar_compile_seconds = hist("grammar_compile_seconds", "Time to compile an output constraint's "
                                            "grammar (a compile-cache miss)", LATENCY_BUCKETS)
        self._logged_stats, self._logged_at = StepStats(), time.monotonic()

    def request_success(self, reason: str) -> None:
        self._success.labels(**self.label_values, finished_reason=reason).inc()

    def on_core_stats(self, old: StepStats, new: StepStats) -> None:
        self.num_requests_running.set(new.num_running)
        self.num_requests_waiting.set(new.num_waiting)
        self.kv_cache_usage_perc.set(new.kv_usage)
        self.token_budget.set(new.token_budget)
        self.prefix_cache_queries.inc(max(0, new.prefix_queries - old.prefix_queries))
        self.prefix_cache_hits.inc(max(0, new.prefix_hits - old.prefix_hits))
        self.num_preemptions.inc(max(0, new.num_preemptions - old.num_preemptions))
        if new.iteration_tokens:
            self.iteration_tokens.observe(new.iteration_tokens)
        self.spec_decode_num_drafts.inc(max(0, new.spec_drafts - old.spec_drafts))
        self.spec_decode_num_draft_tokens.inc(max(0, new.spec_draft_tokens - old.spec_draft_tokens))
        self.spec_decode_num_accepted_tokens.inc(max(0, new.spec_accepted_tokens - old.spec_accepted_tokens))
        for pos, accepted in enumerate(new.spec_accepted_per_pos):
            before = old.spec_accepted_per_pos[pos] if pos < len(old.spec_accepted_per_pos) else 0
            self._accepted_per_pos.labels(**self.label_values, position=str(pos)).inc(max(0, accepted - before))
        for seconds in new.grammar_compile_seconds:
            self.grammar_compile_seconds.observe(seconds)
        now = time.monotonic()
        if new.prefix_queries < self._logged_stats.prefix_queries or new.spec_drafts < self._logged_stats.spec_drafts:
            self._logged_stats = StepStats()  # the core's counters restarted (reset_stats, a new core)
        if now - self._logged_at >= LOG_INTERVAL_S:
            log.info("%s", describe_interval(self._logged_stats, new))
            self._logged_stats, self._logged_at = new, now

    def render(self) -> bytes:
        return generate_latest(self.registry)
