"""The OpenAI-compatible HTTP front end (litestar): endpoints and the app.

Thin by design: parse and validate (``protocol.py``), tokenize and apply
chat templates (``prompts.py``), hand requests to the engine core
(``generation.py``), shape responses and SSE chunks (``responses.py``),
record metrics. No scheduling happens here.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager
from typing import AsyncIterator, Iterator, Optional

from litestar import Litestar, Request, Response, delete, get, post
from litestar.config.cors import CORSConfig
from litestar.exceptions import HTTPException
from litestar.response import Stream

from appliance.sampling_params import SamplingParams, StructuredOutputsParams
from appliance.version import __version__
from appliance.server.anthropic_messages import chat_request, error_body, message_body, message_events
from appliance.server.auth import SIGNATURE_HEADER, match_key, tenant_salt, verify_request
from appliance.server.client import EngineDeadError
from appliance.server.generation import ENGINE_FAILED, ENGINE_RESTARTING, Generation, map_engine_error
from appliance.server.prompts import (chat_prompt, check_length, completion_prompts, tokenize, tokenize_prompt,
                                      truncated)
from appliance.server.protocol import (
    DATA_PARALLEL_RANK_HEADER,
    GenerationRequest,
    OpenAIError,
    check_kv_transfer,
    typed,
    common_extensions,
    data_parallel_rank,
    new_id,
    now,
    parse_json,
    prompt_truncation,
    reject_unsupported,
    sampling_from_body,
    stream_options,
    token_id_list,
    token_id_options,
)
from appliance.server import responses_api
from appliance.server.responses import (ToolOutput, chat_body, chat_events, completion_body, completion_events,
                                        tool_output)
from appliance.server.structured import ConstraintChecker, constraint_from_body
from appliance.server.tool_requests import ToolRequest, parse_tools
from appliance.server.state import ServerState
from appliance.server.tracing import RequestSpan

__all__ = ["ServerState", "create_app"]

log = logging.getLogger("appliance.server")


# -- errors ----------------------------------------------------------------------
def _error_response(e: OpenAIError) -> Response:
    return Response(e.body(), status_code=e.status, headers=e.headers, media_type="application/json")


def _openai_error_handler(_: Request, exc: OpenAIError) -> Response:
    return _error_response(exc)


def _http_error_handler(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    detail = exc.detail or "error"
    if status == 413:
        detail = f"request body too large: {detail}"
    return _error_response(OpenAIError(status, str(detail), code=status))


def _engine_error_handler(_: Request, exc: EngineDeadError) -> Response:
    return _error_response(map_engine_error(exc))


def _internal_error_handler(_: Request, exc: Exception) -> Response:
    log.exception("internal error")
    return _error_response(OpenAIError(500, f"internal server error ({type(exc).__name__})", code=500))


# -- what every generation request passes first --------------------------------------
def _state(request: Request) -> ServerState:
    return request.app.state["appliance"]


def _check_auth(request: Request, st: ServerState) -> Optional[int]:
    """The index of the key the request presents (None when the server is open)."""
    if not st.api_keys:
        return None
    presented = request.headers.get("authorization")
    if presented is None and "x-api-key" in request.headers:  # Anthropic's clients send the key here
        presented = f"Bearer {request.headers['x-api-key']}"
    tenant = match_key(presented or "", st.api_keys)
    if tenant is None:
        raise OpenAIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>' (or 'x-api-key: "
                               "<key>')", code="invalid_api_key")
    return tenant


def _check_serving(st: ServerState) -> None:
    if st.client.dead:
        raise OpenAIError(503, ENGINE_FAILED, code="engine_dead", headers={"Retry-After": "30"})
    if st.client.restarting:
        raise OpenAIError(503, ENGINE_RESTARTING, code="engine_restarting",
                          headers={"Retry-After": str(st.client.retry_after_s())})
    if st.shutting_down:
        raise OpenAIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
    waiting = st.in_flight - st.client.stats.num_running
    if waiting >= st.max_queue_len:
        raise OpenAIError(503, f"too many waiting requests ({waiting}, limit server.max_queue_len={st.max_queue_len})",
                          code="queue_full", headers={"Retry-After": "1"})


def _check_model(st: ServerState, body: dict) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise OpenAIError(400, "'model' must be a string", param="model")
    if model is not None and model != st.model_name:
        raise OpenAIError(404, f"the model '{model}' does not exist; this server serves '{st.model_name}'",
                          param="model", code="model_not_found")


def _pinned_rank(request: Request, st: ServerState, body: dict) -> Optional[int]:
    return data_parallel_rank(body, request.headers.get(DATA_PARALLEL_RANK_HEADER),
                              st.deployment.layout.data_parallel_size)


LOOP_PARSE_BYTES = 64 * 1024  # larger bodies are parsed off the event loop


async def _read_body(request: Request, st: ServerState, serving: bool = True) -> dict:
    """The request's body, parsed, from an authorized client, naming this server's model; ``serving``: the
    engine is up and its queue has room."""
    tenant = _check_auth(request, st)
    raw = await request.body()
    if len(raw) > LOOP_PARSE_BYTES:  # parsed on the tokenizer pool: the loop streams between large parses
        body = await asyncio.get_running_loop().run_in_executor(st.tokenize_pool, parse_json, raw)
    else:
        body = parse_json(raw)
    if tenant is not None and st.cfg.server.tenant_isolation and isinstance(body, dict):
        salt = body.get("cache_salt")
        if salt is None or isinstance(salt, str):  # anything else is refused when the body is parsed
            body["cache_salt"] = tenant_salt(st.api_keys[tenant], salt)
    _check_model(st, body)
    if serving:
        _check_serving(st)
    return body


async def _constraint(request: Request, body: dict, tools: Optional[ToolRequest]) -> Optional[StructuredOutputsParams]:
    """The request's output constraint, checked against the deployment's limits (400 when it is over one or does
    not compile; ``ConstraintChecker``)."""
    so, source = constraint_from_body(body, tools)
    if so is not None:
        checker: ConstraintChecker = request.app.state["constraints"]
        await checker.check(so, source, _state(request).tokenize_pool)
    return so


def _json(body: dict) -> Response:
    return Response(body, media_type="application/json")


def _sse_stream(events: AsyncIterator[str]) -> Stream:
    return Stream(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _check_kv_transfer(request: Request, st: ServerState, params: SamplingParams, stream: bool,
                             num_prompts: int) -> None:
    if params.kv_transfer_params is None:
        return
    kt = st.cfg.kv_transfer
    internal = verify_request(st.internal_key, await request.body(), request.headers.get(SIGNATURE_HEADER))
    check_kv_transfer(params, stream, num_prompts, kt.connector, kt.role, st.cfg.cache.block_size, internal,
                      kt.p2p.trusted_producers)


@contextmanager
def _traced(request: Request, st: ServerState, route: str) -> Iterator[Optional[RequestSpan]]:
    """The request's span (server.otlp_traces_endpoint), continuing the caller's trace. The generation
    that takes it ends it; a request refused before that ends it here, with its status."""
    if st.tracing is None:
        yield None
        return
    span = st.tracing.start(f"POST {route}", request.headers,
                            {"http.request.method": "POST", "http.route": route, "url.path": route})
    try:
        yield span
    except OpenAIError as e:
        span.end(e.status, e.message)
        raise
    except HTTPException as e:
        span.end(e.status_code, str(e.detail))
        raise
    except BaseException as e:
        span.end(500, type(e).__name__)
        raise


# -- endpoints ---------------------------------------------------------------------
@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response:
    st = _state(request)
    with _traced(request, st, "/v1/completions") as span:
        return await _completions(request, st, span)


async def _completions(request: Request, st: ServerState, span: Optional[RequestSpan]) -> Response:
    body = await _read_body(request, st)
    if body.get("suffix"):
        raise OpenAIError(400, "'suffix' is not supported", param="suffix")
    reject_unsupported(body, chat=False)
    params, lp_mode = sampling_from_body(body, chat=False, vocab_size=st.cfg.model.vocab_size)
    params.structured_outputs = await _constraint(request, body, None)
    stream, include_usage, continuous_usage = stream_options(body)
    priority, salt = common_extensions(body)
    echo = typed(body, "echo", (bool,), False)
    keep = prompt_truncation(body, st.max_model_len)
    prompts, texts = await tokenize(st, completion_prompts, body, chat=False)
    truncated(prompts, texts, keep)
    for ids in prompts:
        check_length(st, len(ids), params, "prompt")
    await _check_kv_transfer(request, st, params, stream, len(prompts))
    g = GenerationRequest(prompts, texts, params, stream, include_usage, priority, salt, echo, lp_mode,
                          body.get("prompt_logprobs") is not None, _pinned_rank(request, st, body), continuous_usage,
                          *token_id_options(body))
    gen = Generation(st, g, new_id("cmpl"), "n" if len(prompts) == 1 else "prompt", span)
    created = now()
    echo_text = [(t if t is not None else str(st.tokenizer.decode(p))) if echo else "" for p, t in zip(prompts, texts)]
    if not stream:
        return _json(completion_body(st, gen, created, await gen.collect(request), echo_text))
    return _sse_stream(completion_events(st, gen, created, echo_text))


def _chat_format(st: ServerState, body: dict, params: SamplingParams, tools: Optional[ToolRequest]) -> None:
    """A harmony model's chat request: what its format does not take is refused (before the output
    constraint is made); its sampling keeps the special tokens and stops at an answer's or a call's end."""
    if st.harmony is not None:
        st.harmony.check_request(body, tools.choice if tools is not None else None)
        st.harmony.adjust(params)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response:
    st = _state(request)
    with _traced(request, st, "/v1/chat/completions") as span:
        return await _chat_completions(request, st, span)


async def _chat_completions(request: Request, st: ServerState, span: Optional[RequestSpan]) -> Response:
    body = await _read_body(request, st)
    reject_unsupported(body)
    params, lp_mode = sampling_from_body(body, chat=True, vocab_size=st.cfg.model.vocab_size)
    tools = parse_tools(body)
    _chat_format(st, body, params, tools)
    params.structured_outputs = await _constraint(request, body, tools)
    stream, include_usage, continuous_usage = stream_options(body)
    priority, salt = common_extensions(body)
    keep = prompt_truncation(body, st.max_model_len)
    ids, text = await tokenize(st, chat_prompt, body, True, tools.tools if tools is not None else None)
    prompts = [ids]
    texts: list[Optional[str]] = [text]
    truncated(prompts, texts, keep)
    check_length(st, len(prompts[0]), params, "messages")
    await _check_kv_transfer(request, st, params, stream, 1)
    g = GenerationRequest(prompts, texts, params, stream, include_usage, priority, salt, False, lp_mode,
                          body.get("prompt_logprobs") is not None, _pinned_rank(request, st, body), continuous_usage,
                          *token_id_options(body))
    gen = Generation(st, g, new_id("chatcmpl"), span=span)
    created = now()
    calls = tool_output(st, tools)
    if not stream:
        return _json(chat_body(st, gen, created, await gen.collect(request), calls))
    return _sse_stream(chat_events(st, gen, created, calls))


def _anthropic_error_handler(_: Request, exc: Exception) -> Response:
    if isinstance(exc, HTTPException):
        e = OpenAIError(exc.status_code, str(exc.detail or "error"))
    elif isinstance(exc, (OpenAIError, EngineDeadError)):
        e = map_engine_error(exc)
    else:
        log.exception("internal error")
        e = OpenAIError(500, f"internal server error ({type(exc).__name__})")
    return Response(error_body(e), status_code=e.status, headers=e.headers, media_type="application/json")


@post("/v1/messages", status_code=200, exception_handlers={
    t: _anthropic_error_handler for t in (OpenAIError, HTTPException, EngineDeadError, Exception)})
async def messages(request: Request) -> Response:
    """Anthropic's Messages API (``anthropic_messages``): run as the chat request it means."""
    st = _state(request)
    with _traced(request, st, "/v1/messages") as span:
        return await _messages(request, st, span)


