"""gpt-oss's chat format, harmony, through ``openai-harmony``: an
architecture whose row says ``chat_format="harmony"`` gets its chat prompts
rendered and its outputs read here, on every chat API (chat completions,
Responses, Messages, /tokenize).

The prompt: a system message (the model identity and knowledge cutoff
harmony writes, today's date, the request's ``reasoning_effort``, medium
unless it says), a developer message (the request's leading system and
developer messages as its instructions, its ``tools`` as the ``functions``
namespace; none under ``tool_choice: "none"``), then the conversation: a
user message as it is; an assistant message's ``reasoning_content`` on the
analysis channel, its content on the final channel (commentary when it
calls tools), each tool call on commentary to ``functions.NAME``; a tool
result from ``functions.NAME`` (the call its ``tool_call_id`` names) to
the assistant. Harmony drops earlier turns' analysis once an answer
followed it. A tokenizer that is harmony's own vocabulary (a gpt-oss
checkpoint's) takes harmony's token ids as they are, so a message's text
never turns into special tokens; another (the tests' tiny models) encodes
the rendered text.

The output: generation stops at ``<|return|>`` (the answer is done) or
``<|call|>`` (a tool is called) and keeps its special tokens, so its text
is harmony messages; ``HarmonyAnswer`` reads them in pieces as they arrive
with harmony's ``StreamableParser``: the analysis channel is the
reasoning, a message to ``functions.NAME`` a call of NAME (when the request
offered tools), any other message content. Text that stops parsing as
harmony (a model that wrote no header) is content from there on, the
header text it had read included: nothing is lost.

The vocabulary: openai-harmony reads ``o200k_base.tiktoken`` from
``TIKTOKEN_ENCODINGS_BASE`` (or downloads it); where that is unset and the
model's tokenizer is gpt-oss's, the file is written from the tokenizer
into the appliance cache and checked against its published SHA-256, so an
air-gapped deployment needs nothing more (``scripts/harmony_vocab.py``
writes it elsewhere).
"""

from __future__ import annotations

import base64
import datetime
import functools
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from appliance.config.architectures import chat_format
from appliance.server.protocol import OpenAIError, typed
from appliance.server.tools import ContentDelta, Delta, ToolCallDelta, call_id

VOCAB_ENV = "TIKTOKEN_ENCODINGS_BASE"
VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
VOCAB_RANKS = 199998  # o200k_base's ordinary tokens; harmony's special tokens follow
STOP_TOKENS = ("<|return|>", "<|call|>")
REASONING_START, ANSWER_START = "<|channel|>analysis<|message|>", "<|channel|>final<|message|>"
FUNCTIONS = "functions."
EFFORTS = {"low": "LOW", "medium": "MEDIUM", "high": "HIGH"}
_PARTIAL_SPECIAL = re.compile(r"<(\|[a-z_0-9]*\|?)?$")  # a special token's beginning, at the end of a piece


class HarmonyUnavailable(RuntimeError):
    """openai-harmony cannot load its vocabulary."""


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's characters back to the bytes they stand for (GPT-2's table: a printable byte is its
    own character, the others 256 onwards in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


def derived_vocab(tokenizer: Any) -> Optional[bytes]:
    """``o200k_base.tiktoken`` written from a byte-level BPE tokenizer whose
    first ranks are o200k_base's (gpt-oss's); None for any other tokenizer."""
    vocab = tokenizer.get_vocab()
    if len(vocab) < VOCAB_RANKS:
        return None
    by_id: list[Optional[str]] = [None] * VOCAB_RANKS
    for token, i in vocab.items():
        if i < VOCAB_RANKS:
            by_id[i] = token
    decoder, lines = _byte_decoder(), []
    for i, token in enumerate(by_id):
        if token is None or any(c not in decoder for c in token):
            return None
        lines.append(base64.b64encode(bytes(decoder[c] for c in token)) + b" %d\n" % i)
    data = b"".join(lines)
    return data if hashlib.sha256(data).hexdigest() == VOCAB_SHA256 else None


