"""The model side of a step over worker processes (``parallel.executor=mp``).

``MultiprocExecutor`` is the engine core's step runner when the model is
split across tensor- and pipeline-parallel ranks: it starts one worker
process per rank on this host (a fresh interpreter, ``python -m
appliance.worker.executor``, talking over a socket pair, so nothing of the
engine's process is inherited or re-imported), each of which joins the
collectives (``init_rank``: shared-memory segments between a CPU host's
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
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

from appliance.engine.core import EngineDeadError
from appliance.worker.placement import pin_cpu_rank

log = logging.getLogger("appliance.executor")

LOAD_TIMEOUT_S = 600.0  # the longest the ranks may take to start and load, unless the step timeout is longer
# builds rank r's model runner: (deployment, rank, RankCollectives) -> ModelRunner (module level: it is pickled)
BuildRank = Callable[[Any, int, Any], Any]


class TorchDistributedComm:
    """The collectives a model runs, over a ``torch.distributed`` process
    group (``group``; None: every rank) whose backend moves tensors on
    ``device`` (``cuda`` for NCCL, ``cpu`` for gloo). ``broadcast`` names its
    source by its rank in the whole world."""

    def __init__(self, world_size: int, group: Any = None, device: str = "cpu"):
        self.world_size, self.group, self.device = world_size, group, device

    def _here(self, t: Any) -> Any:
        """``t`` on the group's device (NCCL moves only GPU tensors: a host flag, counter or count list
        goes there and its result comes back)."""
        return t if t.device.type == self.device else t.to(self.device)

    def all_reduce(self, t: Any) -> None:
        """In place, wherever ``t`` is."""
        import torch.distributed as dist

        staged = self._here(t)
        dist.all_reduce(staged, group=self.group)
        if staged is not t:
            t.copy_(staged)

    def all_gather(self, t: Any) -> list:
        """Every rank's ``t``, in rank order, where ``t`` is."""
        import torch
        import torch.distributed as dist

        staged = self._here(t.contiguous())
        out = [torch.empty_like(staged) for _ in range(self.world_size)]
        dist.all_gather(out, staged, group=self.group)
        return out if staged.device == t.device else [o.to(t.device) for o in out]

    def broadcast(self, t: Any, src: int) -> None:
        """In place, wherever ``t`` is."""
        import torch.distributed as dist

        staged = self._here(t)
        dist.broadcast(staged, src, group=self.group)
        if staged is not t:
            t.copy_(staged)

    has_all_to_all = True

    def all_to_all(self, t: Any, send_counts: list[int], recv_counts: Optional[list[int]] = None) -> tuple:
        """Rows ``t`` (in rank order, ``send_counts[r]`` of them to rank r) to
        their ranks: (the rows this rank received, in rank order, and how
        many from each; ``recv_counts`` when already known), where ``t`` is."""
        import torch
        import torch.distributed as dist

        rows = self._here(t.contiguous())
        if recv_counts is None:
            sent = torch.tensor(send_counts, dtype=torch.int64, device=rows.device)
            got = torch.empty_like(sent)
            dist.all_to_all_single(got, sent, group=self.group)
            recv_counts = got.tolist()
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        dist.all_to_all_single(out, rows, recv_counts, send_counts, group=self.group)
        return out.to(t.device), recv_counts


@dataclass(frozen=True)
class RankCollectives:
    """What a rank's model exchanges over: ``tp`` among its pipeline stage's
    tensor-parallel ranks (None: one); ``receive`` (the stage before's rows)
    and ``send`` (its rows to the next stage, its first rank only), each a
    (comm, source rank as the comm numbers it) pair whose broadcast spans
    the sending stage's first rank and the receiving stage's ranks (None:
    no such hand-off); ``experts``, with expert parallelism across
    data-parallel engine cores, this rank's peers of its tensor-parallel
    index in every core (rank = core)."""

    tp: Any = None
    receive: Optional[tuple[Any, int]] = None
    send: Optional[tuple[Any, int]] = None
    experts: Any = None


