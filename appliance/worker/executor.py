"""The model side of a step over worker processes (``parallel.executor=mp``).

``MultiprocExecutor`` is the engine core's step runner when the model is
split across tensor- and pipeline-parallel ranks: it starts one worker
process per rank on this host (a fresh interpreter, ``python -m
appliance.worker.executor``, talking over a socket pair, so nothing of the
engine's process is inherited or re-imported), each of which joins the
collectives (``rank_group.init_rank``: shared-memory segments between a CPU host's
ranks, else torch.distributed, gloo on CPUs and NCCL on CUDA) and builds
its rank's model runner with the function the composition root hands down.
Every step's ``SchedulerOutput`` goes to every rank; each runs the same
forward on its part of the model (the collectives inside it, see
``models.layers.parallel.TensorParallel`` and ``PipelineParallel``) and answers with
its ``RunnerOutput``. The last pipeline stage's ranks sample, from the same
logits with the same seeded generator; the executor returns the first one's
output and checks that they all sampled the same tokens, so their
persistent batches cannot drift apart unseen. The earlier stages sample
nothing (the scheduler sends them each step's tokens), so a stage is free
for the next step once it has handed its rows on: the engine core may
``submit`` one step per stage before it ``collect``s the first
(``max_batches_in_flight``), and each rank works through its steps in
order.

Failures: a step that raised on every rank (the same inputs fail the same
way; a stage that fails hands its failure on, so the stages after it fail
too) is an ordinary failed step, which the engine core retries request by
request. A worker that exits, a step that outlasts
``parallel.step_timeout_s`` (a hung collective), ranks that disagree, or a
step that failed on some of a stage's ranks only raise
``EngineDeadError``: the workers are stopped and the engine ends (a
server's supervisor starts a new core). Workers die with the engine's
process (``PR_SET_PDEATHSIG``); none is left behind after ``close``.

On CPUs the ranks split the cores they may run on: each rank gets its own
run of them (pinned) and as many torch threads, or, with more ranks than
cores, one thread each.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

from appliance.engine.interfaces import EngineDeadError
from appliance.worker.rank_group import RankGroup, create_segments, free_port, init_rank, unlink_segments

log = logging.getLogger("appliance.executor")

LOAD_TIMEOUT_S = 600.0  # the longest the ranks may take to start and load, unless the step timeout is longer


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(frozen=True)
class RankError:
    """How a step failed on a rank: its traceback; whether the step's
    requests are not to blame and are recomputed (``retry_requests``, as a
    KV tier's unreadable block); what its KV connector finished before it
    failed."""

    traceback: str
    retry_requests: bool = False
    kv_connector_output: Any = None


class StepFailed(RuntimeError):
    """A step that failed on every rank from some pipeline stage on (see
    ``combine_replies``), with what the engine core applies of it."""

    def __init__(self, message: str, retry_requests: bool, kv_connector_output: Any):
        super().__init__(message)
        self.retry_requests, self.kv_connector_output = retry_requests, kv_connector_output


def run_step(runner: Any, sched_out: Any) -> tuple:
    """One step on this rank, as the executors' replies: ("ok", output, None)
    or ("error", message, RankError)."""
    try:
        return "ok", runner.execute(sched_out), None
    except Exception as e:
        return "error", f"{type(e).__name__}: {e}", RankError(traceback.format_exc(),
                                                              getattr(e, "retry_requests", False),
                                                              getattr(e, "kv_connector_output", None))


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def combine_replies(replies: list[tuple], dead: Callable[[str], Any], tp_size: int = 1) -> Any:
    """The step's output from every rank's reply (world rank order,
    ``tp_size`` ranks per pipeline stage): the last stage's first rank's
    (only the last stage samples), its ranks' tokens checked equal.
    ``dead(why)`` (it raises EngineDeadError) when some of a stage's ranks
    failed and others did not, when a stage failed and a later one did not
    (a failed stage hands its failure on), or when ranks sampled different
    tokens; ``StepFailed`` when the step failed on every rank of some
    stages and so of every stage after them (the same inputs fail the same
    way: an ordinary failed step; the earlier stages' part of it is
    recomputed with the rest). What every rank's KV connector finished goes
    with the output, or the failure, as one report (``merge_rank_outputs``)."""
    from appliance.engine.kv_connector import merge_rank_outputs

    stages = [replies[s : s + tp_size] for s in range(0, len(replies), tp_size)]
    failed = [[kind == "error" for kind, _, _ in stage] for stage in stages]
    report = merge_rank_outputs([getattr(out if kind == "ok" else detail, "kv_connector_output", None)
                                 for kind, out, detail in replies])
    for s, ranks in enumerate(failed):
        if any(ranks) and not all(ranks):
            rank = s * tp_size + ranks.index(True)
            dead(f"the step failed on rank(s) {[s * tp_size + r for r, f in enumerate(ranks) if f]} only "
                 f"({replies[rank][1]}); the ranks' states differ now")
    failed_stages = [s for s, ranks in enumerate(failed) if ranks[0]]
    if failed_stages:
        first = failed_stages[0]
        if failed_stages != list(range(first, len(stages))):
            dead(f"pipeline stage {first} failed the step ({replies[first * tp_size][1]}) but a later stage ran it")
        log.error("the step failed on every rank from pipeline stage %d on; rank %d:\n%s", first,
                  first * tp_size, replies[first * tp_size][2].traceback)
        raise StepFailed(replies[first * tp_size][1],
                         any(detail.retry_requests for kind, _, detail in replies if kind == "error"), report)
    outs, first = [out for _, out, _ in stages[-1]], len(replies) - tp_size
    for rank, out in enumerate(outs[1:], first + 1):
        if out.sampled_token_ids != outs[0].sampled_token_ids:
            dead(f"tensor-parallel rank {rank} sampled other tokens than rank {first}")
    outs[0].kv_connector_output = report
    return outs[0]


def _worker(conn: Connection) -> None:
    """A rank's process: join the group, build the runner, then run every step it is sent."""
    _die_with_parent()
    group, rank, port, segments = pickle.loads(conn.recv_bytes())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's process owns shutdown
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the core ignores it, and an ignored signal survives exec
    try:
        runner = init_rank(group, rank, f"tcp://127.0.0.1:{port}", segments)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    conn.send(("ready", None, None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the engine went away
            break
        if msg[0] == "stop":
            break
        conn.send(run_step(runner, msg[1]))
    leave_group()


class MultiprocExecutor:
    """A step runner over ``group``'s ranks, a worker process each; see the module docstring."""

    def __init__(self, group: RankGroup):
        port = free_port()
        self.collectives = group.collectives
        segments = (create_segments(group.tensor_parallel_size, group.pipeline_parallel_size)
                    if self.collectives == "shm" else None)
        self.world_size = world_size = group.world_size
        self.timeout_s = timeout_s = group.step_timeout_s
        self._tp_size, self._pp_size = group.tensor_parallel_size, group.pipeline_parallel_size
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._sentinels: list[int] = []  # pidfds: readable once the process exits
        for rank in range(world_size):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "appliance.worker.executor", str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),))
            theirs.close()
            conn = Connection(ours.detach())
            conn.send_bytes(pickle.dumps((group, rank, port, segments)))
            self._procs.append(proc)
            self._conns.append(conn)
            self._sentinels.append(os.pidfd_open(proc.pid))
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, self._sentinels, segments)
        try:
            replies = self._collect("loading the model", max(timeout_s, LOAD_TIMEOUT_S))
        finally:
            unlink_segments(segments)  # every rank has mapped them (or failed): the names can go
        errors = [(r, msg) for r, (kind, msg, _) in enumerate(replies) if kind == "error"]
        if errors:
            self.close()
            rank, msg = errors[0]
            raise RuntimeError(f"tensor-parallel rank {rank} could not start: {msg}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def num_stages(self) -> int:
        """Pipeline stages (only the last one's ranks sample)."""
        return self._pp_size

    @property
    def max_batches_in_flight(self) -> int:
        """Steps the engine core may submit before it collects the first: one
        per pipeline stage, so the stages work on different batches."""
        return self._pp_size

    def execute(self, sched_out: Any) -> Any:
        self.submit(sched_out)
        return self.collect()

    def submit(self, sched_out: Any) -> None:
        """Send a step to every rank; ``collect`` returns the steps' outputs in the order submitted."""
        payload = pickle.dumps(("step", sched_out), protocol=pickle.HIGHEST_PROTOCOL)  # once for every rank
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, OSError):
                self._dead(f"tensor-parallel rank {rank} exited (its pipe broke)")

    def collect(self) -> Any:
        """The output of the oldest step submitted and not collected (see ``combine_replies``)."""
        return combine_replies(self._collect("a step"), self._dead, self._tp_size)

    def _collect(self, what: str, timeout_s: float | None = None) -> list[tuple]:
        """Every rank's reply, in rank order; EngineDeadError when a worker
        exits or the replies take longer than the timeout (the step's)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        pending = dict(enumerate(self._conns))
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        sentinels = {fd: r for r, fd in enumerate(self._sentinels)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._dead(f"{what} took longer than {timeout_s:g} s (parallel.step_timeout_s={self.timeout_s:g}) "
                           f"on rank(s) {sorted(pending)}")
            ready = wait([*pending.values(), *sentinels], timeout=left)
            for obj in ready:
                rank = next((r for r, c in pending.items() if c is obj), None)
                if rank is not None:
                    try:
                        replies[rank] = pending.pop(rank).recv()
                    except (EOFError, OSError):
                        self._dead(f"tensor-parallel rank {rank} closed its pipe during {what}")
            for obj in ready:
                if obj in sentinels and sentinels[obj] in pending:
                    rank = sentinels[obj]
                    self._dead(f"tensor-parallel rank {rank} exited (code {self._procs[rank].wait()}) during {what}")
        return [replies[r] for r in range(self.world_size)]

    def _dead(self, why: str) -> None:
        self.close()
        raise EngineDeadError(why)

    def close(self) -> None:
        self._finalizer()


def _stop(procs: list, conns: list, sentinels: list, segments: Optional[dict[str, str]] = None) -> None:
    """Ask every worker to stop, then make sure: terminate, then kill."""
    for conn in conns:
        try:
            conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
    deadline = time.monotonic() + 5
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for conn in conns:
        conn.close()
    for fd in sentinels:
        os.close(fd)
    unlink_segments(segments)


if __name__ == "__main__":
    # through the module's own name, so what a rank pickles back (RankError) names it, not __main__
    from appliance.worker.executor import _worker as worker

    worker(Connection(int(sys.argv[1])))
