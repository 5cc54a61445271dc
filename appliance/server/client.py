"""The front end's handle on the engine-core process, and its supervisor.

Starts the core (spawned: a fresh interpreter that loads the model), waits
for it to be ready, sends requests and aborts, and routes each output
delta to the request's queue.

A watchdog notices the core's death (kill, crash, a ``fatal`` message) the
moment its process ends (the process sentinel, a pipe the kernel closes):
every waiting request fails at once with ``EngineRestartingError`` (HTTP
503) and a replacement core is started on fresh sockets after
``server.core_restart_backoff_s``, doubled for each restart in the last
``server.core_restart_window_s``. While it is down ``restarting`` is set
(``/ready`` and ``/health`` answer 503, new requests 503 with Retry-After).
When ``server.max_core_restarts`` restarts in the window have not kept it
up (a replacement that fails to start counts too), the client is ``dead``
for good and ``on_fatal`` is called: the server exits non-zero so its
orchestrator takes over.

A process takes a while to end after a kill or a crash (the kernel frees its
memory, and a GPU context, before it closes its files and can be waited
for): ``exiting`` reads the kernel's view of the process (``process_ending``)
so ``/ready`` and ``/health`` answer 503 from the moment the core is lost.

The core's step loop sends a heartbeat (``core_proc.py``); every message
from it counts. A core not heard from for ``server.core_heartbeat_timeout_s``
is ``unresponsive`` (stopped, or stuck in a step): the probes answer 503,
the watchdog logs it and logs again when the core is heard from. Such a core
is not restarted: it may be in a step longer than the timeout, and the
orchestrator watching ``/health`` decides.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional, Union

from appliance.config.deployment import Deployment
from appliance.engine.outputs import RequestOutputDelta, StepStats
from appliance.engine.interfaces import EngineDeadError
from appliance.sampling_params import SamplingParams
from appliance.server.core_proc import BuildEngine, run_core
from appliance.server.messages import (
    AbortRequests,
    AddRequest,
    Fatal,
    Outputs,
    Ready,
    RequestError,
    ResetPrefixCache,
    ResetPrefixCacheResult,
    Shutdown,
    ToCore,
    decode_from_core,
    encode,
)

if TYPE_CHECKING:
    import zmq.asyncio

log = logging.getLogger("appliance.server")

WATCH_INTERVAL_S = 0.1  # how often the watchdog looks at the core when its sentinel says nothing
PF_EXITING = 0x4  # /proc/<pid>/stat flags: the process is ending (include/linux/sched.h)
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)  # in /proc/<pid>/status's ShdPnd mask


def process_ending(pid: int) -> bool:
    """Whether the child process ``pid``, not yet waited for, is on its way
    out as Linux's ``/proc`` tells it: a SIGKILL pending (from the moment
    ``kill`` returns), its exit under way, a zombie. False where ``/proc``
    cannot say (another OS): the sentinel and ``is_alive`` still tell, later."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except FileNotFoundError:
        return os.path.isdir("/proc/self")  # gone (reaped meanwhile), where /proc is there to say so
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 2:].split()  # after the command name, which may hold spaces
    if fields[0] in (b"Z", b"X", b"x") or int(fields[6]) & PF_EXITING:
        return True
    for line in status.splitlines():
        if line.startswith(b"ShdPnd:"):
            return bool(int(line.split()[1], 16) & SIGKILL_BIT)
    return False


