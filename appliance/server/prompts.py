"""Prompts of a request: the prompt-character limit (before tokenizing),
tokenization and chat templates on the tokenizer threads, and the context
length check."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any, Callable, Optional, TypeVar, cast

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
    add_special = typed(body, "add_special_tokens", (bool,), True)
    for it in items:
        if isinstance(it, str):
            if not it:
                raise OpenAIError(400, "'prompt' must not be empty", param="prompt")
            ids = st.tokenizer.encode(it, add_special_tokens=add_special)
            if not ids:
                raise OpenAIError(400, "'prompt' encodes to no tokens", param="prompt")
            prompts.append(ids)
            texts.append(it)
        else:
            prompts.append(list(token_id_list(it, "prompt", vocab)))
            texts.append(None)
    return prompts, texts


def tokenize_prompt(st: ServerState, body: dict, tools: Optional[list[dict]] = None) -> list[int]:
    """/tokenize's ids: of ``prompt`` (``add_special_tokens``, default
    true), or of ``messages`` through the chat template as chat requests
    render them (``add_special_tokens`` default false: the template writes them)."""
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise OpenAIError(400, "give 'prompt' or 'messages', not both", param="prompt")
        return chat_prompt(st, body, tools)[0]
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise OpenAIError(400, "'prompt' (a string) or 'messages' is required", param="prompt")
    return st.tokenizer.encode(prompt, add_special_tokens=typed(body, "add_special_tokens", (bool,), True))


def joined_text(content: Any, param: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A string, or a list of text parts (``{"type": one of kinds, "text": ...}``), as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(400, f"'{param}' must be a string or a list of text parts", param=param)
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in kinds or not isinstance(p.get("text"), str):
            raise OpenAIError(400, f"'{param}[{j}]' must be a text part ({{'type': {' or '.join(map(repr, kinds))}, "
                                   f"'text': ...}})", param=f"{param}[{j}]")
        parts.append(p["text"])
    return "".join(parts)


def _tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's ``tool_calls``, checked: ``{"id", "name", "arguments"}`` each (the arguments as
    the client's JSON text)."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise OpenAIError(400, f"'{param}' must be a list", param=param)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise OpenAIError(400, f"'{param}[{j}]' must be {{'id', 'type': 'function', 'function': {{'name', "
                                   f"'arguments' (a JSON string)}}}}", param=f"{param}[{j}]")
        out.append({"id": c.get("id"), "name": fn["name"], "arguments": fn["arguments"]})
    return out


def _template_calls(calls: list[dict]) -> list[dict]:
    """Tool calls as chat templates read them: arguments as an object where they parse (templates print them
    as JSON)."""
    out = []
    for c in calls:
        try:
            args: Any = json.loads(c["arguments"])
        except ValueError:
            args = c["arguments"]
        out.append({"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": args}})
    return out


def conversation(body: dict) -> list[dict]:
    """The request's ``messages``, checked: each a role (system, developer, user, assistant or tool) and its
    content as one text; an assistant's ``tool_calls`` (``_tool_calls``) and ``reasoning_content``; a tool
    result's ``tool_call_id`` and ``name``."""
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
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if m["role"] == "assistant":
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
            if isinstance(m.get("reasoning_content"), str):
                msg["reasoning_content"] = m["reasoning_content"]
        if m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise OpenAIError(400, f"messages[{i}] (role tool) needs a string 'tool_call_id'",
                                  param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = call_id
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        conv.append(msg)
    return conv


def chat_prompt(st: ServerState, body: dict, tools: Optional[list[dict]] = None) -> tuple[list[int], str]:
    """The prompt of a chat request: its messages (and ``tools``) through the model's chat format, harmony's
    (``st.harmony``) or the chat template."""
    conv = conversation(body)
    harmony = st.harmony
    if harmony is not None:
        return harmony.prompt(conv, body, tools)
    for msg in conv:  # as templates take them: a developer's message is a system message, no reasoning
        msg.pop("reasoning_content", None)
        if msg["role"] == "developer":
            msg["role"] = "system"
        if "tool_calls" in msg:
            msg["tool_calls"] = _template_calls(msg["tool_calls"])
    add_gen = typed(body, "add_generation_prompt", (bool,), True)
    cont = typed(body, "continue_final_message", (bool,), False)
    if cont and (add_gen or conv[-1]["role"] != "assistant"):
        raise OpenAIError(400, "'continue_final_message' continues a last assistant message; it needs "
                               "'add_generation_prompt': false", param="continue_final_message")
    kwargs = template_kwargs(st.tokenizer, body, tools)
    try:
        text = str(st.tokenizer.apply_chat_template(conv, tools=cast(Any, tools), tokenize=False,
                                                    add_generation_prompt=add_gen, continue_final_message=cont,
                                                    **kwargs))
    except Exception as e:
        raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    add_special = typed(body, "add_special_tokens", (bool,), False)  # the template writes them
    return st.tokenizer.encode(text, add_special_tokens=add_special), text


# apply_chat_template's own arguments and what it hands every template: a request sets them through their own
# fields, never through chat_template_kwargs
TEMPLATE_RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
REASONING_EFFORTS = ("low", "medium", "high")


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads from outside itself."""
    from jinja2 import meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    env = _compile_jinja_template(template).environment
    return frozenset(meta.find_undeclared_variables(env.parse(template)))


def template_kwargs(tokenizer: Any, body: dict, tools: Optional[list[dict]]) -> dict:
    """``chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``) and
    ``reasoning_effort``, as variables of the chat template; one the
    template does not read is refused (a typo must not pass unnoticed)."""
    kwargs = dict(typed(body, "chat_template_kwargs", (dict,), {}))
    effort = typed(body, "reasoning_effort", (str,))
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise OpenAIError(400, f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got "
                                   f"{effort[:40]!r}", param="reasoning_effort")
        if kwargs.get("reasoning_effort", effort) != effort:
            raise OpenAIError(400, "'reasoning_effort' and 'chat_template_kwargs.reasoning_effort' disagree",
                              param="reasoning_effort")
        kwargs["reasoning_effort"] = effort
    if not kwargs:
        return {}
    try:
        known = template_variables(tokenizer.get_chat_template(None, tools))
    except Exception as e:
        raise OpenAIError(400, f"this model's chat template cannot be read: {e}", param="messages") from None
    for key in kwargs:
        param = "reasoning_effort" if key == "reasoning_effort" and effort is not None else "chat_template_kwargs"
        if key in TEMPLATE_RESERVED:
            raise OpenAIError(400, f"'chat_template_kwargs.{key[:40]}' is set by the server, from the request's own "
                                   f"fields", param=param)
        if key not in known:
            reads = ", ".join(sorted(known - TEMPLATE_RESERVED)) or "nothing else"
            raise OpenAIError(400, f"this model's chat template does not read {key[:40]!r} (it reads: {reads})",
                              param=param)
    return kwargs


def truncated(prompts: list[list[int]], texts: list[Optional[str]], keep: Optional[int]) -> None:
    """Each prompt cut to its last ``keep`` tokens (``truncate_prompt_tokens``;
    a cut prompt's text is dropped: it no longer says what runs)."""
    if keep is None:
        return
    for i, ids in enumerate(prompts):
        if len(ids) > keep:
            prompts[i], texts[i] = ids[-keep:], None


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
