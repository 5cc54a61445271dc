"""Collectives take tensors where their group's backend moves them: a host
tensor (the offload tier's agreement flag, the load balancer's counters, the
expert exchange's counts) given to any collective over NCCL goes to the GPU
and its result back (NCCL has no CPU backend)."""

import pytest
import torch
import torch.distributed as dist

from appliance.server.local import free_port
from appliance.worker.rank_group import TorchDistributedComm


@pytest.fixture
def world_of_one(request):
    backend = request.param
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield backend
    dist.destroy_process_group()


def every_collective_on_host_tensors(comm):
    """Each collective of ``comm`` on host tensors in a world of one: results where the inputs were."""
    flag, counts = torch.tensor([1.0, 0.0]), torch.arange(6, dtype=torch.int64)
    comm.all_reduce(flag)
    comm.all_reduce(counts)
    assert flag.device.type == "cpu" and flag.tolist() == [1.0, 0.0] and counts.tolist() == list(range(6))
    (gathered,) = comm.all_gather(torch.tensor([3, 4]))
    assert gathered.device.type == "cpu" and gathered.tolist() == [3, 4]
    sent = torch.tensor([7.0, 8.0])
    comm.broadcast(sent, 0)
    assert sent.device.type == "cpu" and sent.tolist() == [7.0, 8.0]
    rows, got = comm.all_to_all(torch.arange(6.0).view(3, 2), [3])
    assert rows.device.type == "cpu" and rows.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]] and got == [3]


@pytest.mark.parametrize("world_of_one", ["gloo"], indirect=True)
def test_over_gloo_every_collective_takes_host_tensors(world_of_one):
    every_collective_on_host_tensors(TorchDistributedComm(1, device="cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
@pytest.mark.parametrize("world_of_one", ["nccl"], indirect=True)
def test_over_nccl_a_host_tensor_goes_to_the_gpu_and_back(world_of_one):
    torch.cuda.set_device(0)
    with pytest.raises(Exception):  # noqa: B017 - NCCL's own error, whatever its type: what every host-tensor call site met before
        dist.all_reduce(torch.tensor([1.0]))
    comm = TorchDistributedComm(1, device="cuda")
    every_collective_on_host_tensors(comm)  # each goes to the GPU and its result back
    on_gpu = torch.ones(3, device="cuda")
    comm.all_reduce(on_gpu)  # a GPU tensor is reduced where it is
    assert on_gpu.tolist() == [1.0, 1.0, 1.0]
