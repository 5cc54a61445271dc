"""`appliance route`: an OpenAI-compatible front over N appliance instances.

Requests (completions, chat, Messages, Responses, /tokenize; the HTTP app
is ``router_app``) go to one instance, chosen by ``router.policy``, and the
instance's answer (streamed or whole) comes back unchanged; a stored
response's reads and continuations go to the instance that holds it
(``find_stored``). The policies:

- ``round_robin``: the healthy instances in turn;
- ``least_load``: the fewest requests running plus waiting, read from each
  instance's ``/metrics`` every ``health_interval_s``, plus what this
  router has in flight to it;
- ``kv_aware``: the instance holding the longest cached prefix of the
  request's tokens, weighed against load: every instance's KV events
  (``kv_events=zmq``; ``router.kv_events`` in instance order) kept per
  instance (``router_events.PrefixIndex``) as its hash chain is, (parent
  block hash, the block's tokens) -> block hash, which a request's tokens
  (its prompt under the model's tokenizer and chat template) walk. When
  some instance holds at least ``kv_match_threshold`` of the prompt, the
  score is the matched tokens minus ``kv_load_weight`` tokens per request
  in flight there; otherwise (a new conversation, or one only a common
  system prompt matches) the request goes where the fewest blocks are
  cached, so new prefixes spread over the instances. Nothing needs the
  instances' hash function or cache salts: a tenant-salted chain simply
  does not match;
- ``pd`` (disaggregated prefill, 1P1D and beyond): the prompt is first
  prefilled on one of ``router.prefill_instances`` (producers,
  ``kv_transfer=p2p``) with ``max_tokens=1`` and ``kv_transfer_params:
  {"do_remote_decode": true}``, not streamed; the request then goes, with
  the ``kv_transfer_params`` the producer answered, to one of
  ``router.instances`` (consumers), which fetches the prompt's KV, runs its
  last token and decodes, streamed or whole as the client asked. Both sides
  are taken in turn. A request that cannot be split (several prompts or
  sequences, prompt logprobs) or whose prefill fails goes to a consumer
  whole, which computes the prompt itself. The router signs both requests
  with the deployment's internal key (``server.internal_key``), which is
  what makes producers and consumers act on ``kv_transfer_params``; the
  router drops a client's own under every policy.

Every instance's ``/health`` is polled every ``health_interval_s``; one
that fails it, or refuses a connection, gets no requests until it answers
again (a request that could not connect goes to another instance). The
router's ``/health`` is 200 while any instance is healthy; ``/metrics``
counts requests per instance and policy.

An instance that fails a request it accepted (its connection lost: it
died) leaves the rotation too; the client gets a 502 OpenAI error, or,
mid-stream, an error event and ``[DONE]`` as the instances' own failed
streams end (504 past ``request_timeout_s``), counted per instance by
``appliance_router_upstream_failures_total``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, AsyncIterator, Optional, cast

import httpx

from appliance.server.auth import SIGNATURE_HEADER, sign_request
from appliance.server.router_events import EventSubscriber, PrefixIndex, curve_client_keys
from appliance.server.tracing import TRACE_HEADERS, RequestSpan, Tracing

log = logging.getLogger("appliance.router")

POLICIES = ("round_robin", "least_load", "kv_aware", "pd")
FORWARDED_HEADERS = ("authorization", "x-api-key", "anthropic-version", "anthropic-beta", "x-request-id",
                     "x-data-parallel-rank", *TRACE_HEADERS)
PD_PATHS = ("/v1/completions", "/v1/chat/completions")  # what pd prefills on a producer (others: on the consumer)


@dataclass
class Instance:
    url: str
    healthy: bool = True
    in_flight: int = 0
    load: float = 0.0  # running + waiting, from its /metrics (least_load)
    requests: int = 0
    # requests it failed after accepting them (its connection lost or timed out): streams cut, whole responses lost
    failed_streams: int = 0
    failed_responses: int = 0
    index: PrefixIndex = field(default_factory=PrefixIndex)


def parse_load(metrics_text: str) -> float:
    """Requests running plus waiting in an instance's Prometheus text (summed over its engine cores)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(("appliance:num_requests_running", "appliance:num_requests_waiting")):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return total