class EngineRestartingError(EngineDeadError):
    """The core died under the request (or is down now); a replacement is starting."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestRejected(ValueError):
    pass


@dataclass
class _Pending:
    queue: asyncio.Queue[Union[RequestOutputDelta, Exception]] = field(default_factory=asyncio.Queue)
    finished: bool = False


class EngineClient:
    def __init__(self, deployment: Deployment, build_engine: BuildEngine,
                 on_stats: Optional[Callable[[StepStats, StepStats], None]] = None,
                 on_restart: Optional[Callable[[], None]] = None, on_fatal: Optional[Callable[[str], None]] = None,
                 rank: Optional[int] = None):
        """``rank``: the data-parallel rank this core is, named in its logs (None: the only core)."""
        self.deployment = deployment
        # Hooks of a data-parallel group whose cores restart together (expert parallelism across them):
        # ``prepare()`` gives the deployment each new core builds, ``on_lost()`` hears that this core is gone
        # (or a replacement did not come up), ``on_ready()`` that a new core is up.
        self.prepare: Optional[Callable[[], Deployment]] = None
        self.on_lost: Optional[Callable[[], None]] = None
        self.on_ready: Optional[Callable[[], None]] = None
        self.core_name = "engine core" if rank is None else f"engine core {rank}"
        self.build_engine = build_engine  # run in the core process (a module-level function: it is pickled)
        self.on_stats = on_stats
        self.on_restart = on_restart  # a replacement core is being started
        self.on_fatal = on_fatal  # restarts are exhausted: the client is dead for good
        server = deployment.cfg.server
        self.max_restarts = server.max_core_restarts
        self.restart_window_s = server.core_restart_window_s
        self.restart_backoff_s = server.core_restart_backoff_s
        self.start_timeout_s = server.core_start_timeout_s
        self.heartbeat_timeout_s = server.core_heartbeat_timeout_s
        self.proc: Optional[mp.process.BaseProcess] = None
        self.pending: dict[str, _Pending] = {}
        self.stats = StepStats()
        self.ready_info: Optional[Ready] = None  # what the running core said when it came up
        self.dead = False
        self.dead_reason = ""
        self.restarting = False
        self.down_reason = ""  # why the core is down while restarting
        self.restarts = 0  # replacement cores started
        self.start_s = 0.0  # how long the last successful start took
        self.last_heard = 0.0  # loop time of the running core's last message (its heartbeat, outputs, ...)
        self._silence_logged = False  # the running core's silence has been logged (its recovery is logged next)
        self._restart_times: deque[float] = deque()
        self._next_attempt = 0.0  # loop time of the next start while restarting
        self._closing = False
        self._tasks: list[asyncio.Task] = []
        self._supervisor: Optional[asyncio.Task] = None
        self._reset_waiters: list[asyncio.Future[bool]] = []
        self._dir = tempfile.mkdtemp(prefix="appliance-ipc-")
        self.ctx: Optional[zmq.asyncio.Context] = None
        self.push: Optional[zmq.asyncio.Socket] = None
        self.pull: Optional[zmq.asyncio.Socket] = None

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        """Start the first core; ``EngineDeadError`` if it does not come up."""
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context()
        await self._launch()

    async def _launch(self) -> None:
        """Spawn a core on fresh sockets and wait for its ready message."""
        import zmq

        if self.prepare is not None:
            self.deployment = self.prepare()
        tag = uuid.uuid4().hex[:8]
        in_addr = f"ipc://{self._dir}/in-{tag}"
        out_addr = f"ipc://{self._dir}/out-{tag}"
        assert self.ctx is not None  # start() made it
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.bind(in_addr)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(out_addr)
        spawn = mp.get_context("spawn")
        self.proc = spawn.Process(target=run_core, args=(self.deployment, self.build_engine, in_addr, out_addr),
                                  name="appliance-" + self.core_name.replace(" ", "-"), daemon=True)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            self.proc.start()
            while True:
                if await self.pull.poll(200):
                    msg = decode_from_core(await self.pull.recv())
                    if isinstance(msg, Ready):
                        self.ready_info = msg
                        break
                    if isinstance(msg, Fatal):
                        raise EngineDeadError(f"the {self.core_name} failed to start: {msg.message}")
                if not self.proc.is_alive():
                    raise EngineDeadError(f"the {self.core_name} exited during start-up (exit code {self.proc.exitcode})")
                if loop.time() - t0 > self.start_timeout_s:
                    raise EngineDeadError(f"the {self.core_name} was not ready after {self.start_timeout_s:g} s "
                                          f"(server.core_start_timeout_s)")
        except BaseException:
            self._stop_core()
            raise
        self.start_s = loop.time() - t0
        self.last_heard, self._silence_logged = loop.time(), False
        self.stats = StepStats()  # a new core counts from zero
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watchdog(self.proc))]
        if self.on_ready is not None:
            self.on_ready()

    def _stop_core(self) -> None:
        """Kill the current core if it still runs (it ignores SIGTERM) and drop its sockets."""
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
        for sock in (self.push, self.pull):
            if sock is not None:
                sock.close(linger=0)
        self.push = self.pull = None

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if self.up and self.proc is not None and self.proc.is_alive():
            self._send(Shutdown())
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while self.proc.is_alive() and loop.time() < deadline:
                await asyncio.sleep(0.05)
        self._stop_core()
        if self.ctx is not None:
            self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def up(self) -> bool:
        return self.push is not None and not (self.dead or self.restarting or self._closing)

    def _send(self, msg: ToCore) -> None:
        """Queue a message to the core without awaiting it: a send never waits on
        a core that has died (closing its socket drops what is queued)."""
        assert self.push is not None  # callers send only while the core is up
        self.push.send(encode(msg))

    def _fail_waiters(self, exc: Exception) -> None:
        for p in self.pending.values():
            p.queue.put_nowait(exc)
        for f in self._reset_waiters:
            if not f.done():
                f.set_exception(exc)
        self._reset_waiters = []

    def _recent_restarts(self) -> int:
        now = asyncio.get_running_loop().time()
        while self._restart_times and now - self._restart_times[0] > self.restart_window_s:
            self._restart_times.popleft()
        return len(self._restart_times)

    def _core_lost(self, reason: str) -> None:
        """The running core is gone: fail what waits on it, then restart it or give up."""
        if self._closing or self.dead or self.restarting:
            return
        log.error("%s died: %s", self.core_name, reason)
        self._stop_core()
        if self.on_lost is not None:
            self.on_lost()
        old, self.stats = self.stats, StepStats()
        if self.on_stats:
            self.on_stats(old, self.stats)
        if self._recent_restarts() >= self.max_restarts:
            self._give_up(reason)
            return
        self.restarting, self.down_reason = True, reason
        self._next_attempt = asyncio.get_running_loop().time() + self._backoff()
        self._fail_waiters(EngineRestartingError(f"the {self.core_name} died ({reason}) and is being restarted",
                                                 self.retry_after_s()))
        self._supervisor = asyncio.create_task(self._restart_loop())

    def _give_up(self, reason: str) -> None:
        n = len(self._restart_times)
        self.restarting = False
        self.dead = True
        self.dead_reason = (f"{reason}; {n} restart(s) in the last {self.restart_window_s:g} s did not keep it up "
                            f"(server.max_core_restarts={self.max_restarts})")
        log.error("%s is dead: %s", self.core_name, self.dead_reason)
        self._fail_waiters(EngineDeadError(self.dead_reason))
        if self.on_fatal:
            self.on_fatal(self.dead_reason)

    async def _restart_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            n = self._recent_restarts()
            if n >= self.max_restarts:
                self._give_up(self.down_reason)
                return
            delay = self._backoff()
            self._next_attempt = loop.time() + delay
            log.warning("restarting the %s in %.1f s (restart %d of at most %d in %g s)", self.core_name, delay, n + 1,
                        self.max_restarts, self.restart_window_s)
            await asyncio.sleep(delay)
            self._restart_times.append(loop.time())
            self.restarts += 1
            if self.on_restart:
                self.on_restart()
            try:
                await self._launch()
            except EngineDeadError as e:
                log.error("the replacement %s did not come up: %s", self.core_name, e)
                self.down_reason = str(e)
                if self.on_lost is not None:
                    self.on_lost()
                continue
            self.restarting, self.down_reason = False, ""
            log.info("%s restarted (pid %s, ready after %.1f s)", self.core_name,
                     self.ready_info.pid if self.ready_info is not None else "?", self.start_s)
            return

    def _backoff(self) -> float:
        return self.restart_backoff_s * 2 ** self._recent_restarts()

    def retry_after_s(self) -> int:
        """Seconds a client should wait while the core restarts: the backoff left plus one start."""
        if not self.restarting:
            return 1
        left = max(0.0, self._next_attempt - asyncio.get_running_loop().time())
        return max(1, math.ceil(left + self.start_s))

    async def _watchdog(self, proc: mp.process.BaseProcess) -> None:
        """Wait for the core's exit: its sentinel closes as it ends (and
        ``is_alive`` is polled too, should a process it started hold the
        sentinel open); meanwhile log its heartbeat stopping and resuming."""
        loop = asyncio.get_running_loop()
        closed = loop.create_future()

        def on_closed() -> None:
            loop.remove_reader(proc.sentinel)  # readable for good now
            closed.set_result(None)

        loop.add_reader(proc.sentinel, on_closed)
        try:
            while proc.is_alive():
                if closed.done():
                    await asyncio.sleep(0.001)  # its files are closed: it can be waited for in a moment
                else:
                    await asyncio.wait([closed], timeout=WATCH_INTERVAL_S)
                self._log_silence()
        finally:
            loop.remove_reader(proc.sentinel)
        self._core_lost(f"engine core process exited with code {proc.exitcode}")

    def silent_s(self) -> Optional[float]:
        """Seconds since the running core was last heard from; None while none runs."""
        if not self.up:
            return None
        return asyncio.get_running_loop().time() - self.last_heard

    @property
    def unresponsive(self) -> bool:
        """The running core has not been heard from for ``server.core_heartbeat_timeout_s``."""
        silent = self.silent_s()
        return silent is not None and silent > self.heartbeat_timeout_s

    def unresponsive_reason(self) -> str:
        return (f"the {self.core_name} has made no progress for {self.silent_s():.1f} s "
                f"(server.core_heartbeat_timeout_s={self.heartbeat_timeout_s:g})")

    def silence(self) -> Optional[str]:
        """Why the running core counts as unresponsive (None: it does not). The stall is logged the first time
        it is seen, by a probe or by the watchdog's round, whichever comes first: a probe can see it between two
        rounds, and the core can be heard from again before the next."""
        self._log_silence()
        return self.unresponsive_reason() if self.unresponsive else None

    def _log_silence(self) -> None:
        silent = self.unresponsive
        if silent and not self._silence_logged:
            log.error("%s; /health and /ready answer 503 until it is heard from", self.unresponsive_reason())
        elif self._silence_logged and not silent:
            log.warning("the %s is heard from again", self.core_name)
        self._silence_logged = silent

    @property
    def exiting(self) -> bool:
        """The running core's process has ended or is ending, and its
        watchdog has not yet taken it for lost."""
        proc = self.proc
        return self.up and proc is not None and (not proc.is_alive() or (proc.pid is not None
                                                                            and process_ending(proc.pid)))

    async def _output_loop(self) -> None:
        try:
            assert self.pull is not None  # the loop starts once the core's sockets are bound
            await self._read_outputs(self.pull)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # nothing would ever answer the waiting requests: treat it as the core's loss
            log.exception("reading the %s's outputs failed", self.core_name)
            self._core_lost(f"its outputs could not be read ({type(e).__name__}: {e})")

    async def _read_outputs(self, pull: zmq.asyncio.Socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            msg = decode_from_core(await pull.recv())
            self.last_heard = loop.time()  # a heartbeat needs nothing more
            if isinstance(msg, Outputs):
                for d in msg.outputs:
                    p = self.pending.get(d.request_id)
                    if p is not None:
                        p.queue.put_nowait(d)
                old, self.stats = self.stats, msg.stats
                if self.on_stats:
                    self.on_stats(old, self.stats)
            elif isinstance(msg, RequestError):
                p = self.pending.get(msg.request_id)
                if p is not None:
                    p.queue.put_nowait(RequestRejected(msg.message))
            elif isinstance(msg, ResetPrefixCacheResult):
                if self._reset_waiters:
                    self._reset_waiters.pop(0).set_result(msg.ok)
            elif isinstance(msg, Fatal):
                self._core_lost(msg.message)
                return

    # -- requests ----------------------------------------------------------------
    def check_up(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        if self.restarting:
            raise EngineRestartingError(f"the {self.core_name} is restarting ({self.down_reason})", self.retry_after_s())
        if not self.up:
            raise EngineDeadError("the engine is shutting down")

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
                       cache_salt: Optional[str] = None) -> AsyncIterator[RequestOutputDelta]:
        """Output deltas of one request; aborts it in the core if the
        consumer stops early (client disconnect, cancellation)."""
        self.check_up()
        p = _Pending()
        self.pending[request_id] = p
        try:
            self._send(AddRequest(request_id, prompt_token_ids, params, priority, cache_salt))
            while True:
                item = await p.queue.get()
                if isinstance(item, Exception):
                    p.finished = True
                    raise item
                if item.finished:
                    p.finished = True
                yield item
                if p.finished:
                    return
        finally:
            self.pending.pop(request_id, None)
            if not p.finished:
                self.abort_nowait([request_id])

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Queue an abort without awaiting: safe from a cancelled task or a finally block."""
        if self.up:
            self._send(AbortRequests(request_ids))

    async def reset_prefix_cache(self) -> bool:
        self.check_up()
        fut = asyncio.get_running_loop().create_future()
        self._reset_waiters.append(fut)
        self._send(ResetPrefixCache())
        return await fut
