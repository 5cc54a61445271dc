"""A pipeline stage's native forward (``NativeForward`` with a
``PipelineParallel``): the first stage embeds the ids, a later one starts
from the rows the stage before handed on, each runs its layers in one
native call, and only the last norms and projects the logits. Two stages
of the tiny model, run side by side in one process (threads, a hand-off
over a queue), give the plain native forward's logits bit for bit. A
stage that fails hands its failure on, and the next step's hand-off is
the next step's rows. Stages in processes against one rank:
tests/integration/test_tensor_parallel.py."""

import dataclasses
import queue
import threading

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.models.layers.parallel import PipelineParallel, StageLink
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


def two_stages(start_of_second, layers):
    """The two stages' PipelineParallel, linked over queues."""
    inboxes = [queue.Queue(), queue.Queue()]
    return (PipelineParallel(0, 2, 0, start_of_second, send=StageLink(QueueComm(inboxes, 0), 0)),
            PipelineParallel(1, 2, start_of_second, layers, receive=StageLink(QueueComm(inboxes, 1), 0)))


def side_by_side(*calls):
    """Run ``calls`` (one per rank) in threads; their results, or the first error raised."""
    got, errors = [None] * len(calls), []

    def rank(k):
        try:
            got[k] = calls[k]()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(k,)) for k in range(len(calls))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return got, errors


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
    pps = two_stages(split, layers)
    stages = [cpu_native.NativeForward(dataclasses.replace(weights, layers=weights.layers[pp.start:pp.end], pp=pp))
              for pp in pps]
    got, errors = side_by_side(*[lambda k=k: stages[k](ids, pos, caches[pps[k].start:pps[k].end], md,
                                                        logits_indices) for k in range(2)])
    assert not errors, errors
    assert got[0] is None  # the first stage's rows went on; only the last has logits
    assert torch.equal(got[1], want)


def test_a_failed_stage_hands_its_failure_on_and_the_next_step_is_in_step():
    first, last = two_stages(1, 2)
    rows = (3, 4)

    def run(pp, fail=False, before=False):
        pp.begin()
        if before:  # failed before its forward ran: the runner abandons the step
            pp.abandon(rows, torch.device("cpu"))
            raise RuntimeError("failed before the forward")

        def stage(x, last):
            if fail:
                raise RuntimeError("this stage failed")
            return (x + 1 if x is not None else torch.full(rows, 7.0)) if not last else x.sum(0, keepdim=True)

        return pp.run(stage, rows, torch.float32, torch.device("cpu"))

    for kind in ("inside", "before"):
        got, errors = side_by_side(lambda kind=kind: run(first, fail=kind == "inside", before=kind == "before"),
                                   lambda: run(last))
        assert len(errors) == 2, errors
        assert any("pipeline stage 0 failed this step" in str(e) for e in errors)
        # the next step's hand-off carries the next step's rows, on both sides
        got, errors = side_by_side(lambda: run(first), lambda: run(last))
        assert not errors and got[0] is None and torch.equal(got[1], torch.full((1, 4), 21.0))
    # a receiving stage that fails before its forward still takes the step's rows
    got, errors = side_by_side(lambda: run(first), lambda: run(last, before=True))
    assert got[0] is None and len(errors) == 1
    got, errors = side_by_side(lambda: run(first), lambda: run(last))
    assert not errors and torch.equal(got[1], torch.full((1, 4), 21.0))


def test_a_pipeline_stage_runs_the_native_forward():
    from appliance.worker.model_runner import runs_native_forward

    runner = LLM(overrides=BASE).engine.runner
    model = runner.model
    model.pp = PipelineParallel(stage=0, size=2, start=0, end=1)
    try:
        assert runs_native_forward(runner.backend, model)
    finally:
        model.pp = None
