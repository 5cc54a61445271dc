"""The model side of a step over Ray actors (``parallel.executor=ray``).

``RayExecutor`` is the engine core's step runner when its ranks are Ray
actors, on this host or across the nodes of a Ray cluster: it connects to
``parallel.ray_address`` (null: a new local Ray instance, stopped with the
executor; ``auto``: the cluster ``ray start`` or ``RAY_ADDRESS`` names; or
an address), reserves a placement group of one bundle per rank (a CPU, and
a GPU on GPU profiles; ``PACK``: a node's ranks together), and starts an
actor per bundle. Each actor becomes its rank as a worker process of the
``mp`` executor does (``rank_group.init_rank``): CPU ranks take their share
of their node's cores, the ranks of one CPU node share a memory segment for
their collectives (``parallel.cpu_collectives=shm``), others join
torch.distributed at rank 0's node (gloo, or NCCL on CUDA).

Every step goes to every actor (up to one per pipeline stage in flight);
the replies combine as the ``mp`` executor's do
(``executor.combine_replies``): the last pipeline stage's first rank's
output, its ranks' tokens checked equal. An actor that dies
(``RayActorError``), a step past ``parallel.step_timeout_s``, or ranks
that disagree raise ``EngineDeadError``; the actors and their placement
group are removed with the executor.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import time
from typing import Any, Optional

from appliance.engine.interfaces import EngineDeadError
from appliance.worker.executor import LOAD_TIMEOUT_S, combine_replies, leave_group, run_step
from appliance.worker.rank_group import RankGroup, create_segments, init_rank, unlink_segments

log = logging.getLogger("appliance.executor")


class RankActor:
    """One rank, as a Ray actor (``ray.remote`` is applied where Ray is loaded)."""

    def __init__(self) -> None:
        self.runner: Any = None

    def where(self) -> tuple[str, str, int]:
        """(node id, node IP, pid)."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def create_segments(self, tp_size: int, pp_size: int) -> dict[str, str]:
        return create_segments(tp_size, pp_size)

    def unlink_segments(self, segments: dict[str, str]) -> None:
        unlink_segments(segments)

    def init(self, group: RankGroup, rank: int, init_method: str, segments: Optional[dict[str, str]],
             local_rank: int, local_world_size: int) -> tuple:
        try:
            self.runner = init_rank(group, rank, init_method, segments, local_rank, local_world_size)
        except Exception as e:
            import traceback

            return "error", f"{type(e).__name__}: {e}", traceback.format_exc()
        return "ready", None, None

    def execute(self, sched_out: Any) -> tuple:
        return run_step(self.runner, sched_out)

    def stop(self) -> None:
        leave_group()


class RayExecutor:
    """A step runner over ``group``'s ranks, a Ray actor each; see the module docstring."""

    def __init__(self, group: RankGroup):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray, self._remove_pg = ray, remove_placement_group
        self.world_size = world_size = group.world_size
        self.timeout_s = timeout_s = group.step_timeout_s
        self._tp_size, self._pp_size = group.tensor_parallel_size, group.pipeline_parallel_size
        self._in_flight: collections.deque[list] = collections.deque()  # each step's replies, oldest first
        address = group.ray_address
        self._started = False  # a local instance this executor started (and stops)
        if not ray.is_initialized():
            ignored = signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
            if address is None:
                ray.init(address="local", num_cpus=max(os.cpu_count() or 1, world_size), include_dashboard=False,
                         log_to_driver=False)
                self._started = True
            else:
                ray.init(address=address, log_to_driver=False)
            if ignored:  # ray.init installs its own handler; the engine core leaves shutdown to its front end
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
        gpu = group.device != "cpu"
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpu else {})}
        self._pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        self._actors: list[Any] = []
        try:
            ready = self._pg.ready()
            done, _ = ray.wait([ready], timeout=LOAD_TIMEOUT_S)
            if not done:
                raise RuntimeError(f"the Ray cluster could not place {world_size} bundles of {bundle} within "
                                   f"{LOAD_TIMEOUT_S:g} s (its resources: {ray.cluster_resources()})")
            actor_cls = ray.remote(RankActor)
            self._actors = [
                actor_cls.options(num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(
                                      placement_group=self._pg, placement_group_bundle_index=rank)).remote()
                for rank in range(world_size)
            ]
            where = self._get([a.where.remote() for a in self._actors], "starting the actors", LOAD_TIMEOUT_S)
            self.pids = [pid for _, _, pid in where]
            nodes = [node for node, _, _ in where]
            local_rank = [nodes[:r].count(nodes[r]) for r in range(world_size)]
            local_size = [nodes.count(nodes[r]) for r in range(world_size)]
            segments = None
            if len(set(nodes)) == 1 and group.collectives == "shm":
                segments = self._get([self._actors[0].create_segments.remote(
                    group.tensor_parallel_size, group.pipeline_parallel_size)], "memory segments")[0]
            port = self._get([self._actors[0].free_port.remote()], "a port")[0]
            init_method = f"tcp://{where[0][1]}:{port}"
            try:
                replies = self._get([a.init.remote(group, r, init_method, segments, local_rank[r], local_size[r])
                                     for r, a in enumerate(self._actors)],
                                    "loading the model", max(timeout_s, LOAD_TIMEOUT_S))
            finally:
                if segments:  # every rank has mapped them (or failed): the names can go
                    self._get([self._actors[0].unlink_segments.remote(segments)], "removing the segments' names")
            errors = [(r, msg) for r, (kind, msg, _) in enumerate(replies) if kind == "error"]
            if errors:
                rank, msg = errors[0]
                raise RuntimeError(f"tensor-parallel rank {rank} could not start: {msg}")
        except BaseException:
            self.close()
            raise
        log.info("ray executor: %d actors on %d node(s)", world_size, len(set(nodes)))

    def _get(self, refs: list, what: str, timeout_s: Optional[float] = None) -> list:
        """The results of ``refs`` in order; EngineDeadError when an actor died
        or they took longer than the timeout (the step's)."""
        ray = self._ray
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        rank_of = {ref: r for r, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:  # one at a time: a dead actor is seen at once, not after the others' collectives time out
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                self._dead(f"{what} took longer than {timeout_s:g} s (parallel.step_timeout_s={self.timeout_s:g}) "
                           f"on rank(s) {sorted(rank_of[r] for r in pending)}")
            for ref in done:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._dead(f"tensor-parallel rank {rank_of[ref]}'s Ray actor died during {what}: {e}")
        return [results[r] for r in range(len(refs))]

    @property
    def num_stages(self) -> int:
        return self._pp_size

    @property
    def max_batches_in_flight(self) -> int:
        """One step per pipeline stage (as the ``mp`` executor)."""
        return self._pp_size

    def execute(self, sched_out: Any) -> Any:
        self.submit(sched_out)
        return self.collect()

    def submit(self, sched_out: Any) -> None:
        """Send a step to every actor (an actor runs its calls in the order sent)."""
        ref = self._ray.put(sched_out)  # serialized once for every actor
        self._in_flight.append([a.execute.remote(ref) for a in self._actors])

    def collect(self) -> Any:
        """The output of the oldest step submitted and not collected."""
        return combine_replies(self._get(self._in_flight.popleft(), "a step"), self._dead, self._tp_size)

    def _dead(self, why: str) -> None:
        self.close()
        raise EngineDeadError(why)

    def close(self) -> None:
        ray = self._ray
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        if self._pg is not None:
            try:
                self._remove_pg(self._pg)
            except Exception:  # the cluster is gone already
                pass
            self._pg = None
        if self._started:
            ray.shutdown()
            self._started = False