def rank_position(rank: int, tp_size: int) -> tuple[int, int]:
    """(pipeline stage, tensor-parallel rank) of world rank ``rank``: a stage's
    tensor-parallel ranks are consecutive, as vLLM numbers them."""
    return divmod(rank, tp_size)


def link_ranks(stage: int, tp_size: int) -> list[int]:
    """The world ranks of the hand-off from ``stage`` to the next: the
    stage's first rank, then the next stage's ranks."""
    return [stage * tp_size, *range((stage + 1) * tp_size, (stage + 2) * tp_size)]


def create_segments(tp_size: int, pp_size: int) -> dict[str, str]:
    """The shared-memory segments a layout's collectives need: one per stage
    for its tensor-parallel ranks (``tp<stage>``), one per hand-off between
    stages (``link<stage>``: that stage's first rank and the next stage's
    ranks)."""
    from appliance.kernels.shm_comm import create_segment

    out = {f"tp{stage}": create_segment(tp_size) for stage in range(pp_size)} if tp_size > 1 else {}
    out.update({f"link{stage}": create_segment(tp_size + 1) for stage in range(pp_size - 1)})
    return out


def unlink_segments(segments: Optional[dict[str, str]]) -> None:
    for path in (segments or {}).values():
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def init_rank(deployment: Any, build_rank: BuildRank, rank: int, world_size: int, init_method: str,
              segments: Optional[dict[str, str]], timeout_s: float, local_rank: Optional[int] = None,
              local_world_size: Optional[int] = None) -> Any:
    """Make this process rank ``rank``: take its cores (CPUs: its share of this
    host's, by ``local_rank`` of ``local_world_size`` ranks here) or its GPU,
    join the collectives (the shared-memory ``segments`` of
    ``create_segments``, else torch.distributed at ``init_method``: gloo on
    CPUs, NCCL on CUDA, a group per pipeline stage and per hand-off between
    stages), then build its model
    runner with its ``RankCollectives``."""
    import torch

    local_rank = rank if local_rank is None else local_rank
    local_world_size = world_size if local_world_size is None else local_world_size
    if deployment.device == "cpu":
        pin_cpu_rank(local_rank, local_world_size)
        backend = "gloo"
    else:
        torch.cuda.set_device(local_rank if torch.cuda.device_count() > 1 else 0)
        backend = "nccl"
    tp, pp = deployment.layout.tensor_parallel_size, deployment.layout.pipeline_parallel_size
    stage, tp_rank = rank_position(rank, tp)
    sends = stage < pp - 1 and tp_rank == 0
    cores = None  # expert parallelism across data-parallel cores: (how many, which, where their ranks meet)
    if deployment.layout.experts_across_cores:
        if deployment.expert_group is None or not deployment.expert_group.ranks:
            raise RuntimeError("expert parallelism across engine cores with their ranks in worker processes needs "
                               "the ranks' addresses the front end makes (Deployment.expert_group.ranks)")
        cores = (deployment.layout.data_parallel_size, deployment.data_parallel_rank, deployment.expert_group.ranks)
    if cores is not None and cores[2][0].startswith("tcp://"):  # one world of every core's ranks
        comms = _torch_comms(backend, cores[2][0], tp, pp, stage, tp_rank, timeout_s, cores[:2])
    elif segments is not None or (cores is not None and tp * pp == 1):  # one rank: no segments of its core
        from appliance.kernels.shm_comm import ShmComm

        def link(s: int, member: int) -> tuple[Any, int]:
            return ShmComm(segments[f"link{s}"], member, tp + 1, timeout_s), 0

        comms = RankCollectives(tp=ShmComm(segments[f"tp{stage}"], tp_rank, tp, timeout_s) if tp > 1 else None,
                                receive=link(stage - 1, 1 + tp_rank) if stage > 0 else None,
                                send=link(stage, 0) if sends else None)
        if cores is not None:  # this rank's peers in the other cores: a segment per stage and tensor-parallel index
            comms = replace(comms, experts=ShmComm(cores[2][stage * tp + tp_rank], cores[1], cores[0],
                                                               timeout_s))
    elif cores is not None:
        raise RuntimeError("the cores' ranks meet over shared memory but this core's ranks do not")
    else:
        comms = _torch_comms(backend, init_method, tp, pp, stage, tp_rank, timeout_s)
    return build_rank(deployment, rank, comms)


