"""Prompts of a request: the prompt-character limit (before tokenizing),
tokenization and chat templates on the tokenizer threads, and the context
length check."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Optional, TypeVar

from appliance.sampling_params import SamplingParams
from appliance.server.protocol import MAX_PROMPTS, OpenAIError, typed, token_id_list
from appliance.server.state import ServerState

T = TypeVar("T")


def check_prompt_chars(st: ServerState, body: dict, chat: bool) -> None:
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


async def tokenize(st: ServerState, build: Callable[..., T], body: dict, chat: bool, *args: Any) -> T:
    """``build(st, body, *args)`` (tokenization, chat template) on the tokenizer pool, so
    the event loop keeps streaming while a long prompt is encoded."""
    check_prompt_chars(st, body, chat)
    return await asyncio.get_running_loop().run_in_executor(st.tokenize_pool, build, st, body, *args)


def completion_prompts(st: ServerState, body: dict) -> tuple[list[list[int]], list[Optional[str]]]:
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
    prompts: list[list[int]] = []
    texts: list[Optional[str]] = []
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


def _tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's ``tool_calls`` for the chat template: arguments
    as an object where they parse (templates print them as JSON)."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise OpenAIError(400, f"'{param}' must be a list", param=param)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise OpenAIError(400, f"'{param}[{j}]' must be {{'id', 'type': 'function', 'function': {{'name', "
                                   f"'arguments' (a JSON string)}}}}", param=f"{param}[{j}]")
        try:
            args: Any = json.loads(fn["arguments"])
        except ValueError:
            args = fn["arguments"]
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def chat_prompt(st: ServerState, body: dict, tools: Optional[list[dict]] = None) -> tuple[list[int], str]:
    """The chat template over the messages (and the request's ``tools``)."""
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
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise OpenAIError(400, f"messages[{i}] (role tool) needs a string 'tool_call_id'",
                                  param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = call_id
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        conv.append(msg)
    add_gen = typed(body, "add_generation_prompt", (bool,), True)
    try:
        text = st.tokenizer.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=add_gen)
    except Exception as e:
        raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return st.tokenizer.encode(text, add_special_tokens=False), text


def check_length(st: ServerState, prompt_len: int, params: SamplingParams, what: str) -> None:
    """The prompt and the completion must fit in max_model_len; an unset
    max_tokens becomes what is left."""
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
