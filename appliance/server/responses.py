"""Response shaping: whole bodies and SSE chunks of the completions and chat
completions APIs, and their logprobs; each choice's ``stop_reason`` is
vLLM's (the stop string or stop token id that ended it; None for EOS and
length). After the 200 headers of a stream, every error is an error
event, then ``[DONE]``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Optional, Sequence, Union

from appliance.config.architectures import tool_format
from appliance.engine.outputs import TokenLogprob
from appliance.engine.parallel_sampling import Child
from appliance.server.generation import Generation, map_engine_error
from appliance.server.protocol import GenerationRequest, usage
from appliance.server.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningSplit, split
from appliance.server.state import ServerState
from appliance.server.tool_requests import ToolRequest
from appliance.server.tools import ContentDelta, Delta, ToolCall, ToolCallDelta, ToolCallStream, extract_tool_calls

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from appliance.server.harmony import HarmonyAnswer

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


TokenText = Callable[[int], str]


def token_text(tokenizer: PreTrainedTokenizerBase, as_ids: bool = False) -> TokenText:
    """How logprobs show a token: its text, or ``token_id:<id>``
    (``return_tokens_as_token_ids``: a token that is part of a character
    stays identifiable)."""
    if as_ids:
        return lambda tok: f"token_id:{tok}"
    return lambda tok: str(tokenizer.decode([tok]))


def format_logprobs(token_str: TokenText, mode: str, lps: Optional[Sequence[Optional[TokenLogprob]]],
                    text_offset: int) -> dict:
    """``mode`` "chat": ``{"content": [...]}``; "completion": the legacy
    tokens / token_logprobs / top_logprobs / text_offset lists."""
    given = [lp for lp in lps or () if lp is not None]
    if mode == "chat":
        content = []
        for lp in given:
            tok = token_str(lp.token_id)
            content.append({
                "token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
                "top_logprobs": [{"token": (t := token_str(i)), "logprob": v, "bytes": list(t.encode())}
                                 for i, v in lp.top],
            })
        return {"content": content}
    return _legacy_logprobs(token_str, ((lp.token_id, lp) for lp in given), text_offset)


def _legacy_logprobs(token_str: TokenText, entries: Iterable[tuple[int, Optional[TokenLogprob]]],
                     text_offset: int) -> dict:
    """The completions API's tokens / token_logprobs / top_logprobs /
    text_offset lists of (token id, its logprob or None) entries."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok_id, lp in entries:
        tok = token_str(tok_id)
        out["tokens"].append(tok)
        out["token_logprobs"].append(None if lp is None else lp.logprob)
        top = None
        if lp is not None:
            top = {token_str(i): v for i, v in lp.top}
            top.setdefault(tok, lp.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(tok)
    return out


def format_prompt_logprobs(tokenizer: PreTrainedTokenizerBase,
                           lps: Optional[Sequence[Optional[TokenLogprob]]]) -> Optional[list[Optional[dict]]]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first None) a map of
    token id to its logprob, rank and text: the prompt token and the top candidates."""
    if lps is None:
        return None
    out: list[Optional[dict]] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(i): {"logprob": v, "rank": r, "decoded_token": tokenizer.decode([i])}
                 for r, (i, v) in enumerate(lp.top, 1)}
        entry.setdefault(str(lp.token_id), {"logprob": lp.logprob, "rank": lp.rank,
                                            "decoded_token": tokenizer.decode([lp.token_id])})
        out.append(entry)
    return out


def echo_logprobs(token_str: TokenText, prompt_ids: list[int],
                  prompt_lps: Optional[Sequence[Optional[TokenLogprob]]], output: dict) -> dict:
    """The completions API's logprobs of an echoed prompt (the first token's
    None, as OpenAI's), then ``output``'s (``format_logprobs``, offsets after the prompt)."""
    lps = list(prompt_lps or ())
    lps += [None] * (len(prompt_ids) - len(lps))
    out = _legacy_logprobs(token_str, zip(prompt_ids, lps), 0)
    for key, values in output.items():
        out[key] += values
    return out


def _kv_transfer(g: GenerationRequest, children: list[Child]) -> dict:
    """vLLM's top-level ``kv_transfer_params`` of a response to a request
    that carried them: a producer's says where the prompt's KV is (null when
    it holds none, e.g. the request was cut)."""
    return {"kv_transfer_params": children[0].kv_transfer_params} if g.params.kv_transfer_params is not None else {}


def _head(st: ServerState, gen: Generation, obj: str, created: int) -> dict[str, Union[str, int]]:
    return {"id": gen.request_id, "object": obj, "created": created, "model": st.model_name}


# -- /v1/completions -------------------------------------------------------------
def _completion_logprobs(st: ServerState, g: GenerationRequest, prompt_index: int,
                         lps: Optional[Sequence[Optional[TokenLogprob]]],
                         prompt_lps: Optional[Sequence[Optional[TokenLogprob]]], offset: int,
                         echoed: bool) -> Optional[dict]:
    """A choice's (or chunk's) ``logprobs``: with the echoed prompt's first when ``echoed``."""
    if not g.logprobs_mode:
        return None
    token_str = token_text(st.tokenizer, g.tokens_as_ids)
    out = format_logprobs(token_str, "completion", lps, offset)
    return echo_logprobs(token_str, g.prompts[prompt_index], prompt_lps, out) if echoed else out


