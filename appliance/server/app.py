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

from appliance.version import __version__
from appliance.config.compose import ResolvedConfig
from appliance.config.deployment import Deployment
from appliance.config.schema import ApplianceConfig
from appliance.server.auth import match_key, tenant_salt
from appliance.server.client import EngineClient, EngineDeadError, EngineRestartingError, RequestRejected
from appliance.server.metrics import Metrics
from appliance.server.protocol import (
    GenerationRequest,
    MAX_PROMPTS,
    OpenAIError,
    _typed,
    common_extensions,
    new_id,
    now,
    parse_json,
    reject_unsupported,
    sampling_from_body,
    stream_options,
    token_id_list,
    usage,
)

log = logging.getLogger("appliance.server")


@dataclass
class ServerState:
    deployment: Deployment
    client: EngineClient
    tokenizer: Any
    metrics: Metrics
    api_keys: tuple[str, ...]  # empty: no authentication (appliance.server.auth)
    shutting_down: bool = False
    in_flight: int = 0  # admitted engine requests (children) not yet finished
    tokenize_pool: Any = None  # executor for tokenization and chat templates (None: the loop's default one)
    generations: set = field(default_factory=set)  # merged queues of running _fan_out calls (a drain cuts them)
    cut_reason: Optional[str] = None  # set when a drain has cut running generations

    @property
    def resolved(self) -> ResolvedConfig:
        return self.deployment.resolved

    @property
    def cfg(self) -> ApplianceConfig:
        return self.deployment.cfg

    @property
    def model_name(self) -> str:
        return self.deployment.model_name

    @property
    def max_model_len(self) -> int:
        return self.deployment.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        return self.deployment.max_prompt_chars

    @property
    def max_queue_len(self) -> int:
        return self.cfg.server.max_queue_len


class Admission:
    """Admits a request's children (prompts x n) against server.max_queue_len
    (400 when they could never fit, 503 queue_full while the queue is too
    full) and counts them from that moment (before any task runs) until they
    end; released once, by the generation or by garbage collection if it
    never ran."""

    def __init__(self, st: ServerState, n: int, param: str = "n"):
        self.st, self.n = st, 0
        if n > st.max_queue_len:
            raise OpenAIError(400, f"this request asks for {n} sequences (prompts x n); the server queues at most "
                                   f"server.max_queue_len={st.max_queue_len}", param=param, code="too_many_sequences")
        waiting = st.in_flight - st.client.stats.num_running
        if waiting + n > st.max_queue_len:
            raise OpenAIError(503, f"too many waiting requests ({waiting} waiting, this request adds {n}; limit "
                                   f"server.max_queue_len={st.max_queue_len})", code="queue_full",
                              headers={"Retry-After": "1"})
        self.n = n
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


def _engine_error_handler(_: Request, exc: EngineDeadError) -> Response:
    return _error_response(_map_engine_error(exc))


def _internal_error_handler(_: Request, exc: Exception) -> Response:
    log.exception("internal error")
    return _error_response(OpenAIError(500, f"internal server error ({type(exc).__name__})", code=500))


# -- helpers ---------------------------------------------------------------------
def _state(request: Request) -> ServerState:
    return request.app.state["appliance"]


def _check_auth(request: Request, st: ServerState) -> Optional[int]:
    """The index of the key the request presents (None when the server is open)."""
    if not st.api_keys:
        return None
    tenant = match_key(request.headers.get("authorization", ""), st.api_keys)
    if tenant is None:
        raise OpenAIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'", code="invalid_api_key")
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


def _check_length(st: ServerState, prompt_len: int, params: Any, what: str) -> None:
    mml = st.max_model_len
    if params.max_tokens is None:
        if prompt_len >= mml:
            raise OpenAIError(400, f"This model's maximum context length is {mml} tokens. However, your {what} "
                                   f"has {prompt_len} tokens, leaving no room for a completion.", param=what)
        params.max_tokens = mml - prompt_len
        if params.min_tokens > params.max_tokens:
            raise OpenAIError(400, f"min_tokens ({params.min_tokens}) must not exceed the {params.max_tokens} tokens "
                                   f"left for the completion", param="min_tokens")
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


