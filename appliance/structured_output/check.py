"""Output constraints checked at the boundary, tokenizer-free (see the
package docstring): ``check`` turns a request's constraint into xgrammar's
grammar or a ``SamplingParamsError`` naming the field;
``check_writable`` refuses a choice the vocabulary cannot finish."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Optional

from appliance.sampling_params import SamplingParamsError, StructuredOutputsParams

log = logging.getLogger("appliance.structured")

# JSON-schema keywords xgrammar 0.2 accepts but does not enforce.
UNSUPPORTED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
                        "dependentRequired", "dependentSchemas", "dependencies", "$dynamicRef", "$recursiveRef")
SUPPORTED_FORMATS = ("email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6", "hostname", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
# What each kind of constraint is called in messages.
CONSTRAINT_NAMES = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "grammar": "grammar",
                    "choice": "choice"}
_MESSAGE_CHARS = 300  # xgrammar's messages can quote the whole schema


def _xgr():
    import xgrammar

    return xgrammar


@dataclass(frozen=True)
class ConstraintLimits:
    """What one constraint may be before anything parses it (the
    ``structured_output`` config): ``max_bytes``, its size in UTF-8 bytes
    (a JSON schema's text, a regex, a grammar, the choices together);
    ``max_depth``, a JSON schema's nesting in objects and arrays (the
    schema itself is level 1). None: unbounded."""

    max_bytes: Optional[int] = None
    max_depth: Optional[int] = None


def constraint_bytes(so: StructuredOutputsParams) -> int:
    """The constraint's size in UTF-8 bytes (``ConstraintLimits.max_bytes``)."""
    spec = getattr(so, so.kind)
    if so.kind == "json_object":
        return 0
    texts = spec if so.kind == "choice" else [spec]
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests objects and arrays more than ``limit`` levels
    (``value`` itself is level 1); without recursion, stopping at the first
    node past the limit."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _schema_nodes(schema: Any):
    """(subschema, its JSON pointer) for every subschema xgrammar reads."""
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node, path
        for kw in _SUBSCHEMA_LISTS:
            if isinstance(node.get(kw), list):
                stack.extend((s, f"{path}/{kw}/{i}") for i, s in enumerate(node[kw]))
        for kw in _SUBSCHEMA_MAPS:
            if isinstance(node.get(kw), dict):
                stack.extend((s, f"{path}/{kw}/{k}") for k, s in node[kw].items())
        for kw in _SUBSCHEMAS:
            if isinstance(node.get(kw), dict):
                stack.append((node[kw], f"{path}/{kw}"))


def unsupported_schema_features(schema: Any) -> list[str]:
    """Keywords of ``schema`` xgrammar would not enforce, as 'keyword at path'."""
    found: list[str] = []
    for node, path in _schema_nodes(schema):
        for kw in UNSUPPORTED_KEYWORDS:
            if kw in node:
                found.append(f"'{kw}' at {path}")
        if "multipleOf" in node and node.get("type") != "integer":
            found.append(f"'multipleOf' on a non-integer at {path}")
        if "format" in node and node["format"] not in SUPPORTED_FORMATS:
            found.append(f"'format': {str(node['format'])[:40]!r} at {path}")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            found.append(f"'allOf' with more than one schema at {path}")
    return sorted(found)


def external_refs(schema: Any) -> list[str]:
    """``$ref`` values of ``schema`` that are not a JSON pointer into the
    schema itself ('#' or '#/...'): a URL, a file or another document,
    which xgrammar neither fetches nor refuses (it would leave the value
    unconstrained). As "'$ref': value at path"."""
    return sorted(f"'$ref': {ref[:80]!r} at {path}" for node, path in _schema_nodes(schema)
                  if isinstance(ref := node.get("$ref"), str) and not (ref == "#" or ref.startswith("#/")))


def _choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar of exactly ``choices``: JSON string literals, whose
    escapes (``\\uXXXX`` for control characters, NUL included) xgrammar's
    EBNF reads back as the same characters."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def effective_constraint(so: StructuredOutputsParams, any_whitespace: bool) -> StructuredOutputsParams:
    """``so`` as an engine compiles it: JSON without free whitespace when the
    deployment says so (``structured_output.disable_any_whitespace``) and the
    request does not ask for it either."""
    if not any_whitespace and so.kind in ("json", "json_object") and not so.disable_any_whitespace:
        return StructuredOutputsParams(**{**so.__dict__, "disable_any_whitespace": True})
    return so


