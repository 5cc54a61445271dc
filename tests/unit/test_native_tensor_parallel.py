"""A tensor-parallel rank's native forward (``NativeForward`` with a
``TensorParallel``): the embedding rows, o_proj's and down's partial sums
all-reduced inside the one native call, through the shared-memory
segment's C entry or a callback into torch collectives, the logits columns
gathered after it. One rank through that path gives the plain native
forward's bits; a failing all-reduce stops the step with the rank named.
Several ranks against one: tests/integration/test_tensor_parallel.py."""

import dataclasses

import pytest

from appliance import LLM, SamplingParams
from appliance.models.layers.parallel import TensorParallel
from tests.kernel_helpers import captured_native_step

cpu_native = pytest.importorskip("appliance.kernels.cpu_native")

BASE = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.01", "model.dtype=float32"]
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3"]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)


class CountingOneRank:
    """The collectives of a world of one, counting the all-reduces."""

    def __init__(self):
        self.reduces = 0

    def all_reduce(self, t):
        self.reduces += 1

    def all_gather(self, t):
        return [t.clone()]


class FailingComm(CountingOneRank):
    def all_reduce(self, t):
        raise RuntimeError("peer gone")


def _run_with(llm, comm):
    """Greedy outputs with the runner's native forward built for rank 0 of a one-rank TensorParallel over comm."""
    runner = llm.engine.runner
    model = runner.model
    runner._native = cpu_native.NativeForward(dataclasses.replace(model.weights_view(), tp=TensorParallel(0, 1, comm)))
    runner._native_rope = model.rope
    llm.engine.scheduler.kv.reset_prefix_cache()
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def _shm_one_rank():
    import os

    from appliance.kernels.shm_comm import ShmComm, create_segment

    path = create_segment(1)
    try:
        return ShmComm(path, 0, 1, timeout_s=5.0)
    finally:
        os.unlink(path)  # mapped: the name can go


@pytest.mark.parametrize("model", ["tiny_random", "tiny_random_moe"])
@pytest.mark.parametrize("kind", ["callback", "shm"])
def test_one_rank_through_the_reduce_path_equals_the_plain_native_forward(kind, model):
    """Dense and sparse layers (a sparse layer's rank sums its rows of every
    expert into a buffer, reduced, then added to the residual). The rank is
    another engine of the same weights: a native forward frees the float
    experts it packs."""
    overrides = [*BASE, f"model={model}"]
    llm = LLM(overrides=overrides)
    runner = llm.engine.runner
    assert runner.uses_native_forward
    plain = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert isinstance(runner.step_forward(), cpu_native.NativeForward) and runner.step_forward().tp is None
    comm = CountingOneRank() if kind == "callback" else _shm_one_rank()
    cpu_native.phase_times(reset=True)
    through = _run_with(LLM(overrides=overrides), comm)
    for a, b in zip(plain, through):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.top for lp in a.outputs[0].logprobs] == [lp.top for lp in b.outputs[0].logprobs]  # same bits
    if kind == "callback":  # the embedding, then o_proj and down (or the experts) of every layer, in every step
        layers = runner.model.arch.num_layers
        assert comm.reduces > 0 and comm.reduces % (1 + 2 * layers) == 0
    assert cpu_native.phase_times()["tp_all_reduce"] > 0


def test_a_failing_all_reduce_stops_the_step_and_names_the_rank():
    llm = LLM(overrides=BASE)
    runner = llm.engine.runner
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # built and warm
    model = runner.model
    native = cpu_native.NativeForward(dataclasses.replace(model.weights_view(), tp=TensorParallel(0, 1, FailingComm())))
    llm.engine.scheduler.kv.reset_prefix_cache()
    _, args = captured_native_step(llm, PROMPTS[:1], SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match="all-reduce inside the native forward failed on rank 0: peer gone"):
        native(*args)


def test_which_ranks_run_the_native_forward():
    """A tensor-parallel rank of a dense or a sparse model runs the native
    forward, and so does one with expert parallelism over the tensor-parallel
    ranks (whole experts, the same tokens on every rank: the partial sums'
    all-reduce is the whole exchange); expert parallelism across engine
    cores (tokens exchanged inside a sparse layer) or under the load
    balancer (pairs moved to slots) keeps the torch forward."""
    from appliance.models.layers.moe import ExpertParallel
    from appliance.worker.model_runner import runs_native_forward

    dense = LLM(overrides=BASE).engine.runner
    moe = LLM(overrides=["+profile=cpu", "model=tiny_random_moe", "cache.kv_cache_memory_gib=0.01"]).engine.runner
    assert dense.uses_native_forward and moe.uses_native_forward  # one rank
    tp = TensorParallel(0, 1, CountingOneRank())
    for runner in (dense, moe):
        runner.model.tp = tp
        assert runs_native_forward(runner.backend, runner.model)
    model = moe.model
    cases = [(ExpertParallel(0, 1, tp.comm), None, True), (ExpertParallel(0, 1, tp.comm, replicated=False), None, False),
             (ExpertParallel(0, 1, tp.comm), object(), False)]
    try:
        for ep, eplb, native in cases:
            model.ep, model.eplb = ep, eplb
            assert runs_native_forward(moe.backend, model) is native, (ep, eplb)
    finally:
        dense.model.tp = model.tp = model.ep = model.eplb = None