def load_encoding(tokenizer: Any, cache: Path) -> tuple[Any, bool]:
    """openai-harmony's gpt-oss encoding, and whether ``tokenizer`` is its
    vocabulary (its token ids are harmony's)."""
    from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding

    data = derived_vocab(tokenizer)
    if data is not None and VOCAB_ENV not in os.environ:
        folder = cache / "harmony"  # beside the models
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / VOCAB_FILE
        if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != VOCAB_SHA256:
            tmp = folder / f"{VOCAB_FILE}.{os.getpid()}"
            tmp.write_bytes(data)
            tmp.replace(path)
        os.environ[VOCAB_ENV] = str(folder)
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS), data is not None
    except HarmonyError as e:
        where = os.environ.get(VOCAB_ENV)
        raise HarmonyUnavailable(
            f"gpt-oss's chat format (harmony) needs openai-harmony's vocabulary, {VOCAB_FILE} (SHA-256 "
            f"{VOCAB_SHA256[:12]}...), which " + (f"{VOCAB_ENV}={where} does not hold: {e}" if where else
                                                  f"could not be downloaded ({e}) and this model's tokenizer is "
                                                  f"not gpt-oss's") +
            f". Set {VOCAB_ENV} to a folder holding it (python scripts/harmony_vocab.py FOLDER writes one)."
        ) from None


def harmony_chat(cfg: Any, tokenizer: Any) -> Optional[HarmonyChat]:
    """The chat format of ``cfg``'s model when it is harmony's (None: it has a chat template);
    ``HarmonyUnavailable`` when openai-harmony cannot load."""
    if chat_format(cfg.model.architecture) != "harmony":
        return None
    from appliance.models.loader import cache_dir

    return HarmonyChat.load(tokenizer, cache_dir().parent)


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


