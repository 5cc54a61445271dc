"""OpenTelemetry traces of every request (``server.otlp_traces_endpoint``).

The front end opens a SERVER span per HTTP request (named after its route),
continuing the caller's W3C ``traceparent``/``tracestate`` (a malformed one
starts a new trace, as the W3C spec says); each engine request under it
(prompts x ``n``) is an ``llm_request`` child span carrying the engine
core's timings: events ``queued`` (sent to the core), ``scheduled`` (first
scheduled, from the core's queue time), ``first_token`` and its end when it
finished, with vLLM's ``gen_ai.*`` attributes (request id, model, sampling,
prompt, cached and completion tokens, finish reason, queue time, TTFT, e2e)
and the deployment fingerprint. ``appliance route`` opens a span of its own
when its config sets the key and sends its context on to the instance it
picks (the caller's unchanged otherwise).

Export is OTLP/HTTP (protobuf) through the official SDK and exporter
(``pip install 'appliance[tracing]'``), from a background thread draining a
bounded queue: a slow or unreachable collector never slows or fails a
request; spans that find the queue full or fail to export are dropped and
counted (``appliance:trace_spans_dropped_total``).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

log = logging.getLogger("appliance.tracing")

TRACE_HEADERS = ("traceparent", "tracestate")
MAX_QUEUE_SPANS = 4096  # spans waiting for export; more are dropped and counted
EXPORT_TIMEOUT_S = 5.0  # one export request, its retries included


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: ``endpoint`` as given, ``/v1/traces`` added to one without a path
    (what ``OTEL_EXPORTER_OTLP_ENDPOINT`` means)."""
    from urllib.parse import urlsplit

    return endpoint if urlsplit(endpoint).path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


@dataclass
class EngineRequestTiming:
    """What the front end saw of one engine request, on the monotonic clock (``time.monotonic``)."""

    request_id: str
    engine: int
    sent: float  # handed to the engine core
    queue_time: Optional[float] = None  # the core's: waiting before first scheduled
    first_token: Optional[float] = None
    end: Optional[float] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: Optional[str] = None  # None: it did not finish (aborted, failed, cut)
    error: Optional[str] = None


class Tracing:
    """The deployment's tracer: builds spans, exports them in the background (to ``endpoint`` over
    OTLP/HTTP, or through ``exporter``, any OpenTelemetry span exporter)."""

    def __init__(self, endpoint: str, attributes: Mapping[str, Any], dropped: Callable[[int], None],
                 service_name: str = "appliance", exporter: Any = None, max_queue: int = MAX_QUEUE_SPANS):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from appliance.server.trace_export import BoundedExport

        self.attributes = dict(attributes)
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name),
                                    **self.attributes})
        if exporter is None:
            exporter = OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=EXPORT_TIMEOUT_S)
        self.processor = BoundedExport(exporter, dropped, max_queue=max_queue)
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("appliance")
        self.propagator = TraceContextTextMapPropagator()

    def start(self, name: str, headers: Mapping[str, str], attributes: Optional[Mapping[str, Any]] = None,
              kind: str = "SERVER") -> "RequestSpan":
        """A span continuing the caller's trace (its ``traceparent``), or starting one."""
        from opentelemetry.trace import SpanKind

        carrier = {h: headers[h] for h in TRACE_HEADERS if headers.get(h)}
        span = self.tracer.start_span(name, context=self.propagator.extract(carrier), kind=getattr(SpanKind, kind),
                                      attributes={**self.attributes, **(attributes or {})})
        return RequestSpan(self, span)

    def shutdown(self) -> None:
        self.provider.shutdown()


def _never_raises(method: Callable[..., None]) -> Callable[..., None]:
    """Tracing a request never fails it: a failure to record a span is logged (once a kind) and forgotten."""
    seen: set[str] = set()

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            method(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ not in seen:
                seen.add(type(e).__name__)
                log.warning("could not record a trace span (%s: %s); the request goes on", type(e).__name__, e)

    return guarded


def _wall_ns(mono: float, mono_now: float, wall_now_ns: int) -> int:
    return wall_now_ns - int((mono_now - mono) * 1e9)


class RequestSpan:
    """One request's span: its engine requests' child spans, its context for a hop further, its end (once)."""

    def __init__(self, tracing: Tracing, span: Any):
        self.tracing, self.span = tracing, span
        self.ended = False

    def set_attribute(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    def headers(self) -> dict[str, str]:
        """``traceparent``/``tracestate`` naming this span: what a hop further continues."""
        from opentelemetry.trace import set_span_in_context

        out: dict[str, str] = {}
        self.tracing.propagator.inject(out, context=set_span_in_context(self.span))
        return out

    @_never_raises
    def engine_request(self, t: EngineRequestTiming, model: str, params: Any) -> None:
        """The ``llm_request`` child span of one engine request, from what the front end timed."""
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        mono_now, wall_now = time.monotonic(), time.time_ns()
        at = lambda m: _wall_ns(m, mono_now, wall_now)  # noqa: E731
        end = t.end if t.end is not None else mono_now
        attrs: dict[str, Any] = {
            "gen_ai.request.id": t.request_id, "gen_ai.response.model": model,
            "gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p, "gen_ai.request.n": params.n,
            "gen_ai.usage.prompt_tokens": t.prompt_tokens, "gen_ai.usage.completion_tokens": t.output_tokens,
            "gen_ai.usage.cached_tokens": t.cached_tokens, "gen_ai.latency.e2e": end - t.sent,
            "appliance.engine": t.engine,
        }
        if t.finish_reason is not None:
            attrs["gen_ai.response.finish_reasons"] = [t.finish_reason]
        if t.queue_time is not None:
            attrs["gen_ai.latency.time_in_queue"] = t.queue_time
        if t.first_token is not None:
            attrs["gen_ai.latency.time_to_first_token"] = t.first_token - t.sent
        span = self.tracing.tracer.start_span("llm_request", context=set_span_in_context(self.span),
                                              start_time=at(t.sent),
                                              attributes={k: v for k, v in attrs.items() if v is not None})
        span.add_event("queued", timestamp=at(t.sent))
        if t.queue_time is not None:
            span.add_event("scheduled", timestamp=at(t.sent + t.queue_time))
        if t.first_token is not None:
            span.add_event("first_token", timestamp=at(t.first_token))
        if t.finish_reason is not None:
            span.add_event("finished", {"finish_reason": t.finish_reason}, timestamp=at(end))
        if t.error is not None:
            span.set_status(Status(StatusCode.ERROR, t.error))
        span.end(end_time=at(end))

    @_never_raises
    def end(self, status_code: int = 200, error: Optional[str] = None) -> None:
        if self.ended:
            return
        from opentelemetry.trace import Status, StatusCode

        self.ended = True
        self.span.set_attribute("http.response.status_code", status_code)
        if status_code >= 400:  # a server span's status is an error only for 5xx (OpenTelemetry's HTTP conventions)
            self.span.set_attribute("error.type", str(status_code))
            if error is not None:
                self.span.set_attribute("appliance.error", error)
        if status_code >= 500:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()
