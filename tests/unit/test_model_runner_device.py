"""A model runner's steps run where its model is: the engine built for the ``meta`` device (weights, KV
cache and every per-step tensor there) runs prompt chunks, the later ones over the KV the earlier ones
wrote, and fails only where a step hands its logits to the host for sampling, which a meta tensor cannot
do. A tensor made on the CPU by default anywhere in a step (inputs, positions, block tables, masks,
indices) fails earlier, naming the devices: on a GPU that is the "expected all tensors on the same device"
of a first run."""

import dataclasses
import traceback

import pytest

from appliance.config.compose import resolve
from appliance.runner import build_engine, compose
from appliance.sampling_params import SamplingParams


def test_prompt_chunks_on_the_meta_device_reach_the_host_copy_of_the_logits():
    # torch_sdpa: the reference every GPU backend is checked against, and the layer-by-layer model path
    overrides = ["+profile=cpu", "model=tiny_random", "attention.backend=torch_sdpa", "cache.num_blocks=64",
                 "scheduler.max_itl_ratio=null", "scheduler.max_num_batched_tokens=16"]
    engine, _ = build_engine(dataclasses.replace(compose(resolve(overrides)), device="meta"))
    assert all(c.device.type == "meta" for c in engine.runner.kv_caches)
    engine.add_request("r", list(range(1, 40)), SamplingParams(max_tokens=2))
    for _ in range(2):  # two 16-token chunks, the second over the first's KV: nothing sampled, nothing failed
        (delta,) = engine.step()
        assert delta.new_token_ids == [] and not delta.finished
    step = engine.scheduler.schedule()
    assert step.num_scheduled_tokens == {"r": 7}  # the last chunk samples
    with pytest.raises(NotImplementedError, match="meta tensor") as failure:
        engine.runner.execute(step)
    last = traceback.extract_tb(failure.tb)[-1]
    assert last.name == "_step" and last.filename.endswith("model_runner.py") and last.line.startswith("logits = logits.cpu()")
