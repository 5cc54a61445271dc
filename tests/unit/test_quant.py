"""Weight-only int8 (quantization=int8_wo): kernel paths and model parity."""

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.models.quant import INT8_KERNEL_MAX_ROWS, Int8WeightOnlyLinear, quantize_per_channel


def test_per_channel_quantization_round_trip():
    w = torch.randn(64, 32)
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    err = (q.float() * s[:, None] - w).abs().max(dim=1).values
    assert torch.all(err <= s / 2 + 1e-6)  # round to nearest: at most half a step per row


@pytest.mark.parametrize("rows", [1, INT8_KERNEL_MAX_ROWS, INT8_KERNEL_MAX_ROWS + 1, 32])
def test_both_paths_match_fp32_linear(rows):
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64), torch.randn(96), torch.randn(rows, 64)
    lin = Int8WeightOnlyLinear(w, b)
    ref = torch.nn.functional.linear(x, w, b)
    out = lin(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    rel = (out - ref).norm() / ref.norm()
    assert rel < 2e-2  # int8 weights (and bf16 activations on the kernel path)


def test_tiny_model_runs_int8_wo():
    base = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.01"]
    llm = LLM(overrides=base + ["quantization=int8_wo"])
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int8WeightOnlyLinear)
    assert isinstance(llm.engine.runner.model.lm_head_q, Int8WeightOnlyLinear)
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog."] * 4  # batches above and below the switch-over
    q = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in q)
