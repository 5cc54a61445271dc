"""The ModelRunner, not the model, chooses how a step runs: the backend's
whole-step native forward where the backend says ``native_forward``
(cpu_native), the model's torch forward otherwise (torch_sdpa). The model is
a plain torch module that knows nothing of native backends."""

import inspect

import pytest
import torch

import appliance.models.llama as llama
from appliance import LLM, SamplingParams
from appliance.kernels.registry import Selection

BASE = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.01"]
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog."]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _generate_counting_model_calls(llm):
    calls = []
    handle = llm.engine.runner.model.register_forward_pre_hook(lambda m, args: calls.append(1))
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        handle.remove()
    return [o.outputs[0].token_ids for o in outs], len(calls)


def test_runner_runs_the_native_forward_for_a_native_backend():
    cpu_native = pytest.importorskip("appliance.kernels.cpu_native")
    llm = LLM(overrides=BASE)
    runner = llm.engine.runner
    assert runner.backend.name == "cpu_native" and runner.uses_native_forward
    tokens, model_calls = _generate_counting_model_calls(llm)
    assert model_calls == 0  # every step ran natively
    native = runner.step_forward()
    assert isinstance(native, cpu_native.NativeForward)
    assert runner.step_forward() is native  # built once, not per step

    # New rope tables: the runner rebuilds the native forward with them, same results.
    model = runner.model
    model.rope_cache(runner.max_model_len, model.rope[0].dtype, runner.device)
    llm.engine.scheduler.kv.reset_prefix_cache()
    again, model_calls = _generate_counting_model_calls(llm)
    assert runner.step_forward() is not native and model_calls == 0
    assert again == tokens


def test_runner_runs_the_model_forward_for_a_torch_backend():
    llm = LLM(overrides=BASE, selection=Selection(chosen="torch_sdpa"))
    runner = llm.engine.runner
    assert runner.backend.name == "torch_sdpa" and not runner.uses_native_forward
    assert runner.step_forward() is runner.model
    tokens, model_calls = _generate_counting_model_calls(llm)
    assert model_calls > 0 and all(len(t) == GREEDY.max_tokens for t in tokens)


def test_native_forward_sees_weights_quantized_before_the_runner():
    pytest.importorskip("appliance.kernels.cpu_native")
    llm = LLM(overrides=BASE + ["quantization=int8_wo"])
    runner = llm.engine.runner
    assert runner.uses_native_forward and runner.model.lm_head_q is not None
    tokens, model_calls = _generate_counting_model_calls(llm)
    assert model_calls == 0
    # the int8 projections were packed for the native forward (and their row-major copy released)
    assert runner.model.model.layers[0].self_attn.qkv_proj.weight_packed.dtype == torch.int8


def test_model_knows_nothing_of_native_backends():
    src = inspect.getsource(llama)
    for name in ("cpu_native", "NativeForward", "native_forward", "registry"):
        assert name not in src
    # the attention interface it is handed is the only kernels name it knows (as a type)
    assert src.count("appliance.kernels") == src.count("from appliance.kernels.base import AttentionBackend") == 1
    model = LLM(overrides=BASE, selection=Selection(chosen="torch_sdpa")).engine.runner.model
    assert not [k for k in vars(model) if "native" in k.lower()]
    view = model.weights_view()  # the public interface a whole-step executor reads
    assert isinstance(view, llama.ModelWeights) and len(view.layers) == model.arch.num_layers
    assert view.rope_cos.dtype == view.rope_sin.dtype == torch.float32


def test_layers_unlike_the_llama_familys_run_layer_by_layer_on_the_native_attention():
    """OLMo 2's norms after attention and MLP are not the whole-step forward's
    layers: cpu_native serves its attention, torch the rest (parity with HF in
    tests/unit/test_generation.py)."""
    pytest.importorskip("appliance.kernels.cpu_native")
    runner = LLM(overrides=BASE + ["model.architecture=Olmo2ForCausalLM", "model.qk_norm=true"]).engine.runner
    assert runner.backend.name == "cpu_native" and not runner.uses_native_forward
