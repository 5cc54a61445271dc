"""The engine core's step stats as Prometheus series and as the periodic log line."""

import logging

from appliance.engine.outputs import StepStats
from appliance.server.metrics import Metrics, describe_interval


def _stats(**kw):
    return StepStats(num_running=2, num_waiting=1, kv_usage=0.25, prefix_queries=100, prefix_hits=40, **kw)


def test_speculative_counters_are_exported_as_deltas():
    m = Metrics("m", "cpu", "c0ffee", "d00d")
    m.on_core_stats(StepStats(), _stats(spec_drafts=3, spec_draft_tokens=9, spec_accepted_tokens=5,
                                         spec_accepted_per_pos=[3, 2]))
    m.on_core_stats(_stats(spec_drafts=3, spec_draft_tokens=9, spec_accepted_tokens=5, spec_accepted_per_pos=[3, 2]),
                    _stats(spec_drafts=4, spec_draft_tokens=12, spec_accepted_tokens=8, spec_accepted_per_pos=[4, 3, 1]))
    labels = {"model_name": "m", "profile": "cpu", "config_hash": "c0ffee", "deployment": "d00d"}

    def value(name, **extra):
        return m.registry.get_sample_value(f"appliance:spec_decode_{name}_total", {**labels, "engine": "0", **extra})

    assert (value("num_drafts"), value("num_draft_tokens"), value("num_accepted_tokens")) == (4, 12, 8)
    assert [value("num_accepted_tokens_per_pos", position=str(i)) for i in range(3)] == [4, 3, 1]
    assert "appliance:spec_decode_num_drafts_total{" in m.render().decode()


def test_the_log_line_says_acceptance_over_the_interval(caplog, monkeypatch):
    old = _stats(spec_drafts=10, spec_draft_tokens=30, spec_accepted_tokens=12, spec_accepted_per_pos=[8, 4])
    new = _stats(spec_drafts=20, spec_draft_tokens=60, spec_accepted_tokens=30, spec_accepted_per_pos=[16, 10, 4])
    line = describe_interval(old, new)
    assert "running 2, waiting 1, KV cache 25.0%, prefix cache hit rate 0.0%" in line  # no new queries
    assert "acceptance rate 60.0% (18/30 draft tokens), mean acceptance length 2.80, per position [0.80, 0.60, 0.40]" \
        in line
    assert "spec decode" not in describe_interval(StepStats(), _stats())
    import appliance.server.metrics as metrics

    monkeypatch.setattr(metrics, "LOG_INTERVAL_S", 0.0)
    m = Metrics("m", "cpu", "c", "d")
    with caplog.at_level(logging.INFO, logger="appliance.stats"):
        m.on_core_stats(StepStats(), new)
    assert "mean acceptance length 2.50" in caplog.text


def test_each_engine_core_has_its_own_series():
    m = Metrics("m", "cpu", "c", "d", num_engines=2)
    labels = {"model_name": "m", "profile": "cpu", "config_hash": "c", "deployment": "d"}
    text = m.render().decode()
    for engine in ("0", "1"):  # exported from the start
        assert f'appliance:num_requests_running{{config_hash="c",deployment="d",engine="{engine}"' in text
    m.on_core_stats(StepStats(), _stats(), engine=1)
    m.engine_restarted(0)

    def value(name, engine):
        return m.registry.get_sample_value(f"appliance:{name}", {**labels, "engine": engine})

    assert (value("num_requests_running", "1"), value("num_requests_running", "0")) == (2, 0)
    assert (value("prefix_cache_queries_total", "1"), value("prefix_cache_queries_total", "0")) == (100, 0)
    assert (value("engine_restarts_total", "0"), value("engine_restarts_total", "1")) == (1, 0)


def test_request_series_are_by_the_engine_that_served():
    m = Metrics("m", "cpu", "c", "d", num_engines=2)
    labels = {"model_name": "m", "profile": "cpu", "config_hash": "c", "deployment": "d"}
    m.requests(1).time_to_first_token_seconds.observe(0.2)
    m.requests(1).request_success("stop")
    m.requests(0).request_success("error")

    def value(name, engine, **extra):
        return m.registry.get_sample_value(f"appliance:{name}", {**labels, "engine": engine, **extra})

    assert (value("time_to_first_token_seconds_count", "1"), value("time_to_first_token_seconds_count", "0")) == (1, 0)
    assert value("request_success_total", "1", finished_reason="stop") == 1
    assert value("request_success_total", "0", finished_reason="stop") == 0  # exported from the start
    assert value("request_success_total", "0", finished_reason="error") == 1
    assert m.requests(1) is m.requests(1)
