"""Anthropic's Messages API (``POST /v1/messages``), as vLLM serves it.

A request is checked at the boundary and turned into the chat request it
means (``chat_request``): the system prompt first, ``text`` blocks as
content, an assistant's ``tool_use`` blocks as its tool calls, a user's
``tool_result`` blocks as tool messages (before the user's own text),
``tools`` with their ``input_schema`` as functions, ``tool_choice``
auto / any / tool / none as auto / required / named / none,
``stop_sequences`` as stop strings. From there it runs as chat does: one
tokenizer path, one constraint path, one generation.

The answer comes back as content blocks (``message_body``): the
reasoning as a ``thinking`` block (with ``server.reasoning_parser``), the
text, and each tool call as a ``tool_use`` block whose ``input`` is the
call's arguments object; ``stop_reason`` is ``end_turn``, ``max_tokens``,
``stop_sequence`` (with the sequence) or ``tool_use``. Streamed
(``message_events``): ``message_start``, then per block
``content_block_start``, its ``text_delta`` / ``thinking_delta`` /
``input_json_delta`` deltas and ``content_block_stop``, then
``message_delta`` (stop reason, output tokens) and ``message_stop``.
Errors have Anthropic's shape (``error_body``); after a stream's headers an
error is an ``error`` event.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional

from appliance.engine.parallel_sampling import Child
from appliance.server.generation import Generation, map_engine_error
from appliance.server.prompts import joined_text
from appliance.server.protocol import OpenAIError, typed
from appliance.server.responses import ToolOutput, answer_stream, read_answer
from appliance.server.state import ServerState
from appliance.server.tool_requests import foreign_tools
from appliance.server.tools import ContentDelta, ToolCall, ToolCallDelta

FIELDS = frozenset({"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p",
                    "top_k", "tools", "tool_choice", "metadata", "cache_salt"})
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 503: "overloaded_error"}


def error_body(e: OpenAIError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def _message(m: Any, i: int) -> list[dict]:
    """One Anthropic message as chat messages."""
    param = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise _bad(f"{param}.role", f"'{param}.role' must be 'user' or 'assistant'")
    content = m.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise _bad(f"{param}.content", f"'{param}.content' must be a string or a list of content blocks")
    texts, calls, results = [], [], []
    for j, b in enumerate(blocks):
        where = f"{param}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "thinking" and m["role"] == "assistant":
            continue  # an earlier turn's reasoning: chat templates leave it out of the history
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or not isinstance(
                    b.get("input"), dict):
                raise _bad(where, f"'{where}' must be {{'type': 'tool_use', 'id', 'name', 'input' (an object)}}")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        elif kind == "tool_result" and m["role"] == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad(where, f"'{where}' needs a string 'tool_use_id'")
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": joined_text(b.get("content", ""), f"{where}.content")})
        else:
            raise _bad(where, f"'{where}': content blocks of type {str(kind)[:40]!r} are not supported here; this "
                              f"server takes text, and tool_use / tool_result blocks in their roles")
    out: list[dict] = list(results)
    if texts or calls or not results:
        msg: dict = {"role": m["role"], "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(body: dict) -> dict:
    """``tools`` and ``tool_choice`` as chat's fields."""
    out: dict = {}
    tools = foreign_tools(body.get("tools"), lambda t: t.get("type") in (None, "custom"), lambda t: {
        "name": t.get("name"), "parameters": t.get("input_schema"),
        **({"description": t["description"]} if t.get("description") is not None else {})},
        "client tools ({'name', 'description', 'input_schema'})")
    if tools is not None:
        out["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind is not None and choice.get("disable_parallel_tool_use"):
            raise OpenAIError(400, "'tool_choice.disable_parallel_tool_use' is not supported yet",
                              param="tool_choice", code="unsupported_parameter")
        if kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise _bad("tool_choice", "'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or "
                                      "{'type': 'tool', 'name': ...}")
    return out


def chat_request(body: dict) -> dict:
    """The chat completions request a Messages request means (400s name the Anthropic field)."""
    unknown = sorted(k for k in body if k not in FIELDS)
    if unknown:
        raise OpenAIError(400, f"'{unknown[0][:40]}' is not supported on /v1/messages", param=unknown[0][:40],
                          code="unsupported_parameter")
    if body.get("max_tokens") is None:
        raise _bad("max_tokens", "'max_tokens' is required")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "'messages' must be a non-empty list")
    chat: list[dict] = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": joined_text(body["system"], "system")})
    for i, m in enumerate(msgs):
        chat += _message(m, i)
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad("stop_sequences", "'stop_sequences' must be a list of strings")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise _bad("metadata", "'metadata' must be an object")
    out = {"messages": chat, "max_tokens": body["max_tokens"], "stop": stop, "stream": body.get("stream"),
           **{k: body[k] for k in ("temperature", "top_p", "top_k", "cache_salt") if k in body}, **_tools(body)}
    if out["stream"] is not None:
        typed(out, "stream", (bool,))
    return out


