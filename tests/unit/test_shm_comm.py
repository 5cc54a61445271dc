"""Shared-memory collectives between ranks on one host: sums equal to the
rank-order sum and the same bits on every rank (fp32 and bf16, inputs
longer than a slot), all-gather in rank order, broadcast from any rank, many operations in a row
(the two slot parities), more ranks than cores, and a rank that never
arrives ending the wait with an error."""

import multiprocessing as mp
import os
import pickle
import time

import pytest
import torch

from appliance.kernels.shm_comm import ShmComm, create_segment

SLOT = 1024  # bytes: inputs of a few thousand elements go through in chunks


def inputs(rank, step, n, dtype):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(n, generator=g) * (rank + 1)).to(dtype)


def _rank(path, rank, world, steps, sizes, q):
    torch.set_num_threads(1)
    comm = ShmComm(path, rank, world, timeout_s=30, slot_bytes=SLOT)
    out = []
    for step in range(steps):
        for n in sizes:
            for dtype in (torch.float32, torch.bfloat16):
                t = inputs(rank, step, n, dtype)
                comm.all_reduce(t)
                out.append(t)
        gathered = comm.all_gather(torch.full((3, 5), float(rank * 10 + step)))
        out.append(torch.stack(gathered))
        strided = inputs(rank, step, 64, torch.float32).view(8, 8).t()  # not contiguous: reduced in place all the same
        comm.all_reduce(strided)
        out.append(strided.clone())
        src = step % world
        b = inputs(rank, step, 1000, torch.float32)  # 4 kB: four chunks
        comm.broadcast(b, src)
        out.append(b)
    q.put((rank, pickle.dumps(out)))  # plain pickling: torch's queue would share fds with an exiting process


def spawn(target, args, paths):
    """Run ``target(*a, q)`` in a process for each ``a`` of ``args``; their
    (key, pickled result) puts as a dict; the segments ``paths`` unlinked."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, q)) for a in args]
    try:
        for p in procs:
            p.start()
        return {r: pickle.loads(b) for r, b in (q.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(30)
        for path in paths:
            os.unlink(path)


def run_ranks(world, steps, sizes):
    path = create_segment(world, SLOT)
    results = spawn(_rank, [(path, r, world, steps, sizes) for r in range(world)], [path])
    return [results[r] for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])  # 3 ranks on a 2-core host: the waits must yield
def test_all_reduce_and_all_gather_match_the_rank_order_reference(world):
    steps, sizes = 5, [1, 7, 576, 3000]  # 3000 fp32 = 12 kB: 12 chunks of a 1 kB slot
    results = run_ranks(world, steps, sizes)
    for rank_out in results[1:]:  # the same bits everywhere
        assert all(torch.equal(a, b) for a, b in zip(rank_out, results[0]))
    i = 0
    for step in range(steps):
        for n in sizes:
            for dtype in (torch.float32, torch.bfloat16):
                want = inputs(0, step, n, dtype).float()
                for r in range(1, world):
                    want = want + inputs(r, step, n, dtype).float()
                got = results[0][i]
                assert got.dtype == dtype
                if dtype == torch.float32:
                    assert torch.equal(got, want)  # fp32 adds in rank order, exactly
                else:
                    assert torch.equal(got, want.to(torch.bfloat16))  # summed in fp32, rounded once
                i += 1
        gathered = results[0][i]
        assert [float(gathered[r, 0, 0]) for r in range(world)] == [r * 10 + step for r in range(world)]
        i += 1
        want = sum(inputs(r, step, 64, torch.float32).view(8, 8).t() for r in range(world))
        assert torch.allclose(results[0][i], want, atol=1e-5)
        i += 1
        assert torch.equal(results[0][i], inputs(step % world, step, 1000, torch.float32))  # the source's values
        i += 1


def test_a_rank_that_never_arrives_ends_the_wait():
    path = create_segment(2, SLOT)
    try:
        comm = ShmComm(path, 0, 2, timeout_s=0.5, slot_bytes=SLOT)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="did not arrive within 0.5 s"):
            comm.all_reduce(torch.ones(4))
        assert time.monotonic() - t0 < 5
    finally:
        os.unlink(path)


def test_refuses_what_it_cannot_reduce():
    path = create_segment(1, SLOT)
    try:
        comm = ShmComm(path, 0, 1, timeout_s=1, slot_bytes=SLOT)
        t = torch.arange(5, dtype=torch.float32)
        comm.all_reduce(t)  # one rank: itself
        assert torch.equal(t, torch.arange(5, dtype=torch.float32))
        with pytest.raises(ValueError, match="fp32 or bf16"):
            comm.all_reduce(torch.ones(3, dtype=torch.int64))
        with pytest.raises(ValueError, match="holds"):
            ShmComm(path, 0, 2, timeout_s=1, slot_bytes=SLOT)
    finally:
        os.unlink(path)


def _core_rank(paths, core, rank, q):
    from appliance.models.layers.moe import CoresOfRanks

    torch.set_num_threads(1)
    group = CoresOfRanks(ShmComm(paths["cores"][rank], core, 2, timeout_s=30),
                         ShmComm(paths["ranks"][core], rank, 2, timeout_s=30))
    me = core * 2 + rank
    gathered = torch.stack(group.all_gather(torch.full((2, 3), float(me))))
    t = inputs(me, 0, 100, torch.float32)
    group.all_reduce(t)
    q.put((me, pickle.dumps((gathered, t))))


def test_cores_of_ranks_gather_and_sum_over_every_rank():
    """Two engine cores of two ranks each as one group (``CoresOfRanks``, the
    collectives of expert parallelism across cores with tensor parallelism
    inside them): all-gather in group rank order (core x 2 + rank), and
    every rank's sum the same bits, close to the sum of the four inputs."""
    paths = {"cores": [create_segment(2) for _ in range(2)], "ranks": [create_segment(2) for _ in range(2)]}
    results = spawn(_core_rank, [(paths, c, r) for c in range(2) for r in range(2)], paths["cores"] + paths["ranks"])
    want = sum(inputs(m, 0, 100, torch.float32) for m in range(4))
    for m in range(4):
        gathered, total = results[m]
        assert torch.equal(gathered, torch.arange(4.0).view(4, 1, 1).expand(4, 2, 3))
        assert torch.equal(total, results[0][1]) and torch.allclose(total, want, atol=1e-5)