async def _as_chat(request: Request, st: ServerState, body: dict, span: Optional[RequestSpan],
                   prefix: str) -> tuple[Generation, Optional[ToolOutput], bool]:
    """A request of another API, as the chat request it means (``body``), admitted as chat's are: its
    generation, how its tool calls are read, and whether it streams."""
    params, _ = sampling_from_body(body, chat=True, vocab_size=st.cfg.model.vocab_size)
    tools = parse_tools(body)
    _chat_format(st, body, params, tools)
    params.structured_outputs = await _constraint(request, body, tools)
    stream = typed(body, "stream", (bool,), False)
    _, salt = common_extensions(body)
    ids, text = await tokenize(st, chat_prompt, body, True, tools.tools if tools is not None else None)
    check_length(st, len(ids), params, "messages")
    g = GenerationRequest([ids], [text], params, stream, False, 0, salt)
    return Generation(st, g, new_id(prefix), span=span), tool_output(st, tools), stream


async def _messages(request: Request, st: ServerState, span: Optional[RequestSpan]) -> Response:
    gen, calls, stream = await _as_chat(request, st, chat_request(await _read_body(request, st)), span, "msg")
    if not stream:
        return _json(message_body(st, gen, (await gen.collect(request))[0], calls))
    return _sse_stream(message_events(st, gen, calls))