def completion_body(st: ServerState, gen: Generation, created: int, children: list[Child],
                    echo_text: list[str]) -> dict:
    g = gen.request
    prompt_tokens = sum(len(p) for p in g.prompts)
    choices = []
    for c in children:
        choice = {"index": c.index, "text": echo_text[c.prompt_index] + c.text,
                  "logprobs": _completion_logprobs(st, g, c.prompt_index, c.logprobs, c.prompt_logprobs,
                                                   len(echo_text[c.prompt_index]), g.echo),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if g.prompt_logprobs:
            choice["prompt_logprobs"] = format_prompt_logprobs(st.tokenizer, c.prompt_logprobs)
        if g.return_token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = g.prompts[c.prompt_index], c.token_ids
        choices.append(choice)
    return {
        **_head(st, gen, "text_completion", created),
        "choices": choices,
        "usage": usage(prompt_tokens, sum(c.num_output_tokens for c in children),
                       sum(c.num_cached_tokens for c in children)),
        **_kv_transfer(g, children),
    }


@dataclass
class _UsageSoFar:
    """``stream_options.continuous_usage_stats``: the prompt's tokens and
    each choice's output tokens so far, for the usage every chunk carries."""

    prompt_tokens: int
    tokens: dict[int, int] = field(default_factory=dict)  # choice index -> its output tokens so far


def _usage_field(so_far: Optional[_UsageSoFar]) -> dict:
    return {} if so_far is None else {"usage": usage(so_far.prompt_tokens, sum(so_far.tokens.values()))}


async def completion_events(st: ServerState, gen: Generation, created: int, echo_text: list[str]) -> AsyncIterator[str]:
    g = gen.request
    head = _head(st, gen, "text_completion", created)
    prompt_tokens = sum(len(p) for p in g.prompts)
    completion_tokens = 0
    so_far = _UsageSoFar(prompt_tokens) if g.continuous_usage else None
    sent_echo: set[int] = set()
    ids_sent: set[int] = set()  # choices whose prompt token ids went out
    offsets: dict[int, int] = {}
    try:
        async for child, d in gen.deltas():
            if so_far is not None:
                so_far.tokens[child.index] = d.num_output_tokens
            text = d.new_text
            off = offsets.get(child.index, 0)
            # the prompt is echoed with the first delta that has its logprobs (when the request wants them)
            echoed = g.echo and child.index not in sent_echo and (
                not g.logprobs_mode or d.prompt_logprobs is not None or d.finished)
            if echoed:
                text = echo_text[child.prompt_index] + text
                sent_echo.add(child.index)
                off = 0
            offsets[child.index] = off + len(text)
            if d.finished:
                completion_tokens += d.num_output_tokens
            if not text and not d.finished and not d.logprobs and not (g.return_token_ids and d.new_token_ids):
                continue
            choice = {
                "index": child.index, "text": text,
                "logprobs": _completion_logprobs(st, g, child.prompt_index, d.logprobs, d.prompt_logprobs,
                                                 off + len(echo_text[child.prompt_index]) if echoed else off, echoed),
                "finish_reason": d.finish_reason if d.finished else None,
                "stop_reason": d.stop_reason if d.finished else None}
            if g.return_token_ids:  # the prompt's ids with a choice's first chunk, each chunk's own output ids
                choice["prompt_token_ids"] = g.prompts[child.prompt_index] if child.index not in ids_sent else None
                choice["token_ids"] = d.new_token_ids
                ids_sent.add(child.index)
            yield sse({**head, "choices": [choice], **_usage_field(so_far)})
        if g.include_usage:
            yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    except Exception as e:  # after the 200 headers every error is an event, then [DONE]
        yield sse(map_engine_error(e).body())
    yield DONE


# -- /v1/chat/completions --------------------------------------------------------
@dataclass(frozen=True)
class ToolOutput:
    """How a request with tools reads calls from its text: ``mode`` auto (the
    ``parser``'s format, among content), required (a JSON array of calls) or
    named (the text is ``function``'s arguments)."""

    mode: str
    parser: str
    function: Optional[str]

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.mode, self.parser, self.function)

    def finish_reason(self, reason: Optional[str], called: bool) -> Optional[str]:
        """"tool_calls" when calls ended the turn (a forced named call keeps "stop", as OpenAI's)."""
        return "tool_calls" if called and reason == "stop" and self.mode != "named" else reason


