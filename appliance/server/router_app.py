"""`appliance route`'s HTTP app: the endpoints an instance serves, each
proxied to the instance ``server.router.Router`` chooses (completions,
chat, Anthropic's Messages, Responses, /tokenize and /detokenize); a
stored response, read or deleted by id, and a Responses request that
continues one (``previous_response_id``) go to the instance that stored
it (``Router.find_stored``). The instances check every body and key: the
router only needs a JSON object."""

from __future__ import annotations

import os
from typing import Any

import httpx
from litestar import Litestar, Request, Response, delete, get, post
from litestar.response import Stream

from appliance.errors import ConfigError
from appliance.server.auth import load_internal_key
from appliance.server.router import Router
from appliance.server.tracing import Tracing

# What the router passes on, POST bodies proxied to the instance the policy chooses.
PROXIED = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses", "/tokenize", "/detokenize")


def _not_an_object() -> Response:
    return Response(content={"error": {"message": "the body must be a JSON object", "type": "BadRequestError",
                                       "code": 400}}, status_code=400)


def build_app(router: Router) -> Any:
    """The router's HTTP app (litestar)."""

    async def proxy(request: Request) -> Response:
        try:
            body = await request.json()
        except Exception:
            return _not_an_object()
        if not isinstance(body, dict):
            return _not_an_object()
        status, headers, content = await router.forward(request.url.path, body, dict(request.headers))
        if isinstance(content, (bytes, bytearray)):
            return Response(content=bytes(content), status_code=status, media_type=headers["content-type"])
        return Stream(content, status_code=status, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    routes = [post(path, status_code=200, name=path)(proxy) for path in PROXIED]

    async def stored(request: Request, response_id: str) -> Response:
        status, headers, content = await router.stored(request.method, response_id, dict(request.headers))
        return Response(content=content, status_code=status, media_type=headers["content-type"])

    routes += [get("/v1/responses/{response_id:str}", name="get_response")(stored),
               delete("/v1/responses/{response_id:str}", status_code=200, name="delete_response")(stored)]

    @get("/v1/models")
    async def models() -> Response:
        for inst in router.instances:
            if inst.healthy:
                try:
                    r = await router.http.get(f"{inst.url}/v1/models", timeout=10.0)
                    return Response(content=r.content, status_code=r.status_code, media_type="application/json")
                except httpx.HTTPError:
                    continue
        return Response(content={"error": {"message": "no healthy instance", "code": 503}}, status_code=503)

    @get("/health")
    async def health() -> Response:
        ok = any(i.healthy for i in router.instances)
        return Response(content={"healthy": [i.url for i in router.instances if i.healthy]},
                        status_code=200 if ok else 503)

    @get("/metrics")
    async def metrics() -> Response:
        return Response(content=router.metrics_text(), media_type="text/plain; version=0.0.4")

    return Litestar(route_handlers=[*routes, models, health, metrics],
                    on_startup=[router.start], on_shutdown=[router.stop])


def route_forever(cfg: Any) -> int:
    """``appliance route``: the router of ``cfg.router`` on its host and port, the model's tokenizer for kv_aware."""
    import uvicorn

    r = cfg.router
    tokenizer = harmony = None
    if r.policy == "kv_aware":
        from appliance.models.loader import load_tokenizer
        from appliance.server.harmony import HarmonyUnavailable, harmony_chat

        tokenizer = load_tokenizer(cfg.model, cfg.quantization.method)
        try:
            harmony = harmony_chat(cfg, tokenizer)
        except HarmonyUnavailable as e:
            raise ConfigError(str(e)) from None
    try:
        curve = None if r.kv_events_client_key_file is None else (
            os.path.expanduser(r.kv_events_client_key_file), os.path.expanduser(r.kv_events_server_key_file))
        router = Router(list(r.instances), r.policy, tokenizer, list(r.kv_events), r.kv_load_weight,
                        r.health_interval_s, r.request_timeout_s, cfg.kv_events.topic, r.kv_match_threshold,
                        list(r.prefill_instances), list(r.kv_events_replay), load_internal_key(cfg.server), curve,
                        harmony)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    endpoint = cfg.server.otlp_traces_endpoint
    if endpoint is not None:

        def dropped(n: int) -> None:
            router.trace_spans_dropped += n

        router.tracing = Tracing(endpoint, {"appliance.router.policy": r.policy}, dropped,
                                 service_name="appliance-router")
    print(f"routing {len(router.instances)} instance(s) by {r.policy} on http://{r.host}:{r.port}")
    try:
        uvicorn.run(build_app(router), host=r.host, port=r.port, log_level="warning")
    finally:
        if router.tracing is not None:
            router.tracing.shutdown()
    return 0