@dataclass
class HarmonyChat:
    """The harmony format for one model's tokenizer."""

    encoding: Any
    tokenizer: Any
    native: bool  # the tokenizer's ids are harmony's
    stop_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, tokenizer: Any, cache: Path) -> HarmonyChat:
        encoding, native = load_encoding(tokenizer, cache)
        ids = []
        for t in STOP_TOKENS:
            i = tokenizer.convert_tokens_to_ids(t)
            if not isinstance(i, int) or i == tokenizer.unk_token_id:
                raise HarmonyUnavailable(f"this model's tokenizer has no {t} token: harmony's outputs end with it")
            ids.append(i)
        native = native and set(ids) == set(encoding.stop_tokens_for_assistant_actions())
        return cls(encoding, tokenizer, native, tuple(ids))

    # -- the request ------------------------------------------------------------------------
    def check_request(self, body: dict, tool_choice: Optional[str]) -> None:
        """What this format's generation does not take (before the request's output constraint is made; the
        prompt's fields are ``prompt``'s)."""
        if tool_choice in ("required", "named"):
            raise _bad("tool_choice", "tool_choice 'required' or a named function is not built yet for gpt-oss's "
                                      "chat format (harmony): use 'auto' or 'none'")
        if body.get("skip_special_tokens") is True:
            raise _bad("skip_special_tokens", "harmony's messages are read from their special tokens: "
                                              "'skip_special_tokens' must be false or unset on this model")

    def adjust(self, params: Any) -> None:
        """Sampling as harmony needs it: its special tokens kept in the text, and stops at the end of an
        answer or a call."""
        params.skip_special_tokens = False
        params.stop_token_ids = list(dict.fromkeys([*params.stop_token_ids, *self.stop_token_ids]))

    def prompt(self, conv: list[dict], body: dict, tools: Optional[list[dict]]) -> tuple[list[int], str]:
        """The prompt's token ids and text for ``conv`` (``prompts.conversation``'s messages); the fields of a
        chat template's prompt refused (chat requests and /tokenize alike)."""
        from openai_harmony import Conversation, Role

        if body.get("chat_template_kwargs"):
            raise _bad("chat_template_kwargs", "this model's chat format is harmony, not a chat template: it "
                                               "reads no template variables ('reasoning_effort' sets its effort)")
        if body.get("continue_final_message"):
            raise _bad("continue_final_message", "continuing a final message is not built yet for gpt-oss's chat "
                                                 "format (harmony)")
        if body.get("add_special_tokens") is True:
            raise _bad("add_special_tokens", "openai-harmony writes every special token of this model's prompts: "
                                             "'add_special_tokens' must be false or unset on this model")

        if "none" in (body.get("tool_choice"), body.get("function_call")):  # the model is not told of them
            tools = None
        messages = self._messages(conv, body, tools)
        try:
            if typed(body, "add_generation_prompt", (bool,), True):
                ids = self.encoding.render_conversation_for_completion(Conversation.from_messages(messages),
                                                                       Role.ASSISTANT)
            else:
                ids = self.encoding.render_conversation(Conversation.from_messages(messages))
        except Exception as e:  # openai-harmony's HarmonyError (a tool schema it cannot write, ...)
            raise _bad("messages", f"openai-harmony cannot render this conversation: {str(e)[:200]}") from None
        text = self.encoding.decode_utf8(ids)
        if self.native:
            return list(ids), text
        return self.tokenizer.encode(text, add_special_tokens=False), text

    def _messages(self, conv: list[dict], body: dict, tools: Optional[list[dict]]) -> list[Any]:
        from openai_harmony import (Author, DeveloperContent, Message, ReasoningEffort, Role, SystemContent,
                                    ToolDescription)

        effort = typed(body, "reasoning_effort", (str,)) or "medium"
        if effort not in EFFORTS:
            raise _bad("reasoning_effort", f"'reasoning_effort' must be one of {', '.join(EFFORTS)}, got "
                                           f"{str(effort)[:40]!r}")
        system = (SystemContent.new().with_reasoning_effort(getattr(ReasoningEffort, EFFORTS[effort]))
                  .with_conversation_start_date(datetime.date.today().isoformat()))
        out = [Message.from_role_and_content(Role.SYSTEM, system)]
        lead = 0
        while lead < len(conv) and conv[lead]["role"] in ("system", "developer"):
            lead += 1
        developer = DeveloperContent.new()
        if lead:
            developer = developer.with_instructions("\n\n".join(m["content"] for m in conv[:lead]))
        if tools:
            developer = developer.with_function_tools([
                ToolDescription.new(t["function"]["name"], t["function"].get("description") or "",
                                    parameters=t["function"].get("parameters")) for t in tools])
        if lead or tools:
            out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
        names: dict[str, str] = {}  # tool call id -> function name
        for i, m in enumerate(conv[lead:], lead):
            role, text = m["role"], m["content"]
            if role in ("system", "developer"):
                out.append(Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(text)))
            elif role == "user":
                out.append(Message.from_role_and_content(Role.USER, text))
            elif role == "tool":
                name = m.get("name") or names.get(m["tool_call_id"])
                if name is None:
                    raise _bad(f"messages[{i}].tool_call_id", f"messages[{i}] answers a tool call "
                               f"({m['tool_call_id'][:40]!r}) that no earlier assistant message made; give its "
                               f"function's 'name'")
                out.append(Message.from_author_and_content(Author.new(Role.TOOL, FUNCTIONS + name), text)
                           .with_recipient("assistant").with_channel("commentary"))
            else:
                calls = m.get("tool_calls") or []
                if m.get("reasoning_content"):
                    out.append(Message.from_role_and_content(Role.ASSISTANT, m["reasoning_content"])
                               .with_channel("analysis"))
                if text:
                    out.append(Message.from_role_and_content(Role.ASSISTANT, text)
                               .with_channel("commentary" if calls else "final"))
                for c in calls:
                    names[c["id"]] = c["name"]
                    out.append(Message.from_role_and_content(Role.ASSISTANT, c["arguments"]).with_channel("commentary")
                               .with_recipient(FUNCTIONS + c["name"]).with_content_type("json"))
        return out

    def answer(self, tools: bool) -> HarmonyAnswer:
        return HarmonyAnswer(self.encoding, tools)


