"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``). A response is stored unless ``store`` is false
(``server/response_store.py``: per API key, bounded), with its
conversation, so ``previous_response_id`` continues it; a conversation can
as well be carried whole by ``input`` items.

A request is checked at the boundary and turned into the chat request it
means (``chat_request``): ``instructions`` as the system message, ``input``
as a string or items (messages with ``input_text`` / ``output_text`` parts,
``function_call`` items as an assistant's tool calls, ``function_call_output``
items as tool messages; a ``reasoning`` item's text as the next assistant
turn's ``reasoning_content``, which chat templates leave out of the history
and harmony keeps where the turn called a tool), ``max_output_tokens``,
``temperature`` / ``top_p``, function ``tools`` and ``tool_choice``,
``text.format`` (``json_schema`` / ``json_object``: the chat path's output
constraints) and ``reasoning.effort`` (the template's ``reasoning_effort``).
From there it runs as chat does.

The answer (``response_body``) is a response object whose ``output`` items
are the reasoning (with ``server.reasoning_parser``), the message with its
``output_text``, and a ``function_call`` item per call; ``status`` is
``incomplete`` (``max_output_tokens``) when the length ran out. Streamed
(``response_events``), the typed events the official client parses:
``response.created``, ``response.in_progress``, per item
``response.output_item.added``, its parts and deltas
(``response.output_text.delta``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``) and their ``done`` events,
``response.output_item.done``, then ``response.completed`` (or
``response.incomplete``), each with its ``sequence_number``; an error after
the headers is an ``error`` event.
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from appliance.engine.parallel_sampling import Child
from appliance.server.generation import Generation, map_engine_error
from appliance.server.prompts import joined_text
from appliance.server.protocol import OpenAIError, now, usage
from appliance.server.responses import ToolOutput, answer_stream
from appliance.server.state import ServerState
from appliance.server.tool_requests import foreign_tools
from appliance.server.tools import ContentDelta, ToolCallDelta

FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                    "tool_choice", "text", "reasoning", "stream", "store", "metadata", "user", "parallel_tool_calls",
                    "previous_response_id", "cache_salt"})


