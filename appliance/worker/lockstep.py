"""Data-parallel engine cores that split a mixture-of-experts model's experts
(``parallel.enable_expert_parallel`` with ``data_parallel_size > 1``).

Each core schedules its own requests and runs attention on them alone, but
every sparse layer exchanges rows with the other cores (``SparseMoe.exchange``
over ``ExpertGroup``, or, with the core's ranks in worker processes, each
rank with its peers in the other cores), so the cores must run their
forwards together. Before
each step of its loop a core calls ``Lockstep.agree(has_work, stopping)``, an
all-reduce of two flags over the cores: when any core has work, every core
steps, and one with nothing scheduled runs ``idle_step`` (the model's
exchanges with no rows of its own; ``LockstepRunner`` does the same for a
step the scheduler leaves empty). When all are idle they only agree, every
few milliseconds, until a request arrives somewhere.

A collective that fails (a core died or hung past ``parallel.step_timeout_s``)
and any failure inside a forward are fatal (``EngineDeadError``): the cores'
collectives can no longer line up, so the front end restarts them together.
"""

from __future__ import annotations

from typing import Any

import torch

from appliance.engine.interfaces import EngineDeadError

IDLE_POLL_MS = 5  # how long an idle core waits for input between agreements


class ExpertGroup:
    """The cores' collectives, with a failure made fatal: a ``ShmComm`` over
    the front end's segment, or a torch.distributed group (gloo on CPUs,
    NCCL on GPUs) at the address it picked; small tensors (the agreement's
    flags) live on ``device``."""

    def __init__(self, comm: Any, rank: int, world_size: int, device: Any = "cpu"):
        self.comm, self.rank, self.world_size, self.device = comm, rank, world_size, device

    def _run(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as e:
            raise EngineDeadError(f"the data-parallel engine cores' expert exchange failed ({what}): {e}") from e

    def all_reduce(self, t: torch.Tensor) -> None:
        self._run("all-reduce", self.comm.all_reduce, t)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._run("all-gather", self.comm.all_gather, t)

    @property
    def has_all_to_all(self) -> bool:
        return getattr(self.comm, "has_all_to_all", False)

    def all_to_all(self, t: torch.Tensor, send_counts: list[int], recv_counts: Any = None) -> tuple:
        return self._run("all-to-all", self.comm.all_to_all, t, send_counts, recv_counts)


class LockstepRunner:
    """A model runner whose every step is a forward the peers join: a step
    with nothing scheduled still runs the idle forward, and a failed step
    is fatal (``EngineDeadError``) rather than retried request by request.
    ``runner``: a ``ModelRunner`` (the model in this process), or an
    executor over the core's tensor-parallel ranks, each of which runs its
    ``ModelRunner`` in a ``LockstepRunner`` of its own."""

    max_batches_in_flight = 1  # the cores' steps pair up one by one, through every pipeline stage

    def __init__(self, runner: Any):
        self.runner = runner
        self.in_process = hasattr(runner, "model")

    def __getattr__(self, name: str) -> Any:  # the model runner's other attributes (model, backend, ...)
        return getattr(self.runner, name)

    def execute(self, so: Any) -> Any:
        try:
            out = self.runner.execute(so)
            if not so.num_scheduled_tokens and self.in_process:  # an executor's ranks run theirs
                self.runner.model.idle_forward()
            return out
        except EngineDeadError:
            raise
        except Exception as e:
            raise EngineDeadError(f"a lock-step forward failed ({type(e).__name__}: {e}); the data-parallel "
                                  f"engine cores restart together") from e

    def idle(self) -> None:
        """This core's part of a step it has no requests for: the model's
        exchanges with no rows, here or on every rank (an empty step)."""
        if not self.in_process:
            from appliance.engine.scheduler_output import SchedulerOutput

            self.execute(SchedulerOutput())
            return
        try:
            self.runner.model.idle_forward()
        except EngineDeadError:
            raise
        except Exception as e:
            raise EngineDeadError(f"an idle lock-step forward failed ({type(e).__name__}: {e})") from e


class Lockstep:
    """What an engine core's loop asks before each step (see the module docstring)."""

    idle_poll_ms = IDLE_POLL_MS

    def __init__(self, group: ExpertGroup, runner: LockstepRunner):
        self.group, self.runner = group, runner

    def agree(self, has_work: bool, stopping: bool) -> tuple[bool, bool]:
        """(whether any core has work, whether every core is stopping)."""
        flags = torch.tensor([float(has_work), float(stopping)], device=self.group.device)
        self.group.all_reduce(flags)
        return bool(flags[0] > 0), int(flags[1]) == self.group.world_size

    def idle_step(self) -> None:
        """This core's part of a step it has no requests for."""
        self.runner.idle()
