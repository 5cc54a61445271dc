"""OpenTelemetry traces (server.otlp_traces_endpoint), end to end: a real
server and router export to an OTLP/HTTP receiver on loopback that this
test runs (protobuf decoded with OpenTelemetry's own message types); and
the export path's bounds without a network."""

import http.server
import threading
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk.trace", reason="the tracing extra is not installed")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

from appliance.config.compose import resolve  # noqa: E402
from appliance.errors import ConfigError  # noqa: E402
from appliance.server.local import LocalServer  # noqa: E402
from appliance.server.trace_export import BoundedExport  # noqa: E402
from appliance.server.tracing import EngineRequestTiming, Tracing, traces_url  # noqa: E402
from tests.integration.server_helpers import REPO, ServerProcess, metric  # noqa: E402

TINY = ["model=tiny_random", "cache.kv_cache_memory_gib=0.05"]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: every span posted to /v1/traces, decoded."""

    def __init__(self):
        self.spans, self.paths = [], []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.paths.append(self.path)
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            receiver.spans.append({
                                "name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(), "kind": s.kind, "status": s.status.code,
                                "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                "attrs": {a.key: _value(a.value) for a in s.attributes},
                                "events": [(e.name, e.time_unix_nano) for e in s.events], "resource": resource})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def wait(self, pred, timeout=20.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            found = [s for s in list(self.spans) if pred(s)]
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"no such span among {[(s['name'], s['trace_id']) for s in self.spans]}")


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.shutdown()


@pytest.fixture(scope="module")
def traced(receiver):
    """A server exporting to the receiver (its base URL: /v1/traces implied), and a router in front of it."""
    server = ServerProcess(*TINY, f"server.otlp_traces_endpoint={receiver.url}")
    try:
        router = LocalServer(["+profile=cpu", *TINY, f"router.instances=[{server.url}]",
                              f"server.otlp_traces_endpoint={receiver.url}/v1/traces"], timeout_s=120, cwd=REPO,
                             verb="route")
    except BaseException:
        server.stop()
        raise
    yield server, router
    router.stop()
    server.stop()


def _chat(url, headers=None, **extra):
    body = {"model": "tiny-random-llama", "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers or {}, timeout=120)


def test_a_request_continues_the_callers_trace_with_the_engine_timings(traced, receiver):
    server, _ = traced
    r = _chat(server.url, {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"}, n=2)
    assert r.status_code == 200, r.text
    [root] = receiver.wait(lambda s: s["trace_id"] == TRACE_ID and s["name"] == "POST /v1/chat/completions")
    assert root["parent"] == CALLER_SPAN and root["kind"] == 2  # SPAN_KIND_SERVER
    assert root["attrs"]["http.response.status_code"] == 200
    assert root["attrs"]["appliance.request_id"] == r.json()["id"]
    deployment = httpx.get(f"{server.url}/version").json()["deployment"]
    assert root["attrs"]["appliance.deployment"] == deployment
    assert root["resource"]["service.name"] == "appliance" and root["resource"]["appliance.deployment"] == deployment
    receiver.wait(lambda s: len([c for c in receiver.spans if c["parent"] == root["span_id"]]) == 2)
    children = [c for c in receiver.spans if c["parent"] == root["span_id"]]
    assert {c["name"] for c in children} == {"llm_request"}
    assert len({c["attrs"]["gen_ai.request.id"] for c in children}) == 2
    usage = r.json()["usage"]
    for c in children:
        a = c["attrs"]
        assert c["trace_id"] == TRACE_ID
        assert a["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
        assert a["gen_ai.usage.completion_tokens"] == 4 and a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.n"] == 2
        assert "gen_ai.usage.cached_tokens" in a and a["gen_ai.response.model"] == "tiny-random-llama"
        assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] \
            <= a["gen_ai.latency.e2e"]
        names = [n for n, _ in c["events"]]
        assert names == ["queued", "scheduled", "first_token", "finished"]
        times = [t for _, t in c["events"]]
        assert times == sorted(times) and c["start"] == times[0] and c["end"] == times[-1]
        assert root["start"] <= c["start"] and c["end"] <= root["end"]


def test_a_malformed_traceparent_starts_a_new_trace(traced, receiver):
    server, _ = traced
    r = _chat(server.url, {"traceparent": "00-not-a-trace-01"}, user="malformed")
    assert r.status_code == 200
    rid = r.json()["id"]
    [root] = receiver.wait(lambda s: s["attrs"].get("appliance.request_id") == rid)
    assert root["parent"] == "" and len(root["trace_id"]) == 32 and root["trace_id"] != TRACE_ID


def test_a_refused_request_ends_its_span_with_the_status(traced, receiver):
    server, _ = traced
    trace = "1" * 32
    r = _chat(server.url, {"traceparent": f"00-{trace}-{CALLER_SPAN}-01"}, temperature=-1)
    assert r.status_code == 400
    [root] = receiver.wait(lambda s: s["trace_id"] == trace)
    assert root["attrs"]["http.response.status_code"] == 400 and root["attrs"]["error.type"] == "400"
    assert "temperature" in root["attrs"]["appliance.error"]
    assert root["status"] == 0  # unset: a client error is not the server's (OpenTelemetry's HTTP conventions)


def test_the_router_s_span_sits_between_the_caller_and_the_instance(traced, receiver):
    server, router = traced
    trace = "2" * 32
    for stream in (False, True):
        r = _chat(router.url, {"traceparent": f"00-{trace}-{CALLER_SPAN}-01"}, stream=stream)
        assert r.status_code == 200
    def hops():
        return [x for x in receiver.spans if x["trace_id"] == trace and x["resource"]["service.name"] ==
                "appliance-router"]

    receiver.wait(lambda s: len(hops()) == 2)
    routed = hops()
    for hop in routed:
        assert hop["parent"] == CALLER_SPAN and hop["attrs"]["appliance.instance"] == server.url
        [served] = receiver.wait(lambda s, hop=hop: s["parent"] == hop["span_id"])
        assert served["name"] == "POST /v1/chat/completions" and served["resource"]["service.name"] == "appliance"
        assert hop["start"] <= served["start"] and served["end"] <= hop["end"] + 50_000_000  # clocks of one host
    assert set(receiver.paths) == {"/v1/traces"}


def test_a_collector_that_went_away_costs_spans_not_requests(traced, receiver):
    """Last in this module: the receiver stops answering."""
    server, _ = traced
    before = metric(httpx.get(f"{server.url}/metrics").text, "appliance:trace_spans_dropped_total")
    receiver.shutdown()
    receiver.server_close()
    t0 = time.time()
    for _ in range(3):
        assert _chat(server.url).status_code == 200
    assert time.time() - t0 < 30
    deadline = time.time() + 30
    while time.time() < deadline:
        dropped = metric(httpx.get(f"{server.url}/metrics").text, "appliance:trace_spans_dropped_total")
        if dropped >= before + 6:  # each request: its span and its engine request's
            break
        time.sleep(0.5)
    assert dropped >= before + 6


# -- without a network ----------------------------------------------------------------
class SlowExporter:
    def __init__(self, result):
        self.result, self.batches, self.release = result, [], threading.Event()

    def export(self, batch):
        self.release.wait(10)
        self.batches.append(len(batch))
        return self.result

    def shutdown(self):
        pass


def _spans(tracing, n):
    """``n`` aborted requests' spans (each with its engine request's): how long making them took."""
    from appliance.sampling_params import SamplingParams

    t0 = time.perf_counter()
    for i in range(n):
        span = tracing.start("POST /v1/completions", {})
        timing = EngineRequestTiming(f"r{i}", engine=0, sent=time.monotonic(), queue_time=0.001, prompt_tokens=3,
                                     error="aborted")
        span.engine_request(timing, "m", SamplingParams(max_tokens=1))
        span.end(499, "the client went away")
    return time.perf_counter() - t0


def test_a_full_export_queue_drops_and_counts_without_waiting():
    from opentelemetry.sdk.trace.export import SpanExportResult

    dropped = []
    exporter = SlowExporter(SpanExportResult.SUCCESS)
    tracing = Tracing("http://127.0.0.1:9", {"appliance.deployment": "x"}, dropped.append, exporter=exporter,
                      max_queue=4)
    elapsed = _spans(tracing, 10)  # 20 spans; the exporter is stuck on its first batch
    assert elapsed < 1.0
    assert sum(dropped) >= 20 - 4 - 4  # at most a queue full waiting and one taken for export
    exporter.release.set()
    assert tracing.processor.force_flush(5000)
    assert tracing.processor.exported + sum(dropped) == 20
    tracing.shutdown()


def test_failed_exports_are_dropped_and_counted():
    from opentelemetry.sdk.trace.export import SpanExportResult

    dropped = []
    exporter = SlowExporter(SpanExportResult.FAILURE)
    exporter.release.set()
    proc = BoundedExport(exporter, dropped.append, max_queue=16, interval_s=0.05)

    class Span:
        class context:
            class trace_flags:
                sampled = True

    for _ in range(3):
        proc.on_end(Span())
    assert proc.force_flush(5000)
    assert sum(dropped) == 3 and proc.exported == 0
    proc.shutdown()


def test_the_key_is_checked_at_validation(monkeypatch):
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    resolve(["+profile=cpu", "server.otlp_traces_endpoint=http://127.0.0.1:4318"])
    with pytest.raises(ConfigError, match="must be an OTLP/HTTP URL"):
        resolve(["+profile=cpu", "server.otlp_traces_endpoint=grpc://127.0.0.1:4317"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("opentelemetry") else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs OpenTelemetry, which is not installed .*appliance\[tracing\]"):
        resolve(["+profile=cpu", "server.otlp_traces_endpoint=http://127.0.0.1:4318"])


def test_an_untraced_router_passes_the_callers_trace_on():
    import asyncio

    from appliance.server.router import Router

    seen = []

    class Echo(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append({k.lower(): v for k, v in self.headers.items()})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    echo = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=echo.serve_forever, daemon=True).start()
    router = Router([f"http://127.0.0.1:{echo.server_address[1]}"], "round_robin")
    parent = f"00-{TRACE_ID}-{CALLER_SPAN}-01"

    async def send():
        router.client = httpx.AsyncClient()
        try:
            return await router.forward("/v1/completions", {"prompt": "x"},
                                        {"traceparent": parent, "tracestate": "vendor=1", "cookie": "secret"})
        finally:
            await router.client.aclose()

    try:
        status, _, _ = asyncio.run(send())
    finally:
        echo.shutdown()
    assert status == 200
    assert seen[0]["traceparent"] == parent and seen[0]["tracestate"] == "vendor=1" and "cookie" not in seen[0]


def test_a_span_that_cannot_be_recorded_never_fails_the_request():
    from appliance.server.tracing import RequestSpan

    class Broken:
        def set_attribute(self, *a):
            raise RuntimeError("exporter state lost")

    span = RequestSpan(tracing=None, span=Broken())
    span.end(200)  # logged, not raised
    span.engine_request(EngineRequestTiming("r", engine=0, sent=time.monotonic()), "m", None)
