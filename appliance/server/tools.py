"""Tool calling for chat completions: the OpenAI ``tools`` / ``tool_choice`` request fields, and the
tool calls found in the model's output.

Request side (``tool_requests.py``): ``parse_tools`` validates the request's fields into a
``ToolRequest``, whose ``constraint_schema`` a forced choice generates under.

Output side: ``ToolCallStream`` reads the model's text, in pieces of any size, in one of these formats:

* mode ``"named"``: the whole output is the named function's arguments JSON;
* mode ``"required"``: the JSON array ``[{"name": N, "parameters": {...}}, ...]``;
* mode ``"auto"``, parser ``"hermes"`` (Hermes, Qwen, ...): content with blocks
  ``<tool_call>\\n{"name": "F", "arguments": {...}}\\n</tool_call>``;
* mode ``"auto"``, parser ``"llama3_json"`` (Llama 3.x): an output that starts, after whitespace and an
  optional ``<|python_tag|>``, with ``{`` is ``{"name": F, "parameters": {...}}`` objects separated by
  ``;``; any other output is content.

In call objects "arguments" and "parameters" are both accepted, the keys may come in any order and
other keys are ignored. Whole responses go through the same extractor as streamed ones, so a whole
response is exactly what its streamed deltas reassemble into: a call's arguments are the raw text of
the model's arguments value (checked to parse as JSON), never re-serialized. Text that may still turn
into a tool call, such as a partial ``<tool_call>``, is held back, so it never leaks out as content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Optional, Union


from appliance.server.tool_requests import TOOL_PARSERS


# ----------------------------------------------------------------------------------------------------
# Output


@dataclass
class ToolCall:
    id: str  # "call_" + 24 hex chars
    name: str
    arguments: str  # the raw JSON text of the arguments

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallDelta:
    index: int
    id: Optional[str] = None  # on the first delta of a call only, with the name
    name: Optional[str] = None
    arguments: str = ""  # a fragment of the arguments text

    def to_openai(self) -> dict:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


Delta = Union[ContentDelta, ToolCallDelta]

_WHITESPACE = " \t\r\n"
_SCALAR_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-.")
_ARGUMENT_KEYS = ("arguments", "parameters")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _partial_suffix(text: str, start: int, tag: str) -> int:
    """The length of the longest end of text[start:] that is a proper beginning of ``tag``."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _ValueScan:
    """Finds where one JSON value starting at ``start`` ends, in text that grows: tracks nesting,
    strings and escapes. ``end`` (exclusive) is set once known; a scalar ends at the first character
    that cannot belong to it, which is left unread."""

    def __init__(self, text: str, start: int):
        self.start = self.pos = start
        self.end: Optional[int] = None
        self.scalar = text[start] not in '"{['
        self.depth = 0
        self.in_string = self.escaped = False

    def advance(self, text: str) -> None:
        i = self.pos
        while self.end is None and i < len(text):
            c = text[i]
            if self.scalar:
                if c not in _SCALAR_CHARS:
                    self.end = i
                    break
            elif self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.end = i + 1
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
            i += 1
        self.pos = i


class _CallObject:
    """Scans one call object ``{"name": ..., "arguments"|"parameters": ...}`` starting at ``start``
    (a ``{``) in text that grows. The first "name" and the first arguments key count; other keys are
    skipped. Once closed, ``end`` is set if the object is valid JSON with a string name, else ``failed``."""

    def __init__(self, start: int):
        self.start = start
        self.pos = start + 1
        self.expect = "key"  # "key" | "colon" | "value" | "separator"
        self.members = 0
        self.key: Optional[str] = None
        self.scan: Optional[_ValueScan] = None  # the key or value being read
        self.name: Optional[str] = None
        self.args: Optional[_ValueScan] = None
        self.end: Optional[int] = None
        self.failed = False
        self.arguments = ""  # the arguments text once closed ("{}" when the object has none)
        self.id: Optional[str] = None  # set by the stream once the name is known
        self.index = -1
        self.taken = 0  # absolute offset up to which the arguments have been taken

    def advance(self, text: str) -> None:
        while self.end is None and not self.failed and self.pos < len(text):
            if self.scan is not None:
                self.scan.advance(text)
                if self.scan.end is None:
                    return
                self._read(text[self.scan.start:self.scan.end])
                self.pos, self.scan = self.scan.end, None
                continue
            c = text[self.pos]
            if c in _WHITESPACE:
                self.pos += 1
            elif self.expect == "key" and c == '"' or self.expect == "value" and (c in '"{[' or c in _SCALAR_CHARS):
                self.scan = _ValueScan(text, self.pos)
                if self.expect == "value" and self.key in _ARGUMENT_KEYS and self.args is None:
                    self.args, self.taken = self.scan, self.pos
            elif self.expect == "colon" and c == ":" or self.expect == "separator" and c == ",":
                self.expect = "value" if c == ":" else "key"
                self.pos += 1
            elif c == "}" and (self.expect == "separator" or self.expect == "key" and not self.members):
                self._close(text, self.pos + 1)
            else:
                self.failed = True

    def _read(self, raw: str) -> None:
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            if self.expect == "key" or self.key == "name" and self.name is None:
                self.failed = True
            value = None  # other values are checked with the whole object
        if self.expect == "key":
            self.key, self.expect = value, "colon"
            return
        if self.key == "name" and self.name is None:
            if isinstance(value, str):
                self.name = value
            else:
                self.failed = True
        self.members += 1
        self.expect = "separator"

    def _close(self, text: str, end: int) -> None:
        if self.name is None or not _parses(text[self.start:end]):
            self.failed = True
            return
        self.end = end
        self.arguments = "{}" if self.args is None else text[self.args.start:self.args.end]

    def take_arguments(self, text: str) -> str:
        """The arguments text that has arrived since the last take; once closed without arguments,
        "{}" (the stream takes once more after the close, and never again)."""
        if self.args is None:
            return self.arguments if self.end is not None else ""
        upto = self.args.end if self.args.end is not None else self.args.pos
        fragment, self.taken = text[self.taken:upto], upto
        return fragment