class HarmonyAnswer:
    """One output's text, fed in pieces, as its reasoning and its answer's
    pieces (content, and tool calls when ``tools``): ``AnswerStream``'s
    reading for a harmony model."""

    def __init__(self, encoding: Any, tools: bool):
        from openai_harmony import Role, StreamableParser

        self.encoding, self.tools = encoding, tools
        self.parser: Optional[Any] = StreamableParser(encoding, role=Role.ASSISTANT)
        self.unread: list[int] = []  # tokens since the last content: a header, given back as content if it breaks
        self.num_calls = 0
        self.in_call = False  # the message being read is a call's arguments
        self.held = ""  # the end of the text so far when it may begin a special token

    def feed(self, text: str, finished: bool) -> tuple[str, list[Delta]]:
        out = _Pieces()
        text, self.held = self.held + text, ""
        if not finished:
            cut = _PARTIAL_SPECIAL.search(text)
            if cut is not None:
                text, self.held = text[:cut.start()], text[cut.start():]
        if text:
            self._take(self.encoding.encode(text, allowed_special="all"), out)
        if finished and self.parser is not None:
            try:
                self.parser.process_eos()
            except Exception:  # the output ended inside a header
                self._broken([], out)
        return out.thought, out.pieces

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def _take(self, tokens: list[int], out: _Pieces) -> None:
        from openai_harmony import StreamState

        for k, tok in enumerate(tokens):
            if self.parser is None:
                out.content(self.encoding.decode_utf8(tokens[k:]))
                return
            header = self.parser.state != StreamState.CONTENT
            try:
                self.parser.process(tok)
            except Exception:
                self._broken(tokens[k:], out)
                return
            if self.parser.state != StreamState.CONTENT:  # a header, or the end of a message (which it read whole)
                self.unread = [] if self.parser.state == StreamState.EXPECT_START else self.unread + [tok]
                self.in_call = False
                continue
            self.unread = []
            recipient = self.parser.current_recipient
            if header and self.tools and recipient and recipient.startswith(FUNCTIONS):  # a call's header ended
                self.num_calls += 1
                self.in_call = True
                out.call(ToolCallDelta(self.num_calls - 1, call_id(), recipient[len(FUNCTIONS):], ""))
            delta = self.parser.last_content_delta
            if not delta:
                continue
            if self.in_call:
                out.call(ToolCallDelta(self.num_calls - 1, arguments=delta))
            elif self.parser.current_channel == "analysis":
                out.reason(delta)
            else:
                out.content(delta)

    def _broken(self, rest: list[int], out: _Pieces) -> None:
        """The text stopped parsing as harmony: what was read of the header and the rest are content."""
        self.parser = None
        text = self.encoding.decode_utf8(self.unread + rest)
        self.unread = []
        if text:
            out.content(text)


class _Pieces:
    """A feed's reasoning and answer pieces, neighbours of one kind merged."""

    def __init__(self) -> None:
        self.thought = ""
        self.pieces: list[Delta] = []

    def reason(self, text: str) -> None:
        self.thought += text

    def content(self, text: str) -> None:
        last = self.pieces[-1] if self.pieces else None
        if isinstance(last, ContentDelta):
            last.text += text
        else:
            self.pieces.append(ContentDelta(text))

    def call(self, d: ToolCallDelta) -> None:
        last = self.pieces[-1] if self.pieces else None
        if d.name is None and isinstance(last, ToolCallDelta) and last.index == d.index:
            last.arguments += d.arguments
        else:
            self.pieces.append(d)