@post("/v1/responses", status_code=200)
async def responses(request: Request) -> Response:
    """OpenAI's Responses API, stateless (``responses_api``): run as the chat request it means."""
    st = _state(request)
    with _traced(request, st, "/v1/responses") as span:
        body = await _read_body(request, st)
        tenant, store = _check_auth(request, st), responses_api.store_wanted(st, body)
        history: list[dict] = []
        previous = typed(body, "previous_response_id", (str,))
        if previous is not None:
            found = st.stored_responses.get(tenant, previous)
            if found is None:
                raise _not_stored(previous, "previous_response_id")
            history = found.conversation
        chat = responses_api.chat_request(body, history)
        gen, calls, stream = await _as_chat(request, st, chat, span, "resp")

        def keep(response: dict) -> None:
            if store:
                st.stored_responses.put(tenant, response, responses_api.conversation(chat, response))

        if not stream:
            response = responses_api.response_body(st, gen, body, now(), (await gen.collect(request))[0], calls)
            keep(response)
            return _json(response)
        return _sse_stream(responses_api.response_events(st, gen, body, calls, keep))


def _not_stored(response_id: str, param: Optional[str] = None) -> OpenAIError:
    return OpenAIError(404, f"no stored response '{response_id[:80]}'", param=param, code="not_found")


