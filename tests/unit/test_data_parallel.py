"""Routing across data-parallel engine cores: the least loaded rank that is
up (``4 x waiting + running``), a pinned rank, ranks that are restarting or
unresponsive, what the probes read of the ranks, and the header / field that
pin a request."""

import pytest

from appliance.engine.outputs import StepStats
from appliance.server.client import EngineDeadError, EngineRestartingError
from appliance.server.data_parallel import DataParallelClient, balance_score
from appliance.server.protocol import OpenAIError, data_parallel_rank


class FakeCore:
    """What ``pick_rank`` and the probes read of an EngineClient."""

    def __init__(self, pending=0, running=0, up=True, restarting=False, unresponsive=False, exiting=False):
        self.pending = dict.fromkeys(range(pending))
        self.stats = StepStats(num_running=running)
        self.up, self.restarting, self.dead = up, restarting, False
        self.unresponsive, self.exiting = unresponsive, exiting

    def unresponsive_reason(self):
        return "the engine core 1 has made no progress for 2.0 s (server.core_heartbeat_timeout_s=1)"

    def silence(self):
        return self.unresponsive_reason() if self.unresponsive else None

    def check_up(self):
        if self.restarting:
            raise EngineRestartingError("the engine core 1 is restarting", 3)
        if not self.up:
            raise EngineDeadError("the engine is shutting down")


def client(*cores):
    dp = DataParallelClient.__new__(DataParallelClient)
    dp.clients = list(cores)
    return dp


def test_the_score_weighs_waiting_four_times_running():
    assert balance_score(pending=5, running=3) == 4 * 2 + 3
    assert balance_score(pending=1, running=3) == 3  # the core reported more than is in flight: none waits


def test_requests_go_to_the_least_loaded_rank():
    assert client(FakeCore(), FakeCore()).pick_rank() == 0  # ties to the lowest rank
    assert client(FakeCore(pending=1), FakeCore()).pick_rank() == 1  # sent, not yet reported: waiting
    # rank 0 runs 6 of its 6 (score 6), rank 1 runs 1 and has 2 more waiting (score 9)
    assert client(FakeCore(pending=6, running=6), FakeCore(pending=3, running=1)).pick_rank() == 0


def test_a_burst_is_spread_before_any_core_answers():
    dp = client(FakeCore(), FakeCore())
    for i in range(6):
        dp.clients[dp.pick_rank()].pending[i] = None
    assert [len(c.pending) for c in dp.clients] == [3, 3]


def test_restarting_ranks_get_no_work_unless_pinned():
    dp = client(FakeCore(up=False, restarting=True), FakeCore(pending=10))
    assert dp.pick_rank() == 1
    assert not dp.restarting
    with pytest.raises(EngineRestartingError):
        dp.pick_rank(0)
    assert dp.pick_rank(1) == 1
    with pytest.raises(ValueError):
        dp.pick_rank(2)
    down = client(FakeCore(up=False, restarting=True), FakeCore(up=False, restarting=True))
    assert down.restarting
    with pytest.raises(EngineRestartingError):
        down.pick_rank()


def test_an_unresponsive_rank_gets_no_work_while_another_can_take_it():
    assert client(FakeCore(unresponsive=True), FakeCore(pending=10)).pick_rank() == 1
    assert client(FakeCore(unresponsive=True), FakeCore()).pick_rank(0) == 0  # pinned: it may be in a long step
    assert client(FakeCore(unresponsive=True, pending=2), FakeCore(unresponsive=True)).pick_rank() == 1


def test_what_the_probes_read_of_the_ranks():
    ok = client(FakeCore(), FakeCore())
    assert ok.serving and not ok.lost and ok.unresponsive_reason() is None
    frozen = client(FakeCore(), FakeCore(unresponsive=True))
    assert frozen.serving and not frozen.lost  # /ready holds on rank 0
    assert frozen.unresponsive_reason() == FakeCore().unresponsive_reason()  # /health names the frozen rank
    ending = client(FakeCore(exiting=True), FakeCore(up=False, restarting=True))
    assert ending.lost and not ending.serving and not ending.restarting
    assert not client(FakeCore(unresponsive=True), FakeCore(exiting=True)).serving


def test_the_header_or_the_field_pins_a_rank():
    assert data_parallel_rank({}, None, 2) is None
    assert data_parallel_rank({}, "1", 2) == 1
    assert data_parallel_rank({"data_parallel_rank": 1}, None, 2) == 1
    assert data_parallel_rank({"data_parallel_rank": 1}, " 1 ", 2) == 1
    for body, header in [({}, "2"), ({}, "-1"), ({}, "one"), ({}, "9" * 5000), ({"data_parallel_rank": 2}, None),
                         ({"data_parallel_rank": "1"}, None), ({"data_parallel_rank": 0}, "1")]:
        with pytest.raises(OpenAIError) as e:
            data_parallel_rank(body, header, 2)
        assert e.value.status == 400


def test_lock_step_cores_restart_together_on_a_fresh_segment():
    """ExpertGroupSegments (parallel=dp2_ep): every core is built on the
    current segment; the first loss starts a new generation and kills the
    other cores; a segment is unlinked once every core of its generation is up."""
    import dataclasses
    import os

    from appliance.server.data_parallel import ExpertGroupSegments

    @dataclasses.dataclass(frozen=True)
    class Dep:
        expert_group: object = None

    class Proc:
        def __init__(self):
            self.alive = True

        def is_alive(self):
            return self.alive

        def kill(self):
            self.alive = False

    class Client:
        def __init__(self):
            self.deployment, self.proc = Dep(), None

        def start(self):  # what EngineClient._launch does with the hooks: prepare, spawn ...
            self.deployment = self.prepare()
            self.proc = Proc()

        def ready(self):  # ... and hear the core's Ready
            self.on_ready()

        def launch(self):
            self.start()
            self.ready()

    clients = [Client(), Client()]
    from appliance.config.deployment import ExpertGroupAddress
    from appliance.kernels.shm_comm import create_segment

    def exists(address):  # the cores' segment and their tensor-parallel ranks' ones
        return [os.path.exists(f) for f in address.files()]

    seg = ExpertGroupSegments(clients, lambda n: ExpertGroupAddress(create_segment(n), (create_segment(n),)))
    first = seg.path
    clients[0].launch()
    assert exists(first) == [True, True]  # the other core has not mapped them yet
    clients[1].launch()
    assert {c.deployment.expert_group for c in clients} == {first} and exists(first) == [False, False]

    clients[1].proc.kill()
    clients[1].on_lost()  # core 1 died: a new generation, core 0 killed with it
    second = seg.path
    assert second != first and exists(second) == [True, True] and not clients[0].proc.is_alive()
    clients[0].on_lost()  # its supervisor hears of it: the same generation goes on
    assert seg.path == second and seg.generation == 1
    clients[0].start()
    clients[1].launch()
    assert exists(second) == [True, True]  # core 0 of this generation is not up yet: it may not have mapped them
    clients[0].ready()
    assert {c.deployment.expert_group for c in clients} == {second} and exists(second) == [False, False]
    seg.close()