def _load_schema(text: str, max_depth: Optional[int], param: str) -> Any:
    too_deep = SamplingParamsError(f"the JSON schema is nested more than {max_depth} levels deep; "
                                   f"structured_output.max_schema_depth={max_depth} is the most a schema may nest",
                                   param)
    try:
        schema = json.loads(text)
    except RecursionError:  # deeper than any limit could allow
        raise too_deep from None
    except ValueError as e:
        raise SamplingParamsError(f"the JSON schema is not valid JSON: {str(e)[:_MESSAGE_CHARS]}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise SamplingParamsError("a JSON schema must be an object", param)
    if max_depth is not None and isinstance(schema, dict) and nested_deeper_than(schema, max_depth):
        raise too_deep
    return schema


def check(so: StructuredOutputsParams, max_whitespace: Optional[int] = None,
          limits: ConstraintLimits = ConstraintLimits()) -> Any:
    """``so`` as an xgrammar ``Grammar``; ``SamplingParamsError`` (with the
    field) when it is over ``limits``, invalid, or asks for what xgrammar
    does not enforce. ``max_whitespace``: the longest run of whitespace JSON
    may have between its tokens (None: unbounded), so a model cannot pad it
    until max_tokens."""
    xgr = _xgr()
    kind = so.kind
    ws = {"any_whitespace": not so.disable_any_whitespace, "max_whitespace_cnt": max_whitespace}
    param = f"structured_outputs.{kind}"
    if limits.max_bytes is not None and (size := constraint_bytes(so)) > limits.max_bytes:
        what = "choices together are" if kind == "choice" else f"{CONSTRAINT_NAMES[kind]} is"
        raise SamplingParamsError(f"the {what} {size} bytes; structured_output.max_schema_bytes={limits.max_bytes} "
                                  f"is the most a constraint may be", param)
    try:
        if kind == "json":
            assert isinstance(so.json, str)  # kind "json": a schema, serialized when it came as a dict
            schema = _load_schema(so.json, limits.max_depth, param)
            if bad := external_refs(schema):
                raise SamplingParamsError("the JSON schema refers outside itself (" + ", ".join(bad[:4])
                                          + "); only references within the schema ('#' or '#/...') are resolved",
                                          param)
            if bad := unsupported_schema_features(schema):
                raise SamplingParamsError("the JSON schema uses features structured outputs cannot enforce: "
                                          + ", ".join(bad[:8]), param)
            return xgr.Grammar.from_json_schema(so.json, **ws)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **ws)
        if kind == "regex":
            return xgr.Grammar.from_regex(so.regex)
        if kind == "choice":
            assert so.choice is not None  # kind "choice": choices given
            return xgr.Grammar.from_ebnf(_choice_grammar(so.choice))
        return xgr.Grammar.from_ebnf(so.grammar)
    except RuntimeError as e:  # xgrammar's parse errors: "[time] file:line: message"
        message = str(e).strip().split(": ", 1)[-1] if "] /" in str(e) else str(e).strip()
        raise SamplingParamsError(f"invalid {CONSTRAINT_NAMES[kind]}: {message[:_MESSAGE_CHARS]}", param) from None


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of a Hugging Face tokenizer: each token's bytes, the
    stop tokens that end a grammar."""
    return _xgr().TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


class TokenSpelling:
    """Which byte strings the vocabulary can write: each token's bytes as
    xgrammar matches them (special and stop tokens never spell text)."""

    def __init__(self, info: Any):
        never = set(info.special_token_ids) | set(info.stop_token_ids)
        self._tokens = {t for i, t in enumerate(info.decoded_vocab) if t and i not in never}
        self._single = {t[0] for t in self._tokens if len(t) == 1}  # bytes a token writes on its own
        lengths: dict[int, set[int]] = {}
        for t in self._tokens:
            lengths.setdefault(t[0], set()).add(len(t))
        self._lengths = {b: sorted(ls) for b, ls in lengths.items()}  # first byte -> lengths of its tokens

    def dead_end(self, text: bytes) -> Optional[int]:
        """The first offset of ``text`` that tokens can write up to and no
        token continues from (None: tokens can finish every prefix of it they
        write). A grammar of exactly ``text`` would allow no token there; an
        offset every token sequence can go on from leads, by offsets further
        on, to the end or to such a one."""
        if set(text) <= self._single:
            return None  # byte by byte from anywhere
        n = len(text)
        reached = bytearray(n + 1)
        reached[0] = 1
        for i in range(n):
            if not reached[i]:
                continue
            ends = [i + k for k in self._lengths.get(text[i], ()) if i + k <= n and text[i:i + k] in self._tokens]
            if not ends:
                return i
            for j in ends:
                reached[j] = 1
        return None


def check_writable(so: StructuredOutputsParams, spelling: TokenSpelling) -> None:
    """``SamplingParamsError`` when a choice of ``so`` cannot be written with
    the vocabulary: tokens could start it, then the mask would allow nothing."""
    if so.kind != "choice":
        return
    assert so.choice is not None  # kind "choice": choices given
    for k, choice in enumerate(so.choice):
        text = choice.encode("utf-8", "surrogatepass")
        at = spelling.dead_end(text)
        if at is not None:
            raise SamplingParamsError(
                f"choice {k} ({choice[:40]!r}) cannot be written with this model's vocabulary: after "
                f"{text[:at][-20:]!r} no token continues it (a character no token holds, such as some control "
                f"characters, cannot be generated)", "structured_outputs.choice")