@get("/v1/responses/{response_id:str}")
async def get_response(request: Request) -> Response:
    """A stored response, to the API key that made it."""
    st, response_id = _state(request), request.path_params["response_id"]
    found = st.stored_responses.get(_check_auth(request, st), response_id)
    if found is None:
        raise _not_stored(response_id)
    return _json(found.response)


@delete("/v1/responses/{response_id:str}", status_code=200)
async def delete_response(request: Request) -> Response:
    st, response_id = _state(request), request.path_params["response_id"]
    if not st.stored_responses.delete(_check_auth(request, st), response_id):
        raise _not_stored(response_id)
    return _json({"id": response_id, "object": "response", "deleted": True})


@post("/tokenize", status_code=200)
async def tokenize_endpoint(request: Request) -> Response:
    """vLLM's /tokenize: a prompt's or chat messages' token ids (and their token strings on request)."""
    st = _state(request)
    body = await _read_body(request, st, serving=False)
    tools = parse_tools(body) if body.get("messages") is not None else None
    ids = await tokenize(st, tokenize_prompt, body, body.get("messages") is not None,
                         tools.tools if tools is not None else None)
    strs = st.tokenizer.convert_ids_to_tokens(ids) if typed(body, "return_token_strs", (bool,), False) else None
    return _json({"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids, "token_strs": strs})


@post("/detokenize", status_code=200)
async def detokenize_endpoint(request: Request) -> Response:
    """vLLM's /detokenize: the text of token ids of this model."""
    st = _state(request)
    body = await _read_body(request, st, serving=False)
    ids = token_id_list(body.get("tokens"), "tokens", st.cfg.model.vocab_size, allow_empty=True)
    return _json({"prompt": st.tokenizer.decode(ids)})


@get("/v1/models")
async def models(request: Request) -> Response:
    st = _state(request)
    _check_auth(request, st)
    return Response({"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": now(), "owned_by": "appliance",
        "root": st.cfg.model.path, "max_model_len": st.max_model_len}]}, media_type="application/json")