TEXT_PARTS = ("input_text", "output_text", "text")


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def _items(items: Any) -> list[dict]:
    """``input`` as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input", "'input' must be a string or a non-empty list of items")
    out: list[dict] = []
    thought: dict = {}  # reasoning items' text, as the next assistant turn's reasoning_content
    for i, it in enumerate(items):
        param = f"input[{i}]"
        kind = it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message" and it.get("role") in ("user", "assistant", "system", "developer"):
            text = joined_text(it.get("content"), f"{param}.content", TEXT_PARTS)
            out.append({"role": it["role"], "content": text, **(thought if it["role"] == "assistant" else {})})
            thought = {} if it["role"] == "assistant" else thought
        elif kind == "function_call":
            if not all(isinstance(it.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _bad(param, f"'{param}' (function_call) needs string 'call_id', 'name' and 'arguments'")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not thought:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call], **thought})
                thought = {}
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str) or not isinstance(it.get("output"), str):
                raise _bad(param, f"'{param}' (function_call_output) needs string 'call_id' and 'output'")
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
        elif kind == "reasoning":
            if it.get("content") is not None:
                text = joined_text(it["content"], f"{param}.content", ("reasoning_text",))
                thought = {"reasoning_content": thought.get("reasoning_content", "") + text}
        else:
            raise _bad(param, f"'{param}': items of type {str(kind)[:40]!r} are not supported here; this server takes "
                              f"messages, function_call, function_call_output and reasoning items")
    return out


def _tools(body: dict) -> dict:
    out: dict = {}
    tools = foreign_tools(body.get("tools"), lambda t: t.get("type") == "function",
                          lambda t: {k: t[k] for k in ("name", "description", "parameters", "strict")
                                     if t.get(k) is not None}, "function tools")
    if tools is not None:
        out["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        out["tool_choice"] = choice  # "none" / "auto" / "required", checked as chat checks it
    return out


def _format(body: dict) -> dict:
    text = body.get("text")
    if text is None:
        return {}
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text" and set(text) <= {"format"}:
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        assert isinstance(fmt, dict)  # it has a type
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    raise _bad("text", "'text' must be {'format': {'type': 'text' | 'json_object' | 'json_schema', ...}}")


def chat_request(body: dict, history: Sequence[dict] = ()) -> dict:
    """The chat completions request a Responses request means (400s name the Responses field), after
    ``history``, the chat messages of the stored conversation it continues (``previous_response_id``;
    instructions are each request's own)."""
    unknown = sorted(k for k in body if k not in FIELDS)
    if unknown:
        raise OpenAIError(400, f"'{unknown[0][:40]}' is not supported on /v1/responses", param=unknown[0][:40],
                          code="unsupported_parameter")
    chat = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") is not None else []
    if chat and not isinstance(chat[0]["content"], str):
        raise _bad("instructions", "'instructions' must be a string")
    out = {"messages": chat + list(history) + _items(body.get("input")), **_tools(body), **_format(body),
           **{k: body[k] for k in ("temperature", "top_p", "stream", "cache_salt") if k in body}}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary"}:
            raise _bad("reasoning", "'reasoning' must be {'effort': 'low' | 'medium' | 'high'}")
        if reasoning.get("summary") is not None:
            raise OpenAIError(400, "'reasoning.summary' is not supported yet", param="reasoning",
                              code="unsupported_parameter")
        if reasoning.get("effort") is not None:
            out["reasoning_effort"] = reasoning["effort"]
    return out


# -- the answer ----------------------------------------------------------------------------
def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """A response's output items as they grow: the reasoning, the message, the function calls; ``text``,
    ``call`` and ``close`` return the stream events they make (copies: the items go on growing)."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.open: Optional[dict] = None  # the item taking deltas

    def _event(self, kind: str, **data: Any) -> dict:
        return {"type": kind, **{k: copy.deepcopy(v) if isinstance(v, (dict, list)) else v for k, v in data.items()}}

    def _start(self, item: dict) -> list[dict]:
        out = self.close()
        self.items.append(item)
        self.open = item
        out.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                               item={**item, "status": "in_progress"} if item["type"] != "reasoning" else item))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def text(self, kind: str, piece: str) -> list[dict]:
        """``piece`` of the reasoning (``kind`` reasoning) or the message (message)."""
        out = []
        if self.open is None or self.open["type"] != kind:
            item = ({"type": "reasoning", "id": _item_id("rs"), "summary": [],
                     "content": [{"type": "reasoning_text", "text": ""}]} if kind == "reasoning" else
                    {"type": "message", "id": _item_id("msg"), "status": "completed", "role": "assistant",
                     "content": [{"type": "output_text", "text": "", "annotations": []}]})
            out = self._start(item)
        assert self.open is not None
        self.open["content"][0]["text"] += piece
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self._event(kind_event, item_id=self.open["id"], output_index=len(self.items) - 1,
                                  content_index=0, delta=piece, **extra)]

    def call(self, d: ToolCallDelta) -> list[dict]:
        out = []
        if d.name is not None:
            out = self._start({"type": "function_call", "id": _item_id("fc"), "call_id": d.id, "name": d.name,
                               "arguments": "", "status": "completed"})
        assert self.open is not None and self.open["type"] == "function_call"
        self.open["arguments"] += d.arguments
        if d.arguments:
            out.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                   output_index=len(self.items) - 1, delta=d.arguments))
        return out

    def close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        i = len(self.items) - 1
        out = []
        if item["type"] == "message":
            text = item["content"][0]["text"]
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                part=item["content"][0])]
        elif item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=i,
                                   content_index=0, text=item["content"][0]["text"]))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                   name=item["name"], arguments=item["arguments"]))
        return out + [self._event("response.output_item.done", output_index=i, item=item)]


class _Answer:
    """One output's text (``AnswerStream``) into ``_Output`` items."""

    def __init__(self, st: ServerState, calls: Optional[ToolOutput]):
        self.stream = answer_stream(st, calls)
        self.output = _Output()

    def feed(self, text: str, finished: bool) -> list[dict]:
        thought, pieces = self.stream.feed(text, finished)
        events = self.output.text("reasoning", thought) if thought else []
        for p in pieces:
            events += self.output.text("message", p.text) if isinstance(p, ContentDelta) else self.output.call(p)
        if finished:
            if not any(it["type"] in ("message", "function_call") for it in self.output.items):
                events += self.output.text("message", "")  # an empty answer is an empty message
            events += self.output.close()
        return events


def _response(st: ServerState, gen: Generation, body: dict, created: int, items: list[dict],
              c: Optional[Child]) -> dict:
    """The response object: ``c`` None while it runs."""
    status, incomplete = "in_progress", None
    if c is not None:
        status = "incomplete" if c.finish_reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    u = None
    if c is not None:
        counted = usage(len(gen.request.prompts[0]), c.num_output_tokens, c.num_cached_tokens)
        u = {"input_tokens": counted["prompt_tokens"], "output_tokens": counted["completion_tokens"],
             "total_tokens": counted["total_tokens"], "input_tokens_details": {"cached_tokens": c.num_cached_tokens},
             "output_tokens_details": {"reasoning_tokens": 0}}
    return {"id": "resp_" + gen.request_id.removeprefix("resp-"), "object": "response", "created_at": created,
            "status": status, "model": st.model_name, "output": items, "incomplete_details": incomplete,
            "error": None, "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": True, "text": body.get("text") or {"format": {"type": "text"}},
            "reasoning": body.get("reasoning"), "store": store_wanted(st, body),
            "previous_response_id": body.get("previous_response_id"),
            "metadata": body.get("metadata") or {}, "truncation": "disabled", "user": body.get("user"), "usage": u}


def store_wanted(st: ServerState, body: dict) -> bool:
    """``store`` (true when absent, as OpenAI's); true where nothing is stored is a 400."""
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise _bad("store", "'store' must be a boolean")
    if store and body.get("store") and st.cfg.server.responses_store_max < 1:
        raise OpenAIError(400, "'store': this server keeps no responses (server.responses_store_max=0)",
                          param="store", code="unsupported_parameter")
    return store and st.cfg.server.responses_store_max > 0


def conversation(chat: dict, response: dict) -> list[dict]:
    """The conversation to keep with a response: its chat messages without the instructions, then the answer
    as an assistant turn (its text, calls and reasoning; templates leave the reasoning out)."""
    messages = chat["messages"][1:] if "instructions" in response and response["instructions"] is not None \
        else chat["messages"]

    def texts(kind: str) -> str:
        return "".join(part["text"] for it in response["output"] if it["type"] == kind for part in it["content"])

    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in response["output"] if it["type"] == "function_call"]
    thought = texts("reasoning")
    return [*messages, {"role": "assistant", "content": texts("message"), **({"tool_calls": calls} if calls else {}),
                        **({"reasoning_content": thought} if thought else {})}]