class Router:
    """The instances, the policy's choice, and the proxying (no HTTP server: see ``build_app``)."""

    def __init__(self, instances: list[str], policy: str, tokenizer: Any = None, kv_events: Optional[list[str]] = None,
                 kv_load_weight: float = 256.0, health_interval_s: float = 2.0, request_timeout_s: float = 600.0,
                 kv_events_topic: str = "", kv_match_threshold: float = 0.5,
                 prefill_instances: Optional[list[str]] = None, kv_events_replay: Optional[list[str]] = None,
                 internal_key: Optional[bytes] = None, kv_events_curve: Optional[tuple[str, str]] = None,
                 harmony: Any = None):
        if policy not in POLICIES:
            raise ValueError(f"router.policy={policy} is not built; built: {', '.join(POLICIES)}")
        if not instances:
            raise ValueError("router.instances is empty: give the instances' base URLs")
        self.instances = [Instance(u.rstrip("/")) for u in instances]
        self.prefill = [Instance(u.rstrip("/")) for u in prefill_instances or ()]
        if (policy == "pd") != bool(self.prefill):
            raise ValueError("router.prefill_instances: the producers' base URLs, with router.policy=pd only")
        if policy == "pd" and internal_key is None:
            raise ValueError("router.policy=pd signs the requests it sends with kv_transfer_params: it needs the "
                             "deployment's internal key (APPLIANCE_INTERNAL_KEY, server.internal_key_file or "
                             "server.internal_key), the one its producers and consumers hold")
        self.internal_key = internal_key
        self._rr_prefill = itertools.count()
        self.policy, self.tokenizer, self.kv_load_weight = policy, tokenizer, kv_load_weight
        self.harmony = harmony  # a harmony model's chat format (server/harmony.py), as the instances render chats
        self.kv_match_threshold = kv_match_threshold
        self.health_interval_s, self.request_timeout_s = health_interval_s, request_timeout_s
        self._rr = itertools.count()
        self.subscribers: list[EventSubscriber] = []
        if policy == "kv_aware":
            if not kv_events or len(kv_events) != len(instances):
                raise ValueError("router.policy=kv_aware needs router.kv_events: each instance's KV events endpoint, "
                                 "in the order of router.instances")
            replays: list[Optional[str]] = list(kv_events_replay) if kv_events_replay else [None] * len(kv_events)
            if len(replays) != len(kv_events):
                raise ValueError("router.kv_events_replay: one replay endpoint per instance, in the order of "
                                 "router.instances")
            keys = None if kv_events_curve is None else curve_client_keys(*kv_events_curve)
            self.subscribers = [EventSubscriber(e, inst.index, kv_events_topic, r, keys)
                                for e, inst, r in zip(kv_events, self.instances, replays)]
        self.client: Optional[httpx.AsyncClient] = None  # made by start()
        self._poller: Optional[asyncio.Task] = None
        self.tracing: Optional[Tracing] = None  # server.otlp_traces_endpoint: a span per request, its context sent on
        self.trace_spans_dropped = 0

    # -- lifecycle ------------------------------------------------------------------
    @property
    def http(self) -> httpx.AsyncClient:
        """The client the router reaches its instances with (while started)."""
        assert self.client is not None, "the router is not started"
        return self.client

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout_s, connect=5.0))
        for s in self.subscribers:
            s.start()
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for s in self.subscribers:
            s.stop()
        if self.client is not None:
            await self.http.aclose()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        """Every instance's health (and load, for least_load), concurrently."""
        async def one(inst: Instance) -> None:
            try:
                r = await self.http.get(f"{inst.url}/health", timeout=5.0)
                healthy = r.status_code == 200
                if healthy and self.policy == "least_load":
                    m = await self.http.get(f"{inst.url}/metrics", timeout=5.0)
                    inst.load = parse_load(m.text)
            except httpx.HTTPError:
                healthy = False
            if healthy != inst.healthy:
                log.warning("instance %s is %s", inst.url, "healthy again" if healthy else "unhealthy")
            inst.healthy = healthy

        await asyncio.gather(*(one(i) for i in self.instances + self.prefill))

    # -- choosing -------------------------------------------------------------------
    def prompt_tokens(self, path: str, body: dict) -> list[int]:
        """The request's prompt tokens as an instance builds them (kv_aware)."""
        from appliance.server.prompts import chat_prompt
        from appliance.server.tool_requests import parse_tools

        if path.endswith("chat/completions"):
            tools = parse_tools(body)  # the model is told of them (and a bad request raises: the instance answers)
            return chat_prompt(cast(Any, SimpleNamespace(tokenizer=self.tokenizer, harmony=self.harmony)), body,
                               tools.tools if tools is not None else None)[0]
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], list):
            p = p[0]
        elif isinstance(p, list) and p and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            return self.tokenizer.encode(p)
        return [int(t) for t in p] if isinstance(p, list) else []

    def choose(self, tokens: Optional[list[int]] = None, exclude: frozenset = frozenset()) -> Optional[Instance]:
        live = [i for i in self.instances if i.healthy and i.url not in exclude]
        if not live:
            return None
        if self.policy == "least_load":
            return min(live, key=lambda i: (i.load + i.in_flight, i.requests))
        if self.policy == "kv_aware" and tokens:
            matched = {i.url: i.index.match(tokens) for i in live}
            if max(matched.values()) >= self.kv_match_threshold * len(tokens):
                return max(live, key=lambda i: (matched[i.url] - self.kv_load_weight * i.in_flight, -i.in_flight))
            return min(live, key=lambda i: (len(i.index), i.in_flight, i.requests))
        return live[next(self._rr) % len(live)]

    # -- proxying -----------------------------------------------------------------
    async def forward(self, path: str, body: dict, headers: dict) -> tuple[int, dict, Any]:
        """(status, headers, content): bytes, or an async iterator of bytes for a stream. Traced, the
        request's span is the parent of the instances' (its context replaces the caller's in what is sent)
        and ends with the answer (a stream's, with its last event)."""
        if self.tracing is None:
            return await self._forward(path, body, headers, None)
        span = self.tracing.start(f"POST {path}", headers, {"http.request.method": "POST", "http.route": path,
                                                            "appliance.router.policy": self.policy})
        headers = {**{k: v for k, v in headers.items() if k.lower() not in TRACE_HEADERS}, **span.headers()}
        try:
            status, out_headers, content = await self._forward(path, body, headers, span)
        except BaseException as e:
            span.end(500, type(e).__name__)
            raise
        if isinstance(content, (bytes, bytearray)):
            span.end(status)
            return status, out_headers, content
        return status, out_headers, _ending(content, span, status)

    async def _forward(self, path: str, body: dict, headers: dict,
                       span: Optional[RequestSpan]) -> tuple[int, dict, Any]:
        if "kv_transfer_params" in body:  # a client's: only the router says whose KV a consumer takes
            body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if self.policy == "pd" and path in PD_PATHS:
            body = await self._prefill_first(path, body, headers)
        pinned = None  # a Responses request goes on from a response stored on one instance: that instance
        if path == "/v1/responses" and isinstance(body.get("previous_response_id"), str):
            pinned = await self.find_stored(body["previous_response_id"], headers)
        tokens = None
        if self.policy == "kv_aware":
            try:
                tokens = await asyncio.to_thread(self.prompt_tokens, path, body)
            except Exception as e:  # a bad request: the instance answers it with the right error
                log.debug("no prompt tokens for routing: %s", e)
        tried: set[str] = set()
        while True:
            inst = pinned if pinned is not None and not tried else self.choose(tokens, frozenset(tried))
            if inst is None:
                return 503, {"content-type": "application/json"}, \
                    b'{"error": {"message": "no healthy instance", "type": "ServiceUnavailable", "code": 503}}'
            tried.add(inst.url)
            if span is not None:
                span.set_attribute("appliance.instance", inst.url)
            fwd = {k: v for k, v in headers.items() if k.lower() in FORWARDED_HEADERS}
            req = self.http.build_request("POST", f"{inst.url}{path}", **self._post(body, fwd))
            inst.in_flight += 1
            try:
                resp = await self.http.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                inst.in_flight -= 1
                inst.healthy = False
                log.warning("instance %s refused a request (%s); trying another", inst.url, e)
                continue
            except httpx.TransportError as e:  # it took the request, then failed before answering
                inst.in_flight -= 1
                inst.requests += 1
                return _upstream_failed(inst, e)
            except BaseException:
                inst.in_flight -= 1
                raise
            inst.requests += 1
            out_headers = {"content-type": resp.headers.get("content-type", "application/json")}
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                return resp.status_code, out_headers, self._relay(inst, resp)
            try:
                content = await resp.aread()
            except httpx.TransportError as e:
                return _upstream_failed(inst, e)
            finally:
                await resp.aclose()
                inst.in_flight -= 1
            return resp.status_code, out_headers, content

    async def find_stored(self, response_id: str, headers: dict) -> Optional[Instance]:
        """The healthy instance that stored ``response_id`` for the caller (its own key), or None."""
        for inst in [i for i in self.instances if i.healthy]:
            status, _, _ = await self._ask(inst, "GET", f"/v1/responses/{response_id}", headers)
            if status == 200:
                return inst
        return None

    async def stored(self, method: str, response_id: str, headers: dict) -> tuple[int, dict, bytes]:
        """GET or DELETE a stored response on the instance that holds it: the
        first healthy instance's answer that is not a 404 (else the last 404)."""
        answer = (404, {"content-type": "application/json"},
                  b'{"error": {"message": "no healthy instance", "type": "not_found_error", "code": 404}}')
        for inst in [i for i in self.instances if i.healthy]:
            answer = await self._ask(inst, method, f"/v1/responses/{response_id}", headers)
            if answer[0] != 404:
                break
        return answer

    async def _ask(self, inst: Instance, method: str, path: str, headers: dict) -> tuple[int, dict, bytes]:
        fwd = {k: v for k, v in headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            r = await self.http.request(method, f"{inst.url}{path}", headers=fwd)
        except httpx.TransportError as e:
            return _upstream_failed(inst, e)
        return r.status_code, {"content-type": r.headers.get("content-type", "application/json")}, r.content

    async def _prefill_first(self, path: str, body: dict, headers: dict) -> dict:
        """``pd``: the prompt's prefill on a producer; the body for a consumer
        (with the producer's ``kv_transfer_params``, or unchanged when the
        request cannot be split or no producer did the prefill)."""
        prompt = body.get("prompt")
        several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list)) and len(prompt) > 1
        echo_logprobs = body.get("echo") and body.get("logprobs") is not None  # the echoed prompt is scored
        if several or body.get("n") not in (None, 1) or body.get("prompt_logprobs") is not None or echo_logprobs:
            return body
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
        pre.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        fwd = {k: v for k, v in headers.items() if k.lower() in FORWARDED_HEADERS}
        tried: set[str] = set()
        while True:
            live = [i for i in self.prefill if i.healthy and i.url not in tried]
            if not live:
                log.warning("no producer could prefill; a consumer computes the prompt")
                return body
            start = next(self._rr_prefill) % len(live)
            inst = min(live[start:] + live[:start], key=lambda i: i.in_flight)  # in turn among the least busy
            tried.add(inst.url)
            inst.in_flight += 1
            try:
                resp = await self.http.post(f"{inst.url}{path}", **self._post(pre, fwd))
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                inst.healthy = False
                log.warning("producer %s refused a prefill (%s); trying another", inst.url, e)
                continue
            except httpx.HTTPError as e:
                log.warning("producer %s failed a prefill (%s); a consumer computes the prompt", inst.url, e)
                return body
            finally:
                inst.in_flight -= 1
            inst.requests += 1
            params = None
            if resp.status_code == 200:
                try:
                    params = resp.json().get("kv_transfer_params")
                except ValueError:
                    pass
            if isinstance(params, dict):
                return {**body, "kv_transfer_params": params}
            # a bad request is refused again, with the right error, by the consumer
            log.info("producer %s answered %d without KV; a consumer computes the prompt", inst.url, resp.status_code)
            return body

    def _post(self, body: dict, headers: dict) -> dict:
        """An instance request's body and headers: JSON, signed with the
        internal key when it carries ``kv_transfer_params`` (the router's own)."""
        content = json.dumps(body).encode()
        headers = {**headers, "content-type": "application/json"}
        if "kv_transfer_params" in body and self.internal_key is not None:
            headers[SIGNATURE_HEADER] = sign_request(self.internal_key, content)
        return {"content": content, "headers": headers}

    @staticmethod
    async def _relay(inst: Instance, resp: httpx.Response) -> AsyncIterator[bytes]:
        """The instance's stream, whole events only. When the instance fails
        mid-stream, what it left of an event is dropped and the stream ends as
        the server's own failed streams do: an error event, then [DONE]."""
        held = b""  # the start of an event not yet complete
        done = False  # the last event relayed was [DONE]
        try:
            async for chunk in resp.aiter_raw():
                held += chunk
                end = held.rfind(b"\n\n") + 2
                if end >= 2:
                    events, held = held[:end], held[end:]
                    done = events.endswith(b"data: [DONE]\n\n")
                    yield events
            if held:
                yield held
        except httpx.TransportError as e:
            if not done:  # else it failed after the end: nothing was lost
                _, _, error = _upstream_failed(inst, e, stream=True)
                yield b"data: " + error + b"\n\ndata: [DONE]\n\n"
        finally:
            await resp.aclose()
            inst.in_flight -= 1

    def metrics_text(self) -> str:
        lines = ["# TYPE appliance_router_requests counter"]
        every = self.instances + self.prefill
        for i in every:
            lines.append(f'appliance_router_requests_total{{instance="{i.url}",policy="{self.policy}"}} {i.requests}')
        lines.append("# TYPE appliance_router_instance_healthy gauge")
        for i in every:
            lines.append(f'appliance_router_instance_healthy{{instance="{i.url}"}} {int(i.healthy)}')
        lines.append("# TYPE appliance_router_in_flight gauge")
        for i in every:
            lines.append(f'appliance_router_in_flight{{instance="{i.url}"}} {i.in_flight}')
        if self.tracing is not None:
            lines.append("# TYPE appliance_router_trace_spans_dropped counter")
            lines.append(f"appliance_router_trace_spans_dropped_total {self.trace_spans_dropped}")
        lines.append("# TYPE appliance_router_upstream_failures counter")
        for i in every:
            for kind, n in (("stream", i.failed_streams), ("response", i.failed_responses)):
                lines.append(f'appliance_router_upstream_failures_total{{instance="{i.url}",kind="{kind}"}} {n}')
        return "\n".join(lines) + "\n"


async def _ending(stream: AsyncIterator[bytes], span: RequestSpan, status: int) -> AsyncIterator[bytes]:
    """``stream``, the span ended when it ends (or the client leaves it)."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        span.end(status)


def _upstream_failed(inst: Instance, e: httpx.TransportError, stream: bool = False) -> tuple[int, dict, bytes]:
    """A request ``inst`` accepted and then failed (its connection lost: 502,
    the instance taken out of the rotation until its /health answers; no
    answer within router.request_timeout_s: 504), counted, logged, and
    answered with an OpenAI error body that does not name the instance."""
    timeout = isinstance(e, httpx.TimeoutException)
    if stream:
        inst.failed_streams += 1
    else:
        inst.failed_responses += 1
    if not timeout:
        inst.healthy = False
    log.warning("instance %s failed a %s it had accepted (%s: %s)", inst.url, "stream" if stream else "request",
                type(e).__name__, e)
    status, kind, code = (504, "gateway_timeout", "upstream_timeout") if timeout else \
        (502, "bad_gateway", "upstream_failed")
    what = "did not answer in time" if timeout else "failed"
    message = f"the instance serving this request {what}; retry the request"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return status, {"content-type": "application/json"}, json.dumps(body).encode()
