"""Trial compiles in bounded child processes (``CompileSandbox``; see the
package docstring): one helper process (``python -m
appliance.structured_output``) forks a child per compile, its address
space capped and killed at a timeout."""

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
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import IO, Any, Optional

from appliance.structured_output.check import _MESSAGE_CHARS, _xgr

log = logging.getLogger("appliance.structured")

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
                    _stdin(helper).close()  # the helper kills its children and exits
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
            fds = [self._wake_r] + ([_stdout(helper).fileno()] if helper is not None else [])
            ready, _, _ = select.select(fds, [], [], wait_s)
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            if helper is not None and _stdout(helper).fileno() in ready:
                data = os.read(_stdout(helper).fileno(), 1 << 16)
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
                assert helper is not None  # trials run only beside a helper (its exit fails them all)
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
        _stdin(helper).write(_frame(self._init))
        _stdin(helper).flush()
        buf = bytearray()
        deadline = time.monotonic() + 120
        while not _unframe(buf):  # the helper's one answer: ready
            ready, _, _ = select.select([_stdout(helper)], [], [], max(0.0, deadline - time.monotonic()))
            data = os.read(_stdout(helper).fileno(), 1 << 16) if ready else b""
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


def _stdin(helper: subprocess.Popen) -> IO[bytes]:
    assert helper.stdin is not None  # the helper starts with its stdin and stdout piped (_start_helper)
    return helper.stdin


def _stdout(helper: subprocess.Popen) -> IO[bytes]:
    assert helper.stdout is not None
    return helper.stdout


def _send(helper: subprocess.Popen, msg: dict) -> None:
    try:
        _stdin(helper).write(_frame(msg))
        _stdin(helper).flush()
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
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer  # stdin read by its descriptor alone
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