def reasoning_parser(st: ServerState) -> Optional[ReasoningParser]:
    name = st.cfg.server.reasoning_parser
    return None if name is None else REASONING_PARSERS[str(name)]


def tool_output(st: ServerState, tools: Optional[ToolRequest]) -> Optional[ToolOutput]:
    """How a request's tool calls are read (None: it offers none, or ``tool_choice: "none"``)."""
    if tools is None or tools.choice == "none":
        return None
    return ToolOutput(tools.choice, tool_format(st.cfg.model.architecture, st.cfg.server.tool_parser), tools.function)


def read_answer(st: ServerState, calls: Optional[ToolOutput], text: str
                ) -> tuple[Optional[str], Optional[str], list[ToolCall]]:
    """A whole output's (reasoning, None when it has none or no parser reads it; the answer's content; its
    tool calls): with a reasoning parser and the request's tool format, or a harmony model's messages, exactly
    as streaming it reassembles."""
    if st.harmony is not None:
        return _whole(answer_stream(st, calls), text)
    thought, reasoning = None, reasoning_parser(st)
    if reasoning is not None:
        thought, text = split(reasoning, text)
    if calls is None:
        return thought, text, []
    content, found = extract_tool_calls(calls.mode, calls.parser, calls.function, text)
    return thought, content, found


def _whole(answer: AnswerStream, text: str) -> tuple[Optional[str], Optional[str], list[ToolCall]]:
    thought, pieces = answer.feed(text, True)
    content = "".join(p.text for p in pieces if isinstance(p, ContentDelta))
    found: list[ToolCall] = []
    for p in pieces:
        if isinstance(p, ToolCallDelta) and p.name is not None:
            found.append(ToolCall(p.id or "", p.name, p.arguments))
        elif isinstance(p, ToolCallDelta):
            found[p.index].arguments += p.arguments
    return thought or None, content or (None if found else ""), found


def _message(st: ServerState, text: str, calls: Optional[ToolOutput]) -> tuple[dict, bool]:
    """The assistant message of an output: its reasoning apart (with a reasoning parser, or a harmony
    model's), then its content and tool calls."""
    thought, content, found = read_answer(st, calls, text)
    msg: dict = {"role": "assistant", "content": content if content or thought is None else None}
    if st.harmony is not None or reasoning_parser(st) is not None:
        msg["reasoning_content"] = thought
    if found:
        msg["tool_calls"] = [c.to_openai() for c in found]
    return msg, bool(found)


def chat_body(st: ServerState, gen: Generation, created: int, children: list[Child],
              calls: Optional[ToolOutput] = None) -> dict:
    g = gen.request
    token_str = token_text(st.tokenizer, g.tokens_as_ids)
    choices = []
    for c in children:
        msg, called = _message(st, c.text, calls)
        choice = {"index": c.index, "message": msg,
                  "logprobs": format_logprobs(token_str, "chat", c.logprobs, 0) if g.logprobs_mode else None,
                  "finish_reason": calls.finish_reason(c.finish_reason, called) if calls else c.finish_reason,
                  "stop_reason": c.stop_reason}
        if g.return_token_ids:
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    body: dict[str, Any] = {
        **_head(st, gen, "chat.completion", created),
        "choices": choices,
        "usage": usage(len(g.prompts[0]), sum(c.num_output_tokens for c in children),
                       max((c.num_cached_tokens for c in children), default=0)),
    }
    if g.return_token_ids:
        body["prompt_token_ids"] = g.prompts[0]
    if gen.request.prompt_logprobs:  # the children share the prompt
        body["prompt_logprobs"] = format_prompt_logprobs(st.tokenizer, children[0].prompt_logprobs)
    return {**body, **_kv_transfer(gen.request, children)}