def _torch_comms(backend: str, init_method: str, tp: int, pp: int, stage: int, tp_rank: int, timeout_s: float,
                 cores: tuple[int, int] = (1, 0)) -> RankCollectives:
    """A rank's collectives over torch.distributed at ``init_method``: a
    group per pipeline stage's tensor-parallel ranks and per hand-off
    between stages. With ``cores`` (how many data-parallel engine cores,
    which is this rank's) that split the experts, one world of every core's
    ranks (world rank = core x tp x pp + rank in the core), every core's
    groups, and a group per stage and tensor-parallel index across the
    cores (``RankCollectives.experts``)."""
    import datetime

    import torch.distributed as dist

    n, (num_cores, core) = tp * pp, cores
    base = core * n
    dist.init_process_group(backend, init_method=init_method, rank=base + stage * tp + tp_rank,
                            world_size=num_cores * n, timeout=datetime.timedelta(seconds=timeout_s))
    # every rank makes every group, in one order
    if num_cores == 1 and pp == 1:
        stages = [[None]]  # the whole world
    else:
        stages = [[dist.new_group([c * n + s * tp + t for t in range(tp)]) if tp > 1 else None for s in range(pp)]
                  for c in range(num_cores)]
    links = [[dist.new_group([c * n + r for r in link_ranks(s, tp)]) for s in range(pp - 1)] for c in range(num_cores)]
    across = ([[dist.new_group([c * n + s * tp + t for c in range(num_cores)]) for t in range(tp)] for s in range(pp)]
              if num_cores > 1 else None)
    device = "cuda" if backend == "nccl" else "cpu"
    return RankCollectives(
        tp=TorchDistributedComm(tp, stages[core][stage], device) if tp > 1 else None,
        receive=(TorchDistributedComm(tp + 1, links[core][stage - 1], device), base + (stage - 1) * tp)
        if stage > 0 else None,
        send=(TorchDistributedComm(tp + 1, links[core][stage], device), base + stage * tp)
        if stage < pp - 1 and tp_rank == 0 else None,
        experts=TorchDistributedComm(num_cores, across[stage][tp_rank], device) if across is not None else None)


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
    deployment, build_rank, rank, world_size, port, segments, timeout_s = pickle.loads(conn.recv_bytes())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's process owns shutdown
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the core ignores it, and an ignored signal survives exec
    try:
        runner = init_rank(deployment, build_rank, rank, world_size, f"tcp://127.0.0.1:{port}", segments, timeout_s)
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
    """A step runner over ``world_size`` worker processes; see the module docstring."""

    def __init__(self, deployment: Any, build_rank: BuildRank, world_size: int, timeout_s: float):
        port = free_port()
        self.collectives = collectives(deployment, world_size)
        layout = deployment.layout
        segments = (create_segments(layout.tensor_parallel_size, layout.pipeline_parallel_size)
                    if self.collectives == "shm" else None)
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._tp_size, self._pp_size = layout.tensor_parallel_size, layout.pipeline_parallel_size
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._sentinels: list[int] = []  # pidfds: readable once the process exits
        for rank in range(world_size):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "appliance.worker.executor", str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),))
            theirs.close()
            conn = Connection(ours.detach())
            conn.send_bytes(pickle.dumps((deployment, build_rank, rank, world_size, port, segments, timeout_s)))
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


def collectives(deployment: Any, world_size: int) -> str:
    """How the ranks exchange: ``shm`` (one host's CPU ranks, where the
    shared-memory collectives build; else gloo with a warning), ``gloo``
    or ``nccl``."""
    if deployment.device != "cpu":
        return "nccl"
    if deployment.cfg.parallel.cpu_collectives != "shm" or world_size == 1:
        return "gloo"
    try:
        import appliance.kernels.shm_comm  # noqa: F401  (builds the library once, here)
    except ImportError as e:
        log.warning("parallel.cpu_collectives=shm: the shared-memory collectives cannot load (%s); the ranks use "
                    "gloo", e)
        return "gloo"
    return "shm"


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