def response_body(st: ServerState, gen: Generation, body: dict, created: int, c: Child,
                  calls: Optional[ToolOutput]) -> dict:
    answer = _Answer(st, calls)
    answer.feed(c.text, True)
    return _response(st, gen, body, created, answer.output.items, c)


def _sse(event: dict, seq: int) -> str:
    return f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': seq}, ensure_ascii=False)}\n\n"


async def response_events(st: ServerState, gen: Generation, body: dict, calls: Optional[ToolOutput],
                          on_done: Optional[Callable[[dict], None]] = None) -> AsyncIterator[str]:
    """The stream; ``on_done`` takes the final response (to store it)."""
    created, seq = now(), 0
    answer = _Answer(st, calls)
    child = gen.parent.children[0]
    for kind in ("response.created", "response.in_progress"):
        yield _sse({"type": kind, "response": _response(st, gen, body, created, [], None)}, seq)
        seq += 1
    try:
        async for child, d in gen.deltas():
            child.add(d)
            for event in answer.feed(d.new_text, d.finished):
                yield _sse(event, seq)
                seq += 1
        final = _response(st, gen, body, created, answer.output.items, child)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        if on_done is not None:
            on_done(final)
        yield _sse({"type": kind, "response": final}, seq)
    except Exception as e:  # after the 200 headers every error is an event
        err = map_engine_error(e)
        yield _sse({"type": "error", "code": str(err.code), "message": err.message, "param": err.param}, seq)