class AnswerStream:
    """One output's text, fed as it arrives, as its reasoning (with a
    reasoning parser) and its answer's pieces: text, or with tools the
    content and tool-call deltas the answer completes; a harmony model's
    messages read by ``harmony``. Chat, Messages and Responses stream
    through it (``answer_stream``)."""

    def __init__(self, reasoning: Optional[ReasoningParser], calls: Optional[ToolOutput],
                 harmony: Optional[HarmonyAnswer] = None):
        self.harmony = harmony
        self.thinking = ReasoningSplit(reasoning) if reasoning is not None else None
        self.tools = calls.stream() if calls is not None and harmony is None else None

    def feed(self, text: str, finished: bool) -> tuple[str, list[Delta]]:
        if self.harmony is not None:
            return self.harmony.feed(text, finished)
        thought = ""
        if self.thinking is not None:
            thought, text = self.thinking.feed(text) if text else ("", "")
            if finished:
                more, rest = self.thinking.finish()
                thought, text = thought + more, text + rest
        if self.tools is None:
            return thought, [ContentDelta(text)] if text else []
        return thought, (self.tools.feed(text) if text else []) + (self.tools.finish() if finished else [])

    @property
    def called(self) -> bool:
        """Tool calls were read from the answer."""
        if self.harmony is not None:
            return self.harmony.called
        return self.tools is not None and bool(self.tools.calls)


def answer_stream(st: ServerState, calls: Optional[ToolOutput]) -> AnswerStream:
    """How this model's outputs are read: harmony's messages, or the reasoning parser and the tool format."""
    if st.harmony is not None:
        return AnswerStream(None, calls, st.harmony.answer(calls is not None))
    return AnswerStream(reasoning_parser(st), calls)


def _chat_deltas(text: str, finished: bool, answer: AnswerStream) -> list[dict]:
    """The ``delta`` objects of one engine delta: its reasoning, then its answer's pieces."""
    thought, pieces = answer.feed(text, finished)
    return ([{"reasoning_content": thought}] if thought else []) + [
        {"content": p.text} if isinstance(p, ContentDelta) else {"tool_calls": [p.to_openai()]} for p in pieces]


async def chat_events(st: ServerState, gen: Generation, created: int,
                      calls: Optional[ToolOutput] = None) -> AsyncIterator[str]:
    g = gen.request
    head = _head(st, gen, "chat.completion.chunk", created)
    so_far = _UsageSoFar(len(g.prompts[0])) if g.continuous_usage else None
    token_str = token_text(st.tokenizer, g.tokens_as_ids)
    for k in range(g.params.n):
        first = {"prompt_token_ids": g.prompts[0]} if g.return_token_ids else {}  # with each choice's role chunk
        yield sse({**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None, "stop_reason": None}], **first,
                   **_usage_field(so_far)})
    completion_tokens = 0
    answers = {k: answer_stream(st, calls) for k in range(g.params.n)}
    try:
        async for child, d in gen.deltas():
            if so_far is not None:
                so_far.tokens[child.index] = d.num_output_tokens
            if d.finished:
                completion_tokens += d.num_output_tokens
            answer = answers[child.index]
            deltas = _chat_deltas(d.new_text, d.finished, answer)
            if not deltas and not d.finished and not d.logprobs and not (g.return_token_ids and d.new_token_ids):
                continue
            deltas = deltas or [{}]
            reason = d.finish_reason
            if calls is not None and d.finished:
                reason = calls.finish_reason(reason, answer.called)
            for j, delta in enumerate(deltas):
                last = j == len(deltas) - 1
                choice = {
                    "index": child.index, "delta": delta,
                    "logprobs": format_logprobs(token_str, "chat", d.logprobs, 0) if g.logprobs_mode and j == 0
                    else None,
                    "finish_reason": reason if d.finished and last else None,
                    "stop_reason": d.stop_reason if d.finished and last else None}
                if g.return_token_ids:  # the engine delta's ids go with its first chunk
                    choice["token_ids"] = d.new_token_ids if j == 0 else []
                yield sse({**head, "choices": [choice], **_usage_field(so_far)})
        if g.include_usage:
            yield sse({**head, "choices": [], "usage": usage(len(g.prompts[0]), completion_tokens)})
    except Exception as e:  # after the 200 headers every error is an event, then [DONE]
        yield sse(map_engine_error(e).body())
    yield DONE
