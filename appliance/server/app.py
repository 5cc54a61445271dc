"""The OpenAI-compatible HTTP front end (litestar).

Thin by design: parse and validate, tokenize and apply chat templates, hand
requests to the engine core, shape responses and SSE chunks, record
metrics. No scheduling happens here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from litestar import Litestar, Request, Response, get, post
from litestar.config.cors import CORSConfig
from litestar.exceptions import HTTPException
from litestar.response import Stream

from appliance import __version__
from appliance.server.client import EngineClient, EngineDeadError, RequestRejected
from appliance.server.metrics import Metrics
from appliance.server.protocol import (
    GenerationRequest,
    OpenAIError,
    _typed,
    common_extensions,
    new_id,
    now,
    parse_json,
    sampling_from_body,
    stream_options,
    usage,
)

log = logging.getLogger("appliance.server")


@dataclass
class ServerState:
    resolved: Any
    client: EngineClient
    tokenizer: Any
    metrics: Metrics
    model_name: str
    max_model_len: int
    api_key: Optional[str]
    max_queue_len: int
    shutting_down: bool = False
    in_flight: int = 0  # admitted engine requests (children) not yet finished


class Admission:
    """Counts a request's children against the queue limit from the moment
    the handler admits them (before any task runs) until they end; released
    once, by the generation or by garbage collection if it never ran."""

    def __init__(self, st: ServerState, n: int):
        self.st, self.n = st, n
        st.in_flight += n

    def release(self) -> None:
        if self.n:
            self.st.in_flight -= self.n
            self.n = 0

    __del__ = release


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


def _internal_error_handler(_: Request, exc: Exception) -> Response:
    log.exception("internal error")
    return _error_response(OpenAIError(500, f"internal server error ({type(exc).__name__})", code=500))


# -- helpers ---------------------------------------------------------------------
def _state(request: Request) -> ServerState:
    return request.app.state["appliance"]


def _check_auth(request: Request, st: ServerState) -> None:
    if st.api_key is None:
        return
    header = request.headers.get("authorization", "")
    if header != f"Bearer {st.api_key}":
        raise OpenAIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'", code="invalid_api_key")


def _check_serving(st: ServerState) -> None:
    if st.client.dead:
        raise OpenAIError(503, f"the engine is not available: {st.client.dead_reason}", code="engine_dead",
                          headers={"Retry-After": "30"})
    if st.shutting_down:
        raise OpenAIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
    waiting = st.in_flight - st.client.stats.num_running
    if waiting >= st.max_queue_len:
        raise OpenAIError(503, f"too many waiting requests ({waiting}, limit server.max_queue_len={st.max_queue_len})",
                          code="queue_full", headers={"Retry-After": "1"})


def _check_model(st: ServerState, body: dict) -> None:
    model = body.get("model")
    if model is not None and model != st.model_name:
        raise OpenAIError(404, f"the model '{model}' does not exist; this server serves '{st.model_name}'",
                          param="model", code="model_not_found")


def _check_length(st: ServerState, prompt_len: int, params: Any, what: str) -> None:
    mml = st.max_model_len
    if params.max_tokens is None:
        if prompt_len >= mml:
            raise OpenAIError(400, f"This model's maximum context length is {mml} tokens. However, your {what} "
                                   f"has {prompt_len} tokens, leaving no room for a completion.", param=what)
        params.max_tokens = mml - prompt_len
        return
    total = prompt_len + params.max_tokens
    if total > mml:
        raise OpenAIError(400, f"This model's maximum context length is {mml} tokens. However, you requested {total} "
                               f"tokens ({prompt_len} in the {what}, {params.max_tokens} in the completion). "
                               f"Please reduce the length of the {what} or completion.", param="max_tokens")


def _token_str(st: ServerState, tok: int) -> str:
    return st.tokenizer.decode([tok])


def _format_logprobs(st: ServerState, mode: str, lps: list, text_offset: int) -> Any:
    if mode == "chat":
        content = []
        for lp in lps:
            if lp is None:
                continue
            tok = _token_str(st, lp["token_id"])
            content.append({
                "token": tok, "logprob": lp["logprob"], "bytes": list(tok.encode()),
                "top_logprobs": [{"token": (t := _token_str(st, i)), "logprob": v, "bytes": list(t.encode())}
                                 for i, v in lp["top"]],
            })
        return {"content": content}
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        if lp is None:
            continue
        tok = _token_str(st, lp["token_id"])
        out["tokens"].append(tok)
        out["token_logprobs"].append(lp["logprob"])
        top = {_token_str(st, i): v for i, v in lp["top"]}
        top.setdefault(tok, lp["logprob"])
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(tok)
    return out


@dataclass
class _Choice:
    index: int
    prompt_index: int
    text: str = ""
    tokens: int = 0
    finish_reason: Optional[str] = None
    logprobs: list = field(default_factory=list)
    cached: int = 0


class RequestTimeout(Exception):
    pass


async def _fan_out(st: ServerState, g: GenerationRequest, base_id: str) -> AsyncIterator[tuple[_Choice, dict]]:
    """Run every (prompt, sample) child; yield (choice, delta) as they arrive;
    past server.request_timeout_s every child is aborted and RequestTimeout raised."""
    from dataclasses import replace

    admission = g.extra["admission"]

    merged: asyncio.Queue = asyncio.Queue()
    choices: list[_Choice] = []
    tasks = []
    n = g.params.n

    async def child(choice: _Choice, rid: str, ids: list[int], params: Any) -> None:
        arrival = time.monotonic()
        first = last = None
        finished = False
        try:
            async for d in st.client.generate(rid, ids, params, g.priority, g.cache_salt):
                t = time.monotonic()
                if d["new_token_ids"]:
                    if first is None:
                        first = t
                        st.metrics.time_to_first_token_seconds.observe(t - arrival)
                    elif last is not None:
                        per = (t - last) / len(d["new_token_ids"])
                        for _ in d["new_token_ids"]:
                            st.metrics.inter_token_latency_seconds.observe(per)
                    last = t
                if d.get("queue_time") is not None:
                    st.metrics.request_queue_time_seconds.observe(d["queue_time"])
                await merged.put((choice, d))
                if d["finished"]:
                    finished = True
                    st.metrics.e2e_request_latency_seconds.observe(t - arrival)
                    st.metrics.generation_tokens.inc(d["num_output_tokens"])
                    st.metrics.request_success(d["finish_reason"] or "abort")
                    log.info(
                        "request_id=%s prompt_tokens=%d output_tokens=%d cached_tokens=%d ttft_s=%.4f total_s=%.4f "
                        "finish_reason=%s", rid, d["num_prompt_tokens"], d["num_output_tokens"], d["num_cached_tokens"],
                        (first or t) - arrival, t - arrival, d["finish_reason"])
        except asyncio.CancelledError:
            if not finished:  # client went away: the generator aborted it in the core
                st.metrics.request_success("abort")
                log.info("request_id=%s aborted after %.4f s", rid, time.monotonic() - arrival)
            raise
        except Exception as e:  # delivered to the consumer
            await merged.put((choice, e))
        finally:
            merged.put_nowait((choice, None))

    for pi, ids in enumerate(g.prompts):
        st.metrics.prompt_tokens.inc(len(ids))
        for k in range(n):
            c = _Choice(index=pi * n + k, prompt_index=pi)
            choices.append(c)
            params = replace(g.params, n=1, seed=None if g.params.seed is None else g.params.seed + k)
            tasks.append(asyncio.create_task(child(c, f"{base_id}-{c.index}", ids, params)))
    remaining = len(tasks)
    deadline = time.monotonic() + st.resolved.cfg.server.request_timeout_s
    try:
        while remaining:
            try:
                choice, item = await asyncio.wait_for(merged.get(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise RequestTimeout(f"the request ran longer than server.request_timeout_s="
                                     f"{st.resolved.cfg.server.request_timeout_s:g} s and was aborted") from None
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, Exception):
                raise item
            yield choice, item
    finally:
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        admission.release()


def _map_engine_error(e: Exception) -> OpenAIError:
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, f"the engine is not available: {e}", code="engine_dead", headers={"Retry-After": "30"})
    if isinstance(e, RequestRejected):
        return OpenAIError(400, str(e))
    if isinstance(e, RequestTimeout):
        return OpenAIError(408, str(e), code="request_timeout")
    raise e


async def _until_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _collect(request: Request, st: ServerState, g: GenerationRequest, base_id: str) -> list[_Choice]:
    """Non-streaming: gather all choices; a client disconnect aborts them."""
    result: dict[int, _Choice] = {}

    async def run() -> None:
        async for choice, d in _fan_out(st, g, base_id):
            result[choice.index] = choice
            choice.text += d["new_text"]
            choice.tokens = d["num_output_tokens"]
            choice.logprobs.extend(d["logprobs"])
            choice.cached = max(choice.cached, d["num_cached_tokens"])
            if d["finished"]:
                choice.finish_reason = d["finish_reason"]

    gen = asyncio.create_task(run())
    watch = asyncio.create_task(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({gen, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not gen.done():
            gen.cancel()
            await asyncio.gather(gen, return_exceptions=True)
            log.info("client disconnected; request %s aborted", base_id)
    if gen.cancelled():
        raise OpenAIError(499, "client disconnected")
    exc = gen.exception()
    if exc is not None:
        raise _map_engine_error(exc)
    return [result[i] for i in sorted(result)]


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# -- endpoints ---------------------------------------------------------------------
async def _read_body(request: Request, st: ServerState) -> dict:
    _check_auth(request, st)
    body = parse_json(await request.body())
    _check_model(st, body)
    _check_serving(st)
    return body


def _completion_prompts(st: ServerState, body: dict) -> tuple[list[list[int]], list[Optional[str]]]:
    if "prompt" not in body or body["prompt"] is None:
        raise OpenAIError(400, "'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, str):
        items: list = [p]
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        items = p
    elif isinstance(p, list) and p and all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in p):
        items = p
    else:
        raise OpenAIError(400, "'prompt' must be a non-empty string, list of strings, list of token ids, "
                               "or list of token id lists", param="prompt")
    prompts, texts = [], []
    vocab = st.resolved.cfg.model.vocab_size
    for it in items:
        if isinstance(it, str):
            if not it:
                raise OpenAIError(400, "'prompt' must not be empty", param="prompt")
            prompts.append(st.tokenizer.encode(it))
            texts.append(it)
        else:
            bad = [t for t in it if not 0 <= t < vocab]
            if bad:
                raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt")
            prompts.append(list(it))
            texts.append(None)
    if len(prompts) > 64:
        raise OpenAIError(400, "at most 64 prompts per request", param="prompt")
    return prompts, texts


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response:
    st = _state(request)
    body = await _read_body(request, st)
    if body.get("suffix"):
        raise OpenAIError(400, "'suffix' is not supported", param="suffix")
    params, lp_mode = sampling_from_body(body, chat=False)
    stream, include_usage = stream_options(body)
    priority, salt = common_extensions(body)
    echo = _typed(body, "echo", (bool,), False)
    prompts, texts = _completion_prompts(st, body)
    for ids in prompts:
        _check_length(st, len(ids), params, "prompt")
    g = GenerationRequest(prompts, texts, params, stream, include_usage, priority, salt, echo, lp_mode)
    g.extra["admission"] = Admission(st, len(prompts) * params.n)
    base_id = new_id("cmpl")
    created = now()
    prompt_tokens = sum(len(p) for p in prompts)
    echo_text = [(texts[i] if texts[i] is not None else st.tokenizer.decode(prompts[i])) if echo else ""
                 for i in range(len(prompts))]
    if not stream:
        choices = await _collect(request, st, g, base_id)
        return Response({
            "id": base_id, "object": "text_completion", "created": created, "model": st.model_name,
            "choices": [{"index": c.index, "text": echo_text[c.prompt_index] + c.text,
                         "logprobs": _format_logprobs(st, "completion", c.logprobs, len(echo_text[c.prompt_index]))
                         if lp_mode else None, "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(prompt_tokens, sum(c.tokens for c in choices), sum(c.cached for c in choices)),
        }, media_type="application/json")

    async def events() -> AsyncIterator[str]:
        completion_tokens = 0
        sent_echo: set[int] = set()
        offsets: dict[int, int] = {}
        try:
            async for choice, d in _fan_out(st, g, base_id):
                text = d["new_text"]
                if echo and choice.index not in sent_echo:
                    text = echo_text[choice.prompt_index] + text
                    sent_echo.add(choice.index)
                off = offsets.get(choice.index, 0)
                offsets[choice.index] = off + len(text)
                if d["finished"]:
                    completion_tokens += d["num_output_tokens"]
                if not text and not d["finished"] and not d["logprobs"]:
                    continue
                yield _sse({"id": base_id, "object": "text_completion", "created": created, "model": st.model_name,
                            "choices": [{"index": choice.index, "text": text,
                                         "logprobs": _format_logprobs(st, "completion", d["logprobs"], off) if lp_mode else None,
                                         "finish_reason": d["finish_reason"] if d["finished"] else None}]})
            if include_usage:
                yield _sse({"id": base_id, "object": "text_completion", "created": created, "model": st.model_name,
                            "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        except (EngineDeadError, RequestRejected, RequestTimeout) as e:
            yield _sse(_map_engine_error(e).body())
        yield "data: [DONE]\n\n"

    return Stream(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _chat_prompt(st: ServerState, body: dict) -> tuple[list[int], str]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise OpenAIError(400, "'messages' must be a non-empty list", param="messages")
    conv = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            raise OpenAIError(400, f"messages[{i}] needs a 'role' of system, user, assistant, developer or tool",
                              param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise OpenAIError(400, f"messages[{i}].content: only text parts are supported",
                                      param=f"messages[{i}].content")
                parts.append(p["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise OpenAIError(400, f"messages[{i}].content must be a string or a list of text parts",
                              param=f"messages[{i}].content")
        role = "system" if m["role"] == "developer" else m["role"]
        conv.append({"role": role, "content": content})
    add_gen = _typed(body, "add_generation_prompt", (bool,), True)
    try:
        text = st.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_gen)
    except Exception as e:
        raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return st.tokenizer.encode(text, add_special_tokens=False), text


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response:
    st = _state(request)
    body = await _read_body(request, st)
    params, lp_mode = sampling_from_body(body, chat=True)
    stream, include_usage = stream_options(body)
    priority, salt = common_extensions(body)
    ids, text = _chat_prompt(st, body)
    _check_length(st, len(ids), params, "messages")
    g = GenerationRequest([ids], [text], params, stream, include_usage, priority, salt, False, lp_mode)
    g.extra["admission"] = Admission(st, params.n)
    base_id = new_id("chatcmpl")
    created = now()
    if not stream:
        choices = await _collect(request, st, g, base_id)
        return Response({
            "id": base_id, "object": "chat.completion", "created": created, "model": st.model_name,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": _format_logprobs(st, "chat", c.logprobs, 0) if lp_mode else None,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(len(ids), sum(c.tokens for c in choices), max((c.cached for c in choices), default=0)),
        }, media_type="application/json")

    async def events() -> AsyncIterator[str]:
        head = {"id": base_id, "object": "chat.completion.chunk", "created": created, "model": st.model_name}
        for k in range(params.n):
            yield _sse({**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        completion_tokens = 0
        try:
            async for choice, d in _fan_out(st, g, base_id):
                if d["finished"]:
                    completion_tokens += d["num_output_tokens"]
                if not d["new_text"] and not d["finished"] and not d["logprobs"]:
                    continue
                yield _sse({**head, "choices": [{
                    "index": choice.index, "delta": {"content": d["new_text"]} if d["new_text"] else {},
                    "logprobs": _format_logprobs(st, "chat", d["logprobs"], 0) if lp_mode else None,
                    "finish_reason": d["finish_reason"] if d["finished"] else None}]})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": usage(len(ids), completion_tokens)})
        except (EngineDeadError, RequestRejected, RequestTimeout) as e:
            yield _sse(_map_engine_error(e).body())
        yield "data: [DONE]\n\n"

    return Stream(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@get("/v1/models")
async def models(request: Request) -> Response:
    st = _state(request)
    _check_auth(request, st)
    return Response({"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": now(), "owned_by": "appliance",
        "root": st.resolved.cfg.model.path, "max_model_len": st.max_model_len}]}, media_type="application/json")


@get("/health")
async def health(request: Request) -> Response:
    st = _state(request)
    if st.client.dead:
        return Response({"status": "dead", "reason": st.client.dead_reason}, status_code=503)
    return Response({"status": "ok"})


@get("/ready")
async def ready(request: Request) -> Response:
    st = _state(request)
    if st.client.dead or st.shutting_down or not st.client.ready_info:
        return Response({"ready": False}, status_code=503, headers={"Retry-After": "5"})
    return Response({"ready": True})


@get("/metrics", media_type="text/plain; version=0.0.4")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4")


@get("/version")
async def version() -> dict:
    return {"version": __version__}


@get("/v1/appliance/config")
async def appliance_config(request: Request) -> Response:
    st = _state(request)
    _check_auth(request, st)
    r = st.resolved
    return Response({"profile": r.cfg.profile, "hash": r.hash, "overrides": list(r.overrides), "config": r.as_dict()})


@post("/reset_prefix_cache", status_code=200)
async def reset_prefix_cache(request: Request) -> Response:
    st = _state(request)
    _check_auth(request, st)
    ok = await st.client.reset_prefix_cache()
    if not ok:
        raise OpenAIError(400, "the prefix cache is in use by running requests; retry when idle", code="cache_in_use")
    return Response({"reset": True})


def create_app(state: ServerState) -> Litestar:
    cfg = state.resolved.cfg.server
    handlers = [completions, chat_completions, models, health, ready, metrics, version, appliance_config]
    if cfg.dev_mode:
        handlers.append(reset_prefix_cache)
    cors = CORSConfig(allow_origins=list(cfg.cors_origins)) if cfg.cors_origins else None
    app = Litestar(
        route_handlers=handlers,
        exception_handlers={OpenAIError: _openai_error_handler, HTTPException: _http_error_handler,
                            Exception: _internal_error_handler},
        request_max_body_size=cfg.max_body_bytes,
        cors_config=cors,
        openapi_config=None,
        logging_config=None,
    )
    app.state["appliance"] = state
    return app
