"""Routing across data-parallel engine cores: the least loaded rank that is
up (``4 x waiting + running``), a pinned rank, ranks that are restarting,
and the header / field that pin a request."""

import pytest

from appliance.engine.core import StepStats
from appliance.server.client import EngineDeadError, EngineRestartingError
from appliance.server.data_parallel import DataParallelClient, balance_score
from appliance.server.protocol import OpenAIError, data_parallel_rank


class FakeCore:
    """What ``pick_rank`` reads of an EngineClient."""

    def __init__(self, pending=0, running=0, up=True, restarting=False):
        self.pending = dict.fromkeys(range(pending))
        self.stats = StepStats(num_running=running)
        self.up, self.restarting, self.dead = up, restarting, False

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
