"""The front end's handle on the engine-core process.

Starts the core (spawned: a fresh interpreter that loads the model), waits
for it to be ready, sends requests and aborts, and routes each output
delta to the request's queue. A watchdog notices the core's death: every
waiting request then fails with ``EngineDeadError`` (HTTP 503) and
``/health`` fails.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from appliance.engine.core import StepStats
from appliance.server.core_proc import decode, encode, params_to_dict, run_core

log = logging.getLogger("appliance.server")


class EngineDeadError(RuntimeError):
    pass


class RequestRejected(ValueError):
    pass


@dataclass
class _Pending:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False


class EngineClient:
    def __init__(self, resolved: Any, selection: Any, on_stats: Optional[Callable[[StepStats, StepStats], None]] = None):
        self.resolved = resolved
        self.selection = selection
        self.on_stats = on_stats
        self.proc: Optional[mp.process.BaseProcess] = None
        self.pending: dict[str, _Pending] = {}
        self.stats = StepStats()
        self.ready_info: dict = {}
        self.dead = False
        self.dead_reason = ""
        self._tasks: list[asyncio.Task] = []
        self._reset_waiters: list[asyncio.Future] = []
        self._dir = tempfile.mkdtemp(prefix="appliance-ipc-")

    # -- lifecycle -------------------------------------------------------------
    async def start(self, timeout_s: float = 600.0) -> None:
        import zmq
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context()
        tag = uuid.uuid4().hex[:8]
        in_addr = f"ipc://{self._dir}/in-{tag}"
        out_addr = f"ipc://{self._dir}/out-{tag}"
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.bind(in_addr)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(out_addr)
        spawn = mp.get_context("spawn")
        self.proc = spawn.Process(target=run_core, args=(self.resolved, self.selection, in_addr, out_addr),
                                  name="appliance-engine-core", daemon=True)
        self.proc.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if await self.pull.poll(200):
                msg = decode(await self.pull.recv())
                if msg["type"] == "ready":
                    self.ready_info = msg
                    break
                if msg["type"] == "fatal":
                    raise EngineDeadError(f"the engine core failed to start: {msg['message']}")
            if not self.proc.is_alive():
                raise EngineDeadError(f"the engine core exited during start-up (exit code {self.proc.exitcode})")
            if loop.time() > deadline:
                raise EngineDeadError(f"the engine core was not ready after {timeout_s:.0f} s")
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watchdog())]

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.is_alive() and not self.dead:
            await self.push.send(encode({"type": "shutdown"}))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while self.proc.is_alive() and loop.time() < deadline:
                await asyncio.sleep(0.05)
        for t in self._tasks:
            t.cancel()
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _mark_dead(self, reason: str) -> None:
        if self.dead:
            return
        self.dead, self.dead_reason = True, reason
        log.error("engine core is dead: %s", reason)
        for p in self.pending.values():
            p.queue.put_nowait(EngineDeadError(reason))
        for f in self._reset_waiters:
            if not f.done():
                f.set_exception(EngineDeadError(reason))

    async def _watchdog(self) -> None:
        while not self.dead:
            await asyncio.sleep(0.2)
            if self.proc is not None and not self.proc.is_alive():
                self._mark_dead(f"engine core process exited with code {self.proc.exitcode}")

    async def _output_loop(self) -> None:
        while not self.dead:
            msg = decode(await self.pull.recv())
            kind = msg["type"]
            if kind == "outputs":
                for d in msg["outputs"]:
                    p = self.pending.get(d["request_id"])
                    if p is not None:
                        p.queue.put_nowait(d)
                old, self.stats = self.stats, StepStats(**msg["stats"])
                if self.on_stats:
                    self.on_stats(old, self.stats)
            elif kind == "request_error":
                p = self.pending.get(msg["request_id"])
                if p is not None:
                    p.queue.put_nowait(RequestRejected(msg["message"]))
            elif kind == "reset_prefix_cache":
                if self._reset_waiters:
                    self._reset_waiters.pop(0).set_result(msg["ok"])
            elif kind == "fatal":
                self._mark_dead(msg["message"])

    # -- requests ----------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: Any, priority: int = 0,
                       cache_salt: Optional[str] = None) -> AsyncIterator[dict]:
        """Output deltas of one request; aborts it in the core if the
        consumer stops early (client disconnect, cancellation)."""
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        p = _Pending()
        self.pending[request_id] = p
        try:
            await self.push.send(encode({"type": "add", "request_id": request_id, "prompt_token_ids": prompt_token_ids,
                                         "params": params_to_dict(params), "priority": priority,
                                         "cache_salt": cache_salt}))
            while True:
                item = await p.queue.get()
                if isinstance(item, Exception):
                    p.finished = True
                    raise item
                if item["finished"]:
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
        if not self.dead:
            self.push.send(encode({"type": "abort", "request_ids": request_ids}))

    async def reset_prefix_cache(self) -> bool:
        fut = asyncio.get_running_loop().create_future()
        self._reset_waiters.append(fut)
        await self.push.send(encode({"type": "reset_prefix_cache"}))
        return await fut