class RequestFailed(Exception):
    """The engine core failed on this request (finish_reason "error"); it logged why."""


# Engine failures are logged, never sent to clients.
ENGINE_FAILED = "the engine failed; see the server log"
ENGINE_RESTARTING = "the engine failed and is restarting; retry after the Retry-After interval (see the server log)"


class ServerShutdown(Exception):
    """A drain cut the request (server.shutdown_timeout_s passed, or a second signal)."""


def cut_generations(st: ServerState, reason: str) -> int:
    """End every running generation with ``ServerShutdown`` (streams send it as an
    error event, then [DONE]); later ones end the same way at once. How many were cut."""
    st.cut_reason = reason
    for merged in list(st.generations):
        merged.put_nowait((None, ServerShutdown(reason)))
    return len(st.generations)


async def _fan_out(st: ServerState, g: GenerationRequest, base_id: str) -> AsyncIterator[tuple[_Choice, dict]]:
    """Run every (prompt, sample) child; yield (choice, delta) as they arrive;
    past server.request_timeout_s every child is aborted and RequestTimeout raised."""
    from dataclasses import replace

    admission = g.extra["admission"]

    merged: asyncio.Queue = asyncio.Queue()
    st.generations.add(merged)
    if st.cut_reason is not None:
        merged.put_nowait((None, ServerShutdown(st.cut_reason)))
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
                if d["finish_reason"] == "error":
                    finished = True
                    st.metrics.request_success("error")
                    log.error("request_id=%s failed in the engine core", rid)
                    raise RequestFailed("the engine failed to process this request; see the server log")
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
    deadline = time.monotonic() + st.cfg.server.request_timeout_s
    try:
        while remaining:
            try:
                choice, item = await asyncio.wait_for(merged.get(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise RequestTimeout(f"the request ran longer than server.request_timeout_s="
                                     f"{st.cfg.server.request_timeout_s:g} s and was aborted") from None
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, Exception):
                raise item
            yield choice, item
    finally:
        st.generations.discard(merged)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        admission.release()


def _map_engine_error(e: Exception) -> OpenAIError:
    if isinstance(e, EngineRestartingError):
        return OpenAIError(503, ENGINE_RESTARTING, code="engine_restarting",
                           headers={"Retry-After": str(e.retry_after_s)})
    if isinstance(e, ServerShutdown):
        return OpenAIError(503, str(e), code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, ENGINE_FAILED, code="engine_dead", headers={"Retry-After": "30"})
    if isinstance(e, RequestFailed):
        return OpenAIError(500, str(e), code="engine_error")
    if isinstance(e, RequestRejected):
        return OpenAIError(400, str(e))
    if isinstance(e, RequestTimeout):
        return OpenAIError(408, str(e), code="request_timeout")
    if isinstance(e, OpenAIError):
        return e
    log.error("request failed", exc_info=e)
    return OpenAIError(500, f"internal server error ({type(e).__name__}); see the server log", code=500)


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
LOOP_PARSE_BYTES = 64 * 1024  # larger bodies are parsed off the event loop


async def _read_body(request: Request, st: ServerState) -> dict:
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
    _check_serving(st)
    return body


def _check_prompt_chars(st: ServerState, body: dict, chat: bool) -> None:
    """Refuse over-long prompt text before it is tokenized, from the raw body
    (its shape is checked when the prompt is built)."""
    limit = st.max_prompt_chars
    if not limit:
        return
    if chat:
        total = 0
        msgs = body.get("messages")
        for m in msgs if isinstance(msgs, list) else []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        if total > limit:
            raise OpenAIError(400, f"the messages have {total} characters; this server tokenizes at most {limit} "
                                   f"(server.max_prompt_chars). Please shorten them.", param="messages",
                              code="prompt_too_long")
        return
    p = body.get("prompt")
    texts = [p] if isinstance(p, str) else [x for x in p if isinstance(x, str)] if isinstance(p, list) else []
    for i, text in enumerate(texts):
        if len(text) > limit:
            which = "the prompt" if isinstance(p, str) else f"prompt {i}"
            raise OpenAIError(400, f"{which} has {len(text)} characters; this server tokenizes at most {limit} "
                                   f"(server.max_prompt_chars). Please shorten it.", param="prompt",
                              code="prompt_too_long")


async def _tokenize(st: ServerState, build: Any, body: dict, chat: bool) -> Any:
    """``build(st, body)`` (tokenization, chat template) on the tokenizer pool, so
    the event loop keeps streaming while a long prompt is encoded."""
    _check_prompt_chars(st, body, chat)
    return await asyncio.get_running_loop().run_in_executor(st.tokenize_pool, build, st, body)


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
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        items = p
    else:
        raise OpenAIError(400, "'prompt' must be a non-empty string, list of strings, list of token ids, "
                               "or list of token id lists", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise OpenAIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    prompts, texts = [], []
    vocab = st.cfg.model.vocab_size
    for it in items:
        if isinstance(it, str):
            if not it:
                raise OpenAIError(400, "'prompt' must not be empty", param="prompt")
            prompts.append(st.tokenizer.encode(it))
            texts.append(it)
        else:
            prompts.append(list(token_id_list(it, "prompt", vocab)))
            texts.append(None)
    return prompts, texts


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response:
    st = _state(request)
    body = await _read_body(request, st)
    if body.get("suffix"):
        raise OpenAIError(400, "'suffix' is not supported", param="suffix")
    reject_unsupported(body)
    params, lp_mode = sampling_from_body(body, chat=False, vocab_size=st.cfg.model.vocab_size)
    stream, include_usage = stream_options(body)
    priority, salt = common_extensions(body)
    echo = _typed(body, "echo", (bool,), False)
    prompts, texts = await _tokenize(st, _completion_prompts, body, chat=False)
    for ids in prompts:
        _check_length(st, len(ids), params, "prompt")
    g = GenerationRequest(prompts, texts, params, stream, include_usage, priority, salt, echo, lp_mode)
    g.extra["admission"] = Admission(st, len(prompts) * params.n, "n" if len(prompts) == 1 else "prompt")
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
        except Exception as e:  # after the 200 headers every error is an event, then [DONE]
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
    reject_unsupported(body)
    params, lp_mode = sampling_from_body(body, chat=True, vocab_size=st.cfg.model.vocab_size)
    stream, include_usage = stream_options(body)
    priority, salt = common_extensions(body)
    ids, text = await _tokenize(st, _chat_prompt, body, chat=True)
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
        except Exception as e:  # after the 200 headers every error is an event, then [DONE]
            yield _sse(_map_engine_error(e).body())
        yield "data: [DONE]\n\n"

    return Stream(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@get("/v1/models")
async def models(request: Request) -> Response:
    st = _state(request)
    _check_auth(request, st)
    return Response({"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": now(), "owned_by": "appliance",
        "root": st.cfg.model.path, "max_model_len": st.max_model_len}]}, media_type="application/json")


@get("/health")
async def health(request: Request) -> Response:
    st = _state(request)
    if st.client.dead:
        return Response({"status": "dead", "reason": ENGINE_FAILED}, status_code=503)
    if st.client.restarting:
        return Response({"status": "restarting", "reason": ENGINE_RESTARTING}, status_code=503)
    return Response({"status": "ok"})


@get("/ready")
async def ready(request: Request) -> Response:
    st = _state(request)
    if st.client.dead or st.client.restarting or st.shutting_down or not st.client.ready_info:
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
    handlers = [completions, chat_completions, models, health, ready, metrics, version, appliance_config]
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
    return app
