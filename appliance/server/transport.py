"""Connection guards around uvicorn's h11 protocol.

uvicorn closes idle kept-alive connections (``timeout_keep_alive``) but
waits for a request head or body as long as the client likes, so one slow
client per connection (slowloris) holds a connection and a task forever.
``guarded_protocol`` adds, per connection:

- a head deadline: the request head must be complete within
  ``server.header_timeout_s`` of the connection opening (or of the first
  byte of the next request on a kept-alive connection);
- a body deadline: the body must be complete within
  ``server.body_timeout_s`` of the head, however it trickles in;
- past either, a 408 (OpenAI-shaped) and the connection closes; a handler
  waiting on the body sees a disconnect;
- at most ``server.max_connections`` open connections and running requests:
  beyond that a 503 with Retry-After (uvicorn's ``limit_concurrency`` check,
  answered in the API's error shape; ``/health``, ``/ready`` and ``/metrics``
  are always answered);
- while the server drains, every response carries ``Connection: close`` so
  clients and load balancers reconnect elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, MutableMapping, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from appliance.server.protocol import OpenAIError

log = logging.getLogger("appliance.server")

PROBES = frozenset({"/health", "/ready", "/metrics"})

# ASGI's callables (the messages are dicts by the ASGI spec)
Message = MutableMapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    draining: Callable[[], bool]  # true once the server stops admitting work


def _raw_response(e: OpenAIError) -> bytes:
    """A complete HTTP/1.1 response that closes the connection (written past h11's state machine)."""
    body = json.dumps(e.body()).encode()
    reason = {408: b"Request Timeout", 503: b"Service Unavailable"}.get(e.status, b"")
    head = [b"HTTP/1.1 %d %s" % (e.status, reason), b"content-type: application/json",
            b"content-length: %d" % len(body), b"connection: close"]
    head += [f"{k}: {v}".encode("latin-1") for k, v in e.headers.items()]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def _respond(send: Send, e: OpenAIError) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _closing(send: Send) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await send(message)

    return wrapped


class GuardedH11Protocol(H11Protocol):
    limits: ConnectionLimits  # set on the subclass guarded_protocol() makes

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._inner_app = self.app
        self.app = self._guarded_app
        self.limit_concurrency = None  # enforced by _guarded_app
        self._timer: Optional[asyncio.TimerHandle] = None
        self._phase: Optional[str] = None  # "head" or "body" while a deadline runs

    # -- deadlines -------------------------------------------------------------
    def _arm(self, phase: str) -> None:
        self._disarm()
        self._phase = phase
        delay = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
        self._timer = self.loop.call_later(delay, self._expired, phase)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, None

    def _track(self) -> None:
        """Arm or drop the deadline for where the client is in its request."""
        if self.transport.is_closing():
            self._disarm()
            return
        their = self.conn.their_state
        if their is h11.IDLE:
            # a partial head (bytes buffered); an idle connection is the keep-alive timer's
            if self._phase != "head" and self.conn.trailing_data[0]:
                self._arm("head")
        elif their is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body")
        else:
            self._disarm()

    def _expired(self, phase: str) -> None:
        self._timer, self._phase = None, None
        if self.transport.is_closing():
            return
        if phase == "head":
            e = OpenAIError(408, f"the request head did not arrive within server.header_timeout_s="
                                 f"{self.limits.header_timeout_s:g} s", code="header_timeout")
        else:
            e = OpenAIError(408, f"the request body did not arrive within server.body_timeout_s="
                                 f"{self.limits.body_timeout_s:g} s of its head", code="body_timeout")
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(_raw_response(e))
        log.debug("closing connection from %s: %s", self.client, e.message)
        self.transport.close()

    # -- uvicorn hooks -----------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("head")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    # -- admission ---------------------------------------------------------------
    async def _guarded_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limits.max_connections
        # this connection and this request's task are already counted
        if scope.get("path") not in PROBES and (len(self.connections) > limit or len(self.tasks) > limit):
            await _respond(send, OpenAIError(503, f"too many open connections (limit server.max_connections="
                                                  f"{limit})", code="too_many_connections",
                                             headers={"Retry-After": "1"}))
            return
        if self.limits.draining():
            send = _closing(send)
        await self._inner_app(scope, receive, send)


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``."""
    return type("ApplianceH11Protocol", (GuardedH11Protocol,), {"limits": limits})
