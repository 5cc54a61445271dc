"""What the executors read of a deployment (worker/rank_group.py's
``RankGroup``, made by runner.ranks.rank_group): the device, the split, the
collectives, the Ray cluster, the step timeout and the bound rank builder,
pickled to each rank's process; not the config."""

import functools
import pickle

import pytest

from appliance.config.compose import resolve
from appliance.errors import ConfigError
from appliance.runner import compose
from appliance.runner.ranks import build_rank_runner, rank_group
from appliance.worker.rank_group import RankGroup, collectives


def test_a_deployments_ranks_as_the_executors_read_them():
    resolved = resolve(["+profile=cpu", "model=tiny_random", "parallel.tensor_parallel_size=2",
                        "parallel.pipeline_parallel_size=2", "hardware.num_devices=4", "parallel.step_timeout_s=7",
                        "parallel.cpu_collectives=gloo"])
    deployment = compose(resolved, here=False)
    group = rank_group(deployment)
    assert (group.device, group.tensor_parallel_size, group.pipeline_parallel_size, group.world_size) == ("cpu", 2, 2, 4)
    assert (group.step_timeout_s, group.cpu_collectives, group.ray_address, group.cores) == (7, "gloo", None, None)
    assert group.collectives == "gloo"
    assert isinstance(group.build_rank, functools.partial) and group.build_rank.func is build_rank_runner
    again = pickle.loads(pickle.dumps(group))  # as it travels to a rank's process
    assert isinstance(again, RankGroup) and again.build_rank.args[0].fingerprint == deployment.fingerprint


def test_cores_that_share_experts_need_the_addresses_the_front_end_makes():
    resolved = resolve(["+profile=cpu", "model=tiny_random_moe", "parallel.tensor_parallel_size=2",
                        "parallel.data_parallel_size=2", "parallel.enable_expert_parallel=true",
                        "hardware.num_devices=4"])
    deployment = compose(resolved, here=False)
    assert deployment.layout.experts_across_cores
    with pytest.raises(ConfigError, match="Deployment.expert_group.ranks"):
        rank_group(deployment)


def test_how_ranks_exchange():
    assert collectives("cuda", "shm", 4) == "nccl"
    assert collectives("cpu", "gloo", 4) == collectives("cpu", "shm", 1) == "gloo"
