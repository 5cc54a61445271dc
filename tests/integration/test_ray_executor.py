"""The Ray executor (``parallel.executor=ray``) on a local Ray instance: two
actors (two tensor-parallel ranks, or two pipeline stages) give the tokens
and logprobs of the ``mp`` executor's two worker processes; an actor that dies ends the engine with EngineDeadError, and
closing removes the actors and stops the instance it started."""

import os
import signal
import time

import pytest

from appliance import SamplingParams
from appliance.engine.interfaces import EngineDeadError
from tests.integration.test_tensor_parallel import PROMPTS, TINY, assert_same, generate

ray = pytest.importorskip("ray", reason="parallel.executor=ray needs the ray package (pip install 'appliance[ray]')")


@pytest.mark.parametrize("layout", ["parallel=tp2", "parallel=pp2"])  # two ranks of one stage, or two stages
def test_two_actors_answer_as_two_worker_processes(layout):
    mp, _ = generate([*TINY, layout, "parallel.executor=mp"], PROMPTS, 16)
    outs, llm = generate([*TINY, layout, "parallel.executor=ray"], PROMPTS, 16)
    assert type(llm.engine.runner).__name__ == "RayExecutor"
    assert_same(outs, mp)
    assert not ray.is_initialized()  # the local instance it started is stopped


def test_a_dead_actor_ends_the_engine_and_nothing_is_left():
    from appliance import LLM

    llm = LLM(overrides=[*TINY, "parallel=tp2", "parallel.executor=ray", "parallel.step_timeout_s=60"])
    executor = llm.engine.runner
    pids = list(executor.pids)
    try:
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="rank 1's Ray actor died"):
            llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        executor.close()
    deadline = time.time() + 30
    while any(os.path.exists(f"/proc/{p}") and _alive(p) for p in pids):
        assert time.time() < deadline, "a Ray actor outlived the executor"
        time.sleep(0.2)
    assert not ray.is_initialized()


def _alive(pid):
    with open(f"/proc/{pid}/status") as f:
        return "State:\tZ" not in f.read()
