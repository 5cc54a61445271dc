"""Collectives take tensors where their group's backend moves them: a host
tensor (the offload tier's agreement flag, the load balancer's counters)
all-reduced over NCCL goes to the GPU and back (NCCL has no CPU backend)."""

import pytest
import torch
import torch.distributed as dist

from appliance.server.local import free_port
from appliance.worker.executor import TorchDistributedComm


@pytest.fixture
def world_of_one(request):
    backend = request.param
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield backend
    dist.destroy_process_group()


@pytest.mark.parametrize("world_of_one", ["gloo"], indirect=True)
def test_over_gloo_a_host_tensor_reduces_in_place(world_of_one):
    flag = torch.tensor([1.0, 0.0])
    TorchDistributedComm(1, device="cpu").all_reduce(flag)
    assert flag.tolist() == [1.0, 0.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
@pytest.mark.parametrize("world_of_one", ["nccl"], indirect=True)
def test_over_nccl_a_host_tensor_goes_to_the_gpu_and_back(world_of_one):
    torch.cuda.set_device(0)
    with pytest.raises(Exception):  # what every host-tensor call site met before
        dist.all_reduce(torch.tensor([1.0]))
    flag, counts = torch.tensor([1.0]), torch.arange(6, dtype=torch.int64)
    comm = TorchDistributedComm(1, device="cuda")
    comm.all_reduce(flag)
    comm.all_reduce(counts)
    assert flag.device.type == "cpu" and flag.tolist() == [1.0] and counts.tolist() == list(range(6))
    on_gpu = torch.ones(3, device="cuda")
    comm.all_reduce(on_gpu)  # a GPU tensor is reduced where it is
    assert on_gpu.tolist() == [1.0, 1.0, 1.0]
