"""A request's output constraint, from whichever field asks for one:
``response_format`` (``json_object``, ``json_schema``), the
``structured_outputs`` extension (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``; ``disable_any_whitespace``), vLLM's older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
or a forced tool call (``tool_choice`` ``required`` or a named function).
At most one may be given; ``ConstraintChecker`` checks it against the
deployment's ``structured_output`` limits before the engine sees it: its
size and nesting before anything parses it, a schema, regex or grammar
that parses and uses nothing xgrammar would leave unenforced (no
``$ref`` outside the schema), choices the model's vocabulary can write,
and a trial compile, bounded in time and memory, in a child process. A
constraint that fails any of them is a 400 naming its field, and the
engine core only compiles constraints known to finish within the bounds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Executor, Future
from typing import Any, Optional

from appliance.config.schema import StructuredOutputConfig
from appliance.sampling_params import STRUCTURED_KINDS, SamplingParamsError, StructuredOutputsParams
from appliance.server.protocol import OpenAIError
from appliance.server.tool_requests import ToolRequest
from appliance.structured_output import (CONSTRAINT_NAMES, CompileRefused, CompileSandbox, ConstraintLimits,
                                         TokenSpelling, check, check_writable, effective_constraint, tokenizer_info)

log = logging.getLogger("appliance.server")

_OPTIONS = ("disable_any_whitespace",)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _from_response_format(fmt: Any) -> Optional[StructuredOutputsParams]:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(kind, str):
        raise OpenAIError(400, "'response_format' must be an object with a string 'type'", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise OpenAIError(400, "'response_format.json_schema' must be an object with 'name' and 'schema'",
                              param="response_format.json_schema")
        name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
        if not isinstance(name, str) or not name:
            raise OpenAIError(400, "'response_format.json_schema.name' must be a non-empty string",
                              param="response_format.json_schema.name")
        if not isinstance(schema, dict):
            raise OpenAIError(400, "'response_format.json_schema.schema' must be a JSON schema object",
                              param="response_format.json_schema.schema")
        if strict is not None and not isinstance(strict, bool):
            raise OpenAIError(400, "'response_format.json_schema.strict' must be a boolean",
                              param="response_format.json_schema.strict")
        return StructuredOutputsParams(json=schema)
    raise OpenAIError(400, f"'response_format' type {kind[:40]!r} is unknown; 'text', 'json_object' and "
                           f"'json_schema' are supported", param="response_format")


def _from_structured_outputs(so: Any) -> Optional[StructuredOutputsParams]:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise OpenAIError(400, "'structured_outputs' must be an object", param="structured_outputs")
    for key in so:
        if key not in STRUCTURED_KINDS and key not in _OPTIONS:
            raise OpenAIError(400, f"'structured_outputs.{str(key)[:40]}' is not supported; use one of "
                                   f"{', '.join(STRUCTURED_KINDS)} (and {', '.join(_OPTIONS)})",
                              param=f"structured_outputs.{str(key)[:40]}")
    args = {k: v for k, v in so.items() if v is not None}
    if not isinstance(args.get("disable_any_whitespace", False), bool):
        raise OpenAIError(400, "'structured_outputs.disable_any_whitespace' must be a boolean",
                          param="structured_outputs.disable_any_whitespace")
    if not isinstance(args.get("json_object", False), bool):
        raise OpenAIError(400, "'structured_outputs.json_object' must be a boolean",
                          param="structured_outputs.json_object")
    if "json" in args and not isinstance(args["json"], (dict, str)):
        raise OpenAIError(400, "'structured_outputs.json' must be a JSON schema (an object or its JSON text)",
                          param="structured_outputs.json")
    if "choice" in args and not isinstance(args["choice"], list):
        raise OpenAIError(400, "'structured_outputs.choice' must be a list of strings", param="structured_outputs.choice")
    for key in ("regex", "grammar"):
        if key in args and not isinstance(args[key], str):
            raise OpenAIError(400, f"'structured_outputs.{key}' must be a string", param=f"structured_outputs.{key}")
    try:
        return StructuredOutputsParams(**args)
    except SamplingParamsError as e:
        raise OpenAIError(400, str(e), param=e.param) from None


def constraint_from_body(body: dict, tools: Optional[ToolRequest]) -> tuple[Optional[StructuredOutputsParams], str]:
    """The request's one output constraint (or None) and the field it came
    from; a 400 when more than one field asks for one."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    so = _from_response_format(body.get("response_format"))
    if so is not None:
        found.append(("response_format", so))
    so = _from_structured_outputs(body.get("structured_outputs"))
    if so is not None:
        found.append(("structured_outputs", so))
    for key, kind in _GUIDED.items():
        if body.get(key) is not None and (guided := _from_structured_outputs({kind: body[key]})) is not None:
            found.append((key, guided))
    if tools is not None and (schema := tools.constraint_schema()) is not None:
        found.append(("tool_choice", StructuredOutputsParams(json=schema)))
    if len(found) > 1:
        raise OpenAIError(400, "only one output constraint may be given; this request has "
                               + ", ".join(f"'{k}'" for k, _ in found), param=found[1][0])
    if not found:
        return None, ""
    return found[0][1], found[0][0]


