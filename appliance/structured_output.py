"""Structured outputs on xgrammar: constraints checked at the boundary,
trial compiles in bounded child processes, grammars compiled off the step
loop, one matcher per request, and the token bitmask of each step.

- ``check(so, max_whitespace, limits)`` (tokenizer-free, milliseconds)
  turns a request's constraint into xgrammar's grammar or a
  ``SamplingParamsError`` naming the field. Before anything parses it, the
  constraint's size (``ConstraintLimits.max_bytes``) and a JSON schema's
  nesting (``max_depth``; xgrammar's schema conversion grows with the cube
  of it) are checked. An invalid schema, regex or EBNF grammar carries the
  compiler's message; a JSON-schema keyword xgrammar would silently ignore
  (``UNSUPPORTED_KEYWORDS``, ``multipleOf`` on non-integers, unknown
  ``format`` values) and a ``$ref`` outside the schema (xgrammar resolves
  '#' and '#/...' only, and would leave any other unconstrained) are
  refused by name rather than left unenforced.
- ``check_writable(so, spelling)`` refuses a choice that tokens can start
  but never finish (a character no token of the vocabulary holds, such as
  U+0004 in SmolLM2's): its mask would allow no token at all.
- ``CompileSandbox`` runs trial compiles, each in a child forked from one
  helper process (``python -m appliance.structured_output``), its address
  space capped (RLIMIT_AS) and killed at a timeout. The server runs every
  new constraint through it before the engine compiles it; the child
  reports only whether and how the compile finished, since a
  ``CompiledGrammar``'s serialized form costs far more than the compile
  (tens of times its size and time, gigabytes for a schema of a few hundred
  properties), so the engine compiles again, in-process, what is known to
  finish within the bounds.
- ``Grammars`` (one per engine) compiles against the tokenizer on a thread
  pool, one compile per distinct constraint (``StructuredOutputsParams.key``),
  and keeps compiled grammars in an LRU bounded in bytes
  (``structured_output.cache_size_mib``). ``grammar_for(params)`` returns
  the request's ``RequestGrammar`` at once; the engine keeps the request
  waiting until ``ready()``.
- ``RequestGrammar`` holds the request's matcher, which has accepted exactly
  the request's output tokens (``sync`` rebuilds it from them if not, e.g.
  after a retried step). ``Grammars.bitmask`` fills one packed int32 row per
  sampled position: with drafts, a row per draft position (the matcher
  advanced through the drafts before it, then rolled back).
- ``StepBitmask.apply`` masks a step's logits in place with xgrammar's
  kernel (CPU, or Triton/CUDA when the logits are on a GPU).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from appliance.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams

if TYPE_CHECKING:
    import torch

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
    for k, choice in enumerate(so.choice):
        text = choice.encode("utf-8", "surrogatepass")
        at = spelling.dead_end(text)
        if at is not None:
            raise SamplingParamsError(
                f"choice {k} ({choice[:40]!r}) cannot be written with this model's vocabulary: after "
                f"{text[:at][-20:]!r} no token continues it (a character no token holds, such as some control "
                f"characters, cannot be generated)", "structured_outputs.choice")


# -- trial compiles ---------------------------------------------------------------
class CompileRefused(Exception):
    """A trial compile that did not finish: over its time or memory bound
    (``limit``: the config key), or failed otherwise (``limit`` None). The
    message completes "the JSON schema ..."."""

    def __init__(self, message: str, limit: Optional[str] = None):
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class CompileReport:
    """A trial compile that finished within its bounds."""

    seconds: float
    grammar_bytes: int  # the compiled grammar's size


def _frame(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def _unframe(buf: bytearray) -> list[dict]:
    """The whole frames at the start of ``buf`` (removed from it)."""
    out = []
    while len(buf) >= 4:
        (size,) = struct.unpack(">I", buf[:4])
        if len(buf) < 4 + size:
            break
        out.append(json.loads(bytes(buf[4:4 + size])))
        del buf[:4 + size]
    return out


class CompileSandbox:
    """Trial compiles, each in a child process forked from one helper
    (``python -m appliance.structured_output``, started at the first trial,
    holding the tokenizer's xgrammar vocabulary): the child's address space
    is capped at what it had at the fork plus ``memory_bytes`` (RLIMIT_AS)
    and the child is killed ``timeout_s`` after the trial was sent; at most
    ``max_concurrent`` run at once, the rest wait their turn (their clock
    starts when they are sent). ``compile(grammar)`` returns a Future that
    holds a ``CompileReport`` or raises ``CompileRefused``; it cannot be
    cancelled (others may wait on it). One thread of this process drives
    the helper; the helper ends its children and exits when this process
    goes (its stdin closes)."""

    def __init__(self, info: Any, max_threads: int, timeout_s: float, memory_bytes: int, max_concurrent: int):
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.max_concurrent = max_concurrent
        self._init = {"tokenizer_info": info.serialize_json(), "max_threads": max_threads,
                      "memory_bytes": memory_bytes,
                      # a backstop should this process and the helper both be gone: CPU seconds, all threads
                      "cpu_seconds": int(timeout_s * max(1, max_threads)) + 5}
        self._lock = threading.Lock()
        self._queue: deque[tuple[int, str, Future]] = deque()
        self._ids = itertools.count()
        self._wake_r, self._wake_w = os.pipe()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def compile(self, grammar: Any) -> Future:
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                raise RuntimeError("the compile sandbox is closed")
            self._queue.append((next(self._ids), grammar.serialize_json(), fut))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-sandbox", daemon=True)
                self._thread.start()
        os.write(self._wake_w, b"x")
        return fut

    def close(self) -> None:
        """Stop the helper (its running trials are killed) and fail what waits; returns when it has exited."""
        with self._lock:
            self._closed = True
            thread = self._thread
        os.write(self._wake_w, b"x")
        if thread is not None:
            thread.join(timeout=30)

    # -- the driving thread ------------------------------------------------------
    def _run(self) -> None:
        """``_drive``; should it fail, its trials and those waiting fail with
        it (the helper, its stdin closed, exits) and the next trial starts
        a new thread."""
        running: dict[int, tuple[Future, float]] = {}  # trial id -> (future, deadline)
        try:
            self._drive(running)
        except Exception as e:  # noqa: BLE001 (no trial may wait forever)
            log.exception("the grammar compile sandbox failed")
            with self._lock:
                self._thread = None
            self._fail_all(running, f"was not compiled: the compile sandbox failed ({type(e).__name__})")

    def _drive(self, running: dict[int, tuple[Future, float]]) -> None:
        helper: Optional[subprocess.Popen] = None
        buf = bytearray()
        while True:
            with self._lock:
                closed = self._closed
            if closed:
                if helper is not None:
                    helper.stdin.close()  # the helper kills its children and exits
                    try:
                        helper.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        helper.kill()
                        helper.wait()
                self._fail_all(running, "was not compiled: the server is shutting down")
                return
            with self._lock:
                waiting = bool(self._queue)
            if helper is None and waiting:
                try:
                    helper = self._start_helper()
                except Exception as e:  # noqa: BLE001 (every waiting trial gets the reason)
                    log.error("the grammar compile helper did not start: %s", e)
                    self._fail_all({}, f"was not compiled: the compile helper did not start ({e})")
                    continue
                buf.clear()
            while helper is not None and len(running) < self.max_concurrent:
                with self._lock:
                    if not self._queue:
                        break
                    tid, text, fut = self._queue.popleft()
                _send(helper, {"compile": tid, "grammar": text})
                running[tid] = (fut, time.monotonic() + self.timeout_s)
            wait_s = max(0.0, min((d for _, d in running.values()), default=time.monotonic() + 3600) - time.monotonic())
            fds = [self._wake_r] + ([helper.stdout.fileno()] if helper is not None else [])
            ready, _, _ = select.select(fds, [], [], wait_s)
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            if helper is not None and helper.stdout.fileno() in ready:
                data = os.read(helper.stdout.fileno(), 1 << 16)
                if not data:  # the helper is gone: its children with it
                    code = helper.wait()
                    log.error("the grammar compile helper exited (status %s)", code)
                    helper = None
                    self._fail_all(running, "was not compiled: the compile helper exited", queued=False)
                    continue
                buf += data
                for msg in _unframe(buf):
                    entry = running.pop(msg["id"], None)
                    if entry is not None:
                        self._settle(entry[0], msg)
            now = time.monotonic()
            for tid in [t for t, (_, d) in running.items() if d <= now]:
                fut, _ = running.pop(tid)
                _send(helper, {"kill": tid})
                _resolve(fut, error=CompileRefused(f"took longer than structured_output.compile_timeout_s="
                                                   f"{self.timeout_s:g} s to compile",
                                                   "structured_output.compile_timeout_s"))

    def _start_helper(self) -> subprocess.Popen:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where the appliance package is
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # one malloc arena: the address-space bound then counts the heap a compile uses, not the 64 MiB of
        # address space glibc reserves for each compiling thread's own arena
        env["MALLOC_ARENA_MAX"] = "1"
        helper = subprocess.Popen([sys.executable, "-m", "appliance.structured_output"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env=env)
        helper.stdin.write(_frame(self._init))
        helper.stdin.flush()
        buf = bytearray()
        deadline = time.monotonic() + 120
        while not _unframe(buf):  # the helper's one answer: ready
            ready, _, _ = select.select([helper.stdout], [], [], max(0.0, deadline - time.monotonic()))
            data = os.read(helper.stdout.fileno(), 1 << 16) if ready else b""
            if not data:
                helper.kill()
                helper.wait()
                raise RuntimeError("it exited or did not answer within 120 s")
            buf += data
        log.info("grammar compile helper ready (pid %d): trial compiles bounded to %.0f MiB and %g s", helper.pid,
                 self.memory_bytes / 2**20, self.timeout_s)
        return helper

    def _settle(self, fut: Future, msg: dict) -> None:
        if "seconds" in msg:
            _resolve(fut, CompileReport(msg["seconds"], msg["bytes"]))
            return
        mib = self.memory_bytes / 2**20
        if msg.get("memory"):
            _resolve(fut, error=CompileRefused(f"needs more than structured_output.compile_memory_mib={mib:g} MiB "
                                               f"to compile", "structured_output.compile_memory_mib"))
        elif "error" in msg:
            _resolve(fut, error=CompileRefused(f"did not compile: {msg['error']}"))
        else:  # ended by a signal (an allocation that failed where no error could be raised aborts)
            log.warning("a trial grammar compile ended abnormally: %s", msg)
            _resolve(fut, error=CompileRefused(
                f"did not compile: the compile ended abnormally ({msg.get('died')}), most likely past "
                f"structured_output.compile_memory_mib={mib:g} MiB", "structured_output.compile_memory_mib"))

    def _fail_all(self, running: dict[int, tuple[Future, float]], message: str, queued: bool = True) -> None:
        for fut, _ in running.values():
            _resolve(fut, error=CompileRefused(message))
        running.clear()
        if queued:
            with self._lock:
                waiting, self._queue = list(self._queue), deque()
            for _, _, fut in waiting:
                _resolve(fut, error=CompileRefused(message))


def _send(helper: subprocess.Popen, msg: dict) -> None:
    try:
        helper.stdin.write(_frame(msg))
        helper.stdin.flush()
    except BrokenPipeError:  # the helper is gone: its stdout's end is read next, and fails what it ran
        pass


def _resolve(fut: Future, result: Any = None, error: Optional[BaseException] = None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def _trial(info: Any, init: dict, text: str, out_fd: int) -> None:
    """A forked child's one compile, its answer written to ``out_fd``."""
    xgr = _xgr()
    try:
        limit = _vm_bytes() + init["memory_bytes"]
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CPU, (init["cpu_seconds"], init["cpu_seconds"] + 1))
        grammar = xgr.Grammar.deserialize_json(text)
        compiler = xgr.GrammarCompiler(info, max_threads=init["max_threads"], cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        answer = {"seconds": time.perf_counter() - t0, "bytes": compiled.memory_size_bytes}
    except MemoryError:
        answer = {"memory": True}
    except Exception as e:  # noqa: BLE001 (xgrammar raises RuntimeError for std::bad_alloc and its own errors)
        answer = {"memory": True} if "bad_alloc" in str(e) else {"error": str(e).strip()[:_MESSAGE_CHARS]}
    os.write(out_fd, json.dumps(answer).encode())


def _helper_main() -> None:
    """The sandbox's helper: reads framed requests on stdin (an init frame,
    then ``{"compile": id, "grammar": json}`` and ``{"kill": id}``), forks
    a child per compile and answers ``{"id": id, ...}`` on stdout when the
    child has ended. Single-threaded, so forking is safe. Exits (killing its
    children) when stdin closes, and only then: a terminal's Ctrl-C reaches
    the whole process group, and is the server's to act on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin, stdout = sys.stdin.buffer.raw, sys.stdout.buffer
    buf = bytearray()
    init: Optional[dict] = None
    while init is None:
        data = os.read(stdin.fileno(), 1 << 20)
        if not data:
            return
        buf += data
        frames = _unframe(buf)
        if frames:
            init = frames[0]
    xgr = _xgr()
    info = xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"])
    stdout.write(_frame({"ready": True}))
    stdout.flush()
    children: dict[int, tuple[int, int, bytearray]] = {}  # result fd -> (trial id, pid, answer so far)
    pids: dict[int, int] = {}  # trial id -> pid
    while True:
        ready, _, _ = select.select([stdin.fileno(), *children], [], [])
        if stdin.fileno() in ready:
            data = os.read(stdin.fileno(), 1 << 20)
            if not data:
                for pid in pids.values():
                    os.kill(pid, signal.SIGKILL)
                return
            buf += data
            for msg in _unframe(buf):
                if "kill" in msg:
                    if msg["kill"] in pids:
                        os.kill(pids[msg["kill"]], signal.SIGKILL)
                    continue
                try:
                    r, w = os.pipe()
                    pid = os.fork()
                except OSError as e:
                    stdout.write(_frame({"id": msg["compile"], "error": f"no process could be started for it ({e})"}))
                    stdout.flush()
                    continue
                if pid == 0:
                    try:  # the child keeps no end of the helper's pipes: its exit is seen at once
                        os.close(r)
                        null = os.open(os.devnull, os.O_RDWR)
                        os.dup2(null, 0)
                        os.dup2(null, 1)
                        _trial(info, init, msg["grammar"], w)
                    finally:
                        os._exit(0)
                os.close(w)
                children[r] = (msg["compile"], pid, bytearray())
                pids[msg["compile"]] = pid
        for fd in [fd for fd in children if fd in ready]:
            data = os.read(fd, 1 << 16)
            if data:
                children[fd][2].extend(data)
                continue
            tid, pid, answer = children.pop(fd)
            os.close(fd)
            del pids[tid]
            _, status = os.waitpid(pid, 0)
            try:
                reply = json.loads(bytes(answer))
            except ValueError:
                reply = {"died": f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                         else f"exit status {os.WEXITSTATUS(status)}"}
            stdout.write(_frame({"id": tid, **reply}))
            stdout.flush()


class RequestGrammar:
    """One request's grammar: compiling (``ready()`` False), failed
    (``error``), or a matcher over the request's output tokens."""

    def __init__(self, future: Future):
        self._future = future
        self._matcher: Any = None
        self.num_accepted = 0

    def ready(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> Optional[str]:
        e = self._future.exception() if self._future.done() else None
        return None if e is None else f"{type(e).__name__}: {e}"

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            self._matcher = _xgr().GrammarMatcher(self._future.result())
        return self._matcher

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher's state the one after ``output_token_ids``."""
        if self.num_accepted == len(output_token_ids):
            return
        m = self.matcher
        m.reset()
        self.num_accepted = 0
        self.accept(output_token_ids)

    def accept(self, token_ids: list[int]) -> int:
        """Advance over ``token_ids``; how many were accepted (stops at the first refused)."""
        m = self.matcher
        for j, tok in enumerate(token_ids):
            if not m.accept_token(tok):
                return j
            self.num_accepted += 1
        return len(token_ids)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of ``drafts`` the grammar allows in a row (state unchanged)."""
        m = self.matcher
        n = 0
        for tok in drafts:
            if m.is_terminated() or not m.accept_token(tok):
                break
            n += 1
        if n:
            m.rollback(n)
        return n


class StepBitmask:
    """The packed bitmask rows of one step: ``rows[rid]`` is the first of
    the request's rows (one per sampled position)."""

    def __init__(self, tensor: torch.Tensor, rows: dict[str, tuple[int, int]], vocab_size: int):
        self.tensor = tensor
        self.rows = rows  # rid -> (first row, number of rows)
        self.vocab_size = vocab_size

    def apply(self, logits: torch.Tensor, logit_rows: dict[str, int], kernel: Optional[Callable] = None) -> None:
        """Mask ``logits`` in place; ``logit_rows[rid]`` is the first logits row of that request.
        ``kernel(logits, bitmask, [(logits row, bitmask row), ...], vocab_size)``
        masks fp32 CPU logits when given (the native one); xgrammar's kernel
        masks them otherwise."""
        import torch

        pairs = [(logit_rows[rid] + j, first + j) for rid, (first, n) in self.rows.items() if rid in logit_rows
                 for j in range(n)]
        if not pairs:
            return
        if kernel is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
            kernel(logits, self.tensor, pairs, self.vocab_size)
            return
        dst = [d for d, _ in pairs]
        full = torch.full((logits.shape[0], self.tensor.shape[1]), -1, dtype=torch.int32)
        full[dst] = self.tensor[[s for _, s in pairs]]
        _xgr().apply_token_bitmask_inplace(logits, full.to(logits.device), vocab_size=self.vocab_size, indices=dst)


class Grammars:
    """Compiles and caches grammars for one tokenizer; see the module docstring."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], num_threads: int = 2,
                 cache_size_bytes: int = 512 << 20, any_whitespace: bool = True, max_whitespace: Optional[int] = 16,
                 limits: ConstraintLimits = ConstraintLimits()):
        xgr = _xgr()
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.limits = limits
        self._spelling: Optional[TokenSpelling] = None  # made for the first choice constraint
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=num_threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()  # done compiles, least recently used first
        self._cache_bytes = 0
        self.cache_size_bytes = cache_size_bytes
        self.any_whitespace = any_whitespace  # for JSON constraints that do not say
        self.max_whitespace = max_whitespace
        self._lock = threading.Lock()
        self._compile_seconds: list[float] = []  # compiles finished since take_compile_seconds()
        self._pending: dict[tuple, Future] = {}  # compiles in flight, by key

    def grammar_for(self, params: SamplingParams) -> RequestGrammar:
        """The request's grammar, compiling unless cached; ``SamplingParamsError``
        (a ValueError) when the constraint is invalid."""
        so = params.structured_outputs
        assert so is not None
        so = effective_constraint(so, self.any_whitespace)
        key = so.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return RequestGrammar(fut)
            fut = self._pending.get(key)
            if fut is not None:
                return RequestGrammar(fut)
        grammar = check(so, self.max_whitespace, self.limits)
        if so.kind == "choice":
            if self._spelling is None:
                self._spelling = TokenSpelling(self.info)
            check_writable(so, self._spelling)
        fut = self._pool.submit(self._compile, grammar)
        with self._lock:
            self._pending[key] = fut
        fut.add_done_callback(lambda f: self._finished(key, f))
        return RequestGrammar(fut)

    def _compile(self, grammar: Any) -> Any:
        t0 = time.perf_counter()
        compiled = self._compiler.compile_grammar(grammar)
        with self._lock:
            self._compile_seconds.append(time.perf_counter() - t0)
        return compiled

    def _finished(self, key: tuple, fut: Future) -> None:
        with self._lock:
            self._pending.pop(key, None)
            if fut.cancelled() or fut.exception() is not None:
                log.error("compiling a grammar failed: %s", None if fut.cancelled() else fut.exception())
                return
            self._cache[key] = fut
            self._cache_bytes += fut.result().memory_size_bytes
            while self._cache_bytes > self.cache_size_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.result().memory_size_bytes

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes (at most ``timeout`` seconds)."""
        with self._lock:
            pending = list(self._pending.values())
        if pending:
            wait_futures(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    def take_compile_seconds(self) -> list[float]:
        """Compile times finished since the last call (each reported once)."""
        with self._lock:
            out, self._compile_seconds = self._compile_seconds, []
        return out

    def bitmask(self, entries: list[tuple[str, RequestGrammar, list[int], list[int]]]) -> StepBitmask:
        """Rows for (request id, grammar, output tokens, drafts) of the requests
        sampled this step: one per draft position and one past them."""
        xgr = _xgr()
        total = sum(1 + len(drafts) for *_, drafts in entries)
        tensor = xgr.allocate_token_bitmask(total, self.vocab_size)
        rows: dict[str, tuple[int, int]] = {}
        r = 0
        for rid, g, outputs, drafts in entries:
            g.sync(outputs)
            m = g.matcher
            rows[rid] = (r, 1 + len(drafts))
            fed = 0
            for j in range(len(drafts) + 1):
                if m.is_terminated():  # past the end: only what already ended it (rows stay all-allowed)
                    break
                m.fill_next_token_bitmask(tensor, r + j)
                if j < len(drafts):
                    if not m.accept_token(drafts[j]):
                        break
                    fed += 1
            if fed:
                m.rollback(fed)
            r += 1 + len(drafts)
        return StepBitmask(tensor, rows, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


if __name__ == "__main__":
    _helper_main()