class ToolCallStream:
    """Splits the model's output into content and tool calls as it arrives (see the module docstring)."""

    def __init__(self, mode: str, parser: str = "hermes", function: Optional[str] = None):
        if mode not in ("named", "required", "auto"):
            raise ValueError(f"unknown tool call mode {mode!r}")
        if parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {parser!r}; known: {', '.join(TOOL_PARSERS)}")
        if (mode == "named") != (function is not None):
            raise ValueError("a function is named exactly when the mode is 'named'")
        self.mode, self.parser, self.function = mode, parser, function
        self.failed = False  # some call or block could not be parsed
        self._text = ""
        self._pos = 0  # how far the text has been consumed
        self._state = {"named": "named", "required": "open", "auto": "content" if parser == "hermes" else "lead"}[mode]
        self._call: Optional[_CallObject] = None
        self._started = 0  # calls whose name has been sent
        self._named_id: Optional[str] = None
        self._calls: list[ToolCall] = []
        self._content: list[str] = []
        self._held = ""  # whitespace held back from the content (hermes)
        self._after_block = False  # hermes: the content so far follows a block; its leading whitespace goes

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._calls)

    @property
    def content(self) -> Optional[str]:
        return "".join(self._content) or None

    def feed(self, text: str) -> list[Delta]:
        self._text += text
        return self._advance(final=False)

    def finish(self) -> list[Delta]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Delta]:
        if self.mode == "named":
            return self._named(final)
        if self.mode == "required":
            return self._json_calls(",", "]", final)
        if self.parser == "hermes":
            return self._hermes(final)
        return self._llama3_json(final)

    def _named(self, final: bool) -> list[Delta]:
        fragment, self._pos = self._text[self._pos:], len(self._text)
        out: list[Delta] = []
        if fragment and self._named_id is None:
            self._named_id = call_id()
            out.append(ToolCallDelta(0, self._named_id, self.function, fragment))
        elif fragment:
            out.append(ToolCallDelta(0, arguments=fragment))
        if final and self._named_id is not None and _parses(self._text):
            assert self.function is not None  # named mode names its function
            self._calls.append(ToolCall(self._named_id, self.function, self._text))
        return out

    def _emit(self, text: str) -> list[Delta]:
        """Content text, with whitespace right after a block dropped and trailing whitespace held back
        (whitespace right before a block is dropped; at the end it is sent if there is other content)."""
        if self._after_block:
            text = text.lstrip()
            if not text:
                return []
            self._after_block = False
        body = text.rstrip()
        if not body:
            self._held += text
            return []
        out, self._held = self._held + body, text[len(body):]
        self._content.append(out)
        return [ContentDelta(out)]

    def _call_deltas(self) -> list[Delta]:
        """Advances the current call object: its name delta once the name is known, then its arguments
        as they arrive; records the call when it closes."""
        call = self._call
        assert call is not None  # only in the "call" state
        call.advance(self._text)
        out: list[Delta] = []
        first = None
        if call.name is not None and call.id is None:
            call.id, call.index = call_id(), self._started
            self._started += 1
            first = ToolCallDelta(call.index, call.id, call.name)
            out.append(first)
        if call.id is not None:
            fragment = call.take_arguments(self._text)
            if first is not None:
                first.arguments = fragment
            elif fragment:
                out.append(ToolCallDelta(call.index, arguments=fragment))
        if call.end is not None:
            assert call.id is not None and call.name is not None  # a call closes with its name, which gave it an id
            self._calls.append(ToolCall(call.id, call.name, call.arguments))
        return out

    def _json_calls(self, separator: str, close: Optional[str], final: bool) -> list[Delta]:
        """Call objects separated by ``separator``; for mode "required" inside ``[`` ... ``close``."""
        out: list[Delta] = []
        text = self._text
        while self._state not in ("closed", "failed"):
            if self._call is not None:
                out += self._call_deltas()
                if self._call.failed or final and self._call.end is None:
                    self._state, self.failed = "failed", True
                elif self._call.end is not None:
                    self._pos, self._call, self._state = self._call.end, None, "separator"
                    continue
                break
            self._pos = _skip_whitespace(text, self._pos)
            if self._pos == len(text):
                break
            c = text[self._pos]
            if c == "{" and self._state == "item":
                self._call = _CallObject(self._pos)
                continue
            if self._state == "open" and c == "[" or self._state == "separator" and c == separator:
                self._state = "item"
            elif self._state == "separator" and c == close:
                self._state = "closed"
            else:
                self._state, self.failed = "failed", True
            self._pos += 1
        return out

    def _hermes(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        text = self._text
        while True:
            if self._state == "content":
                i = text.find(_HERMES_OPEN, self._pos)
                if i < 0:
                    end = len(text) - (0 if final else _partial_suffix(text, self._pos, _HERMES_OPEN))
                    out += self._emit(text[self._pos:end])
                    self._pos = end
                    if final and self._content and self._held:
                        self._content.append(self._held)
                        out.append(ContentDelta(self._held))
                    return out
                out += self._emit(text[self._pos:i])
                self._held, self._pos, self._state = "", i + len(_HERMES_OPEN), "block"
            elif self._state == "block":
                self._pos = _skip_whitespace(text, self._pos)
                if self._pos == len(text) and not final:
                    return out
                if self._pos < len(text) and text[self._pos] == "{":
                    self._call, self._state = _CallObject(self._pos), "call"
                else:
                    self._state, self.failed = "skip", True
            elif self._state == "call":
                out += self._call_deltas()
                call = self._call
                assert call is not None  # _call_deltas ran on it
                if call.end is not None:
                    self._pos, self._call, self._state = call.end, None, "close"
                elif call.failed or final:
                    self._pos, self._call, self._state, self.failed = call.pos, None, "skip", True
                else:
                    return out
            elif self._state == "close":
                self._pos = _skip_whitespace(text, self._pos)
                rest = text[self._pos:self._pos + len(_HERMES_CLOSE)]
                if rest == _HERMES_CLOSE:
                    self._pos, self._state, self._after_block = self._pos + len(rest), "content", True
                elif final and not rest:  # an unterminated block with a whole call counts
                    return out
                elif _HERMES_CLOSE.startswith(rest) and not final:
                    return out
                else:
                    self._state, self.failed = "skip", True
            else:  # "skip": a block that could not be parsed, up to its end tag
                i = text.find(_HERMES_CLOSE, self._pos)
                if i < 0:
                    self._pos = max(self._pos, len(text) - len(_HERMES_CLOSE) + 1)
                    return out
                self._pos, self._state, self._after_block = i + len(_HERMES_CLOSE), "content", True

    def _llama3_json(self, final: bool) -> list[Delta]:
        text = self._text
        if self._state == "lead":  # calls or content is decided at the first character past the python tag
            start = _skip_whitespace(text, self._pos)
            if text.startswith(_PYTHON_TAG, start):
                start = _skip_whitespace(text, start + len(_PYTHON_TAG))
            elif _PYTHON_TAG.startswith(text[start:]) and not final:
                return []
            if start == len(text) and not final:
                return []
            if start < len(text) and text[start] == "{":
                self._pos, self._state = start, "item"
            else:
                self._state = "content"
        if self._state != "content":
            return self._json_calls(";", None, final)
        fragment, self._pos = text[self._pos:], len(text)
        if not fragment or not (self._content or fragment.strip()):
            return []
        self._content.append(fragment)
        return [ContentDelta(fragment)]


def extract_tool_calls(mode: str, parser: str, function: Optional[str], text: str
                       ) -> tuple[Optional[str], list[ToolCall]]:
    """A whole output's (content, tool calls), exactly as streaming it reassembles. In mode "auto", an
    output with a call that cannot be parsed is all content, as in vLLM."""
    stream = ToolCallStream(mode, parser, function)
    stream.feed(text)
    stream.finish()
    if mode == "auto" and stream.failed:
        return text, []
    return stream.content, stream.calls