@get("/health")
async def health(request: Request) -> Response:
    """Liveness: 503 while the engine is dead, every core is down (restarting,
    or its process ending), or a core is unresponsive (its heartbeat stopped
    for server.core_heartbeat_timeout_s; nothing here restarts a frozen core)."""
    client = _state(request).client
    if client.dead:
        return Response({"status": "dead", "reason": ENGINE_FAILED}, status_code=503)
    if client.restarting:
        return Response({"status": "restarting", "reason": ENGINE_RESTARTING}, status_code=503)
    if client.lost:
        return Response({"status": "lost", "reason": ENGINE_FAILED}, status_code=503)
    silent = client.unresponsive_reason()
    if silent is not None:
        return Response({"status": "unresponsive", "reason": silent}, status_code=503)
    return Response({"status": "ok"})


@get("/ready")
async def ready(request: Request) -> Response:
    """Readiness: 503 while draining, and while no engine core can take work
    (dead, restarting, its process ending, or unresponsive)."""
    st = _state(request)
    if st.client.dead or st.shutting_down or st.client.ready_info is None or not st.client.serving:
        return Response({"ready": False}, status_code=503, headers={"Retry-After": "5"})
    return Response({"ready": True})


@get("/metrics", media_type="text/plain; version=0.0.4")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")


@get("/version")
async def version(request: Request) -> dict:
    st = _state(request)
    return {"version": __version__, "config_hash": st.resolved.hash,
            "deployment": st.deployment.fingerprint}


@get("/v1/appliance/config")
async def appliance_config(request: Request) -> Response:
    st = _state(request)
    _check_auth(request, st)
    r = st.resolved
    ex = st.deployment.execution
    return Response({"profile": r.cfg.profile, "hash": r.hash, "deployment": st.deployment.fingerprint,
                     "overrides": list(r.overrides), "config": r.as_dict(), "resolved_here": ex.to_dict()})


@post("/reset_prefix_cache", status_code=200)
async def reset_prefix_cache(request: Request) -> Response:
    st = _state(request)
    _check_auth(request, st)
    ok = await st.client.reset_prefix_cache()
    if not ok:
        raise OpenAIError(400, "the prefix cache is in use by running requests; retry when idle", code="cache_in_use")
    return Response({"reset": True})


def create_app(state: ServerState) -> Litestar:
    cfg = state.cfg.server
    handlers = [completions, chat_completions, messages, responses, get_response, delete_response, tokenize_endpoint,
                detokenize_endpoint, models, health, ready, metrics, version, appliance_config]
    if cfg.dev_mode:
        handlers.append(reset_prefix_cache)
    cors = CORSConfig(allow_origins=list(cfg.cors_origins)) if cfg.cors_origins else None
    app = Litestar(
        route_handlers=handlers,
        exception_handlers={OpenAIError: _openai_error_handler, HTTPException: _http_error_handler,
                            EngineDeadError: _engine_error_handler, Exception: _internal_error_handler},
        request_max_body_size=cfg.max_body_bytes,
        cors_config=cors,
        openapi_config=None,
        logging_config=None,
    )
    app.state["appliance"] = state
    app.state["constraints"] = ConstraintChecker(state.cfg.structured_output, state.tokenizer,
                                                 state.cfg.model.vocab_size)
    return app