def _param(so: StructuredOutputsParams, source: str) -> str:
    """The request parameter a problem with ``so`` is reported against."""
    return f"structured_outputs.{so.kind}" if source == "structured_outputs" else source


class ConstraintChecker:
    """One server's check of output constraints (see the module docstring):
    ``check`` runs the parse and the vocabulary check on the tokenizer
    threads, then awaits the trial compile on the event loop, so a slow
    compile holds neither. The digests of the last ``PASSED_KEPT``
    constraints whose trial compiled are kept (they are not tried again);
    identical constraints in flight share one trial. The tokenizer's
    xgrammar vocabulary and the sandbox's helper process are made for the
    first constraint."""

    PASSED_KEPT = 4096

    def __init__(self, cfg: StructuredOutputConfig, tokenizer: Any, vocab_size: int):
        self.cfg = cfg
        self.limits = ConstraintLimits(cfg.max_schema_bytes, cfg.max_schema_depth)
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._sandbox: Optional[CompileSandbox] = None
        self._spelling: Optional[TokenSpelling] = None
        self._passed: OrderedDict[bytes, None] = OrderedDict()
        self._trials: dict[bytes, Future] = {}

    async def check(self, so: StructuredOutputsParams, source: str, pool: Optional[Executor]) -> None:
        """A 400 naming the field (``source``) when ``so`` is over a limit,
        does not parse, asks for what cannot be enforced, or does not compile
        within ``structured_output.compile_timeout_s`` and
        ``compile_memory_mib``."""
        trial = await asyncio.get_running_loop().run_in_executor(pool, self._prepare, so, source)
        if trial is None:
            return
        try:
            await asyncio.wrap_future(trial)
        except CompileRefused as e:
            raise OpenAIError(400, f"the {CONSTRAINT_NAMES[so.kind]} {e}", param=_param(so, source)) from None

    def _prepare(self, so: StructuredOutputsParams, source: str) -> Optional[Future]:
        """The checks of the tokenizer threads; the trial to await (None: this constraint compiled before)."""
        so = effective_constraint(so, not self.cfg.disable_any_whitespace)
        try:
            grammar = check(so, self.cfg.max_json_whitespace, self.limits)
            if so.kind == "choice":
                check_writable(so, self._vocabulary()[1])
        except SamplingParamsError as e:
            raise OpenAIError(400, str(e), param=_param(so, source)) from None
        sandbox = self._vocabulary()[0]
        digest = hashlib.sha256(repr(so.key).encode()).digest()
        with self._lock:
            if digest in self._passed:
                self._passed.move_to_end(digest)
                return None
            trial = self._trials.get(digest)
            if trial is not None:
                return trial
            trial = self._trials[digest] = sandbox.compile(grammar)
        trial.add_done_callback(lambda f: self._tried(digest, f))  # outside the lock: it may run at once
        return trial

    def _vocabulary(self) -> tuple[CompileSandbox, TokenSpelling]:
        with self._lock:
            if self._sandbox is None:
                eos = self._tokenizer.eos_token_id  # a grammar ends on it, as the engine's do
                info = tokenizer_info(self._tokenizer, self._vocab_size, [] if eos is None else [eos])
                cfg = self.cfg
                self._spelling = TokenSpelling(info)
                self._sandbox = CompileSandbox(info, cfg.num_threads, cfg.compile_timeout_s,
                                               cfg.compile_memory_mib << 20, cfg.num_threads)
            assert self._spelling is not None  # made with the sandbox
            return self._sandbox, self._spelling

    def _tried(self, digest: bytes, trial: Future) -> None:
        compiled = trial.exception() is None
        with self._lock:
            self._trials.pop(digest, None)
            if compiled:
                self._passed[digest] = None
                while len(self._passed) > self.PASSED_KEPT:
                    self._passed.popitem(last=False)
        if compiled:
            log.debug("trial grammar compile: %.3f s, %d bytes", trial.result().seconds, trial.result().grammar_bytes)