# -- the answer ----------------------------------------------------------------------------
def _tool_use(call: ToolCall) -> dict:
    """A call as a tool_use block; arguments that are not a JSON object (a harmony model's calls are its text
    as written) as a text block instead, so nothing is lost."""
    try:
        args = json.loads(call.arguments)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        return {"type": "text", "text": call.arguments}
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name, "input": args}


def _stop(c: Child, called: bool) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a finished output."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _head(st: ServerState, gen: Generation) -> dict:
    return {"id": "msg_" + gen.request_id.removeprefix("msg-"), "type": "message", "role": "assistant",
            "model": st.model_name}


def message_body(st: ServerState, gen: Generation, c: Child, calls: Optional[ToolOutput]) -> dict:
    thought, content, found = read_answer(st, calls, c.text)
    blocks = [] if thought is None else [{"type": "thinking", "thinking": thought, "signature": ""}]
    text = content or ""
    if text or not found:
        blocks.append({"type": "text", "text": text})
    blocks += [_tool_use(call) for call in found]
    reason, sequence = _stop(c, any(b["type"] == "tool_use" for b in blocks))
    return {**_head(st, gen), "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": len(gen.request.prompts[0]), "output_tokens": c.num_output_tokens}}


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks of a streamed answer, one open at a time."""

    def __init__(self) -> None:
        self.index, self.open = -1, None

    def _start(self, block: dict) -> list[str]:
        out = self.close()
        self.index, self.open = self.index + 1, block["type"]
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def add(self, kind: str, piece: str) -> list[str]:
        """``piece`` of a thinking or text block (a new block when another kind is open)."""
        out = [] if self.open == kind else self._start({"type": kind, kind: "", **(
            {"signature": ""} if kind == "thinking" else {})})
        delta = {"type": "thinking_delta", "thinking": piece} if kind == "thinking" else {"type": "text_delta",
                                                                                          "text": piece}
        return out + [_event("content_block_delta", {"index": self.index, "delta": delta})]

    def call(self, d: ToolCallDelta) -> list[str]:
        out = []
        if d.name is not None:
            out = self._start({"type": "tool_use", "id": "toolu_" + (d.id or "").removeprefix("call_"),
                               "name": d.name, "input": {}})
        if d.arguments:
            out.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": d.arguments}}))
        return out


async def message_events(st: ServerState, gen: Generation, calls: Optional[ToolOutput]) -> AsyncIterator[str]:
    prompt_tokens = len(gen.request.prompts[0])
    yield _event("message_start", {"message": {**_head(st, gen), "content": [], "stop_reason": None,
                                               "stop_sequence": None,
                                               "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
    answer = answer_stream(st, calls)
    blocks, child = _Blocks(), gen.parent.children[0]
    try:
        async for child, d in gen.deltas():
            child.add(d)
            thought, pieces = answer.feed(d.new_text, d.finished)
            for e in blocks.add("thinking", thought) if thought else []:
                yield e
            for p in pieces:
                for e in blocks.add("text", p.text) if isinstance(p, ContentDelta) else blocks.call(p):
                    yield e
        for e in blocks.close():
            yield e
        reason, sequence = _stop(child, answer.called)
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": {"output_tokens": child.num_output_tokens}})
        yield _event("message_stop", {})
    except Exception as e:  # after the 200 headers every error is an event
        yield _event("error", {"error": error_body(map_engine_error(e))["error"]})
