"""A pipeline stage's native forward (``NativeForward`` with a
``PipelineParallel``): the first stage embeds the ids, a later one starts
from the rows the stage before handed on, each runs its layers in one
native call, and only the last norms and projects the logits, which every
rank receives. Two stages of the tiny model, run side by side in one
process (threads, a broadcast over queues), give the plain native
forward's logits bit for bit. Stages in processes against one rank:
tests/integration/test_tensor_parallel.py."""

import dataclasses
import queue
import threading

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.models.llama import PipelineParallel
from tests.kernel_helpers import captured_native_step

cpu_native = pytest.importorskip("appliance.kernels.cpu_native")

BASE = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.01", "model.dtype=float32"]


class QueueComm:
    """``broadcast(t, src)`` between threads standing for ranks: the source
    puts a copy in every other rank's queue, the others copy theirs into t."""

    def __init__(self, inboxes, rank):
        self.inboxes, self.rank = inboxes, rank

    def broadcast(self, t, src):
        if self.rank == src:
            for r, box in enumerate(self.inboxes):
                if r != src:
                    box.put(t.clone())
        else:
            t.copy_(self.inboxes[self.rank].get(timeout=30))


@pytest.mark.parametrize("split", [1, 0, 2], ids=["1+1", "0+2", "2+0"])
@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "decode"])
def test_two_stages_give_the_plain_native_forwards_logits(split, prefill):
    llm = LLM(overrides=BASE)
    params = SamplingParams(max_tokens=1 if prefill else 3, temperature=0, ignore_eos=True)
    plain, (ids, pos, caches, md, logits_indices) = captured_native_step(
        llm, ["Hello there", "The quick brown fox jumps over the lazy dog."], params)
    want = plain(ids, pos, caches, md, logits_indices)
    weights = llm.engine.runner.model.weights_view()
    layers = len(weights.layers)
    inboxes = [queue.Queue(), queue.Queue()]
    bounds = [(0, split), (split, layers)]
    stages = []
    for k, (start, end) in enumerate(bounds):
        pp = PipelineParallel(stage=k, size=2, start=start, end=end, comm=QueueComm(inboxes, k), leaders=(0, 1))
        stages.append(cpu_native.NativeForward(dataclasses.replace(weights, layers=weights.layers[start:end], pp=pp)))
    got, errors = [None, None], []

    def rank(k):
        try:
            start, end = bounds[k]
            got[k] = stages[k](ids, pos, caches[start:end], md, logits_indices)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
            for box in inboxes:
                box.put(torch.full((1,), float("nan")))

    threads = [threading.Thread(target=rank, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert torch.equal(got[0], want) and torch.equal(got[1], want)


def test_a_pipeline_stage_runs_the_native_forward():
    from appliance.worker.model_runner import runs_native_forward

    runner = LLM(overrides=BASE).engine.runner
    model = runner.model
    model.pp = PipelineParallel(stage=0, size=2, start=0, end=1, comm=None, leaders=(0, 1))
    try:
        assert runs_native_forward(runner.backend, model)
    finally:
        model.pp = None
