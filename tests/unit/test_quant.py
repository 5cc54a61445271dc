"""Weight-only int8 and int4 (quantization=int8_wo, int4_wo): quantizers,
the torch paths and tiny-model runs (the native kernels: test_cpu_native)."""

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.models.quant import (INT8_KERNEL_MAX_ROWS, Int4WeightOnlyLinear, Int8WeightOnlyLinear, dequantize_int4,
                                    quantize_groups_int4, quantize_per_channel)


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


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_groups_round_trip(group):
    w = torch.randn(24, 256) * torch.linspace(0.01, 10, 24)[:, None]  # rows of very different ranges
    q, d, m = quantize_groups_int4(w, group)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and d.dtype == m.dtype == torch.float16
    assert d.shape == m.shape == (24, 256 // group)
    err = (dequantize_int4(q, d, m) - w).abs().reshape(24, -1, group).amax(dim=2)
    # half a step, plus what rounding the min to fp16 moves the grid
    assert torch.all(err <= d.float() / 2 + (m.float() - w.reshape(24, -1, group).amin(dim=2)).abs() + 1e-6)


def test_int4_keeps_a_grid_it_is_given_exactly():
    """Weights already on a 4-bit grid (a Q4_1 GGUF's, dequantized) come back bit for bit."""
    g = torch.Generator().manual_seed(0)
    d = (torch.rand(8, 4, generator=g) * 0.1).half()
    m = (-torch.rand(8, 4, generator=g)).half()
    q = torch.randint(0, 16, (8, 128), dtype=torch.uint8, generator=g)
    q[:, ::32], q[:, 1::32] = 0, 15  # min/max quantization puts both ends in every group
    w = dequantize_int4(q, d, m)
    q2, d2, m2 = quantize_groups_int4(w, 32)
    assert torch.equal(dequantize_int4(q2, d2, m2), w)


def test_int4_refuses_groups_that_do_not_tile_k():
    with pytest.raises(ValueError, match="do not tile k=100"):
        quantize_groups_int4(torch.randn(4, 100), 32)
    with pytest.raises(ValueError, match="do not tile k=96"):
        quantize_groups_int4(torch.randn(4, 96), 48)


@pytest.mark.parametrize("rows", [1, 7])
def test_int4_torch_path_is_the_linear_of_the_dequantized_weight(rows):
    w, b, x = torch.randn(40, 64), torch.randn(40), torch.randn(rows, 64)
    lin = Int4WeightOnlyLinear(w, b, 32)
    ref = torch.nn.functional.linear(x, dequantize_int4(lin.weight_q4, lin.q_scale, lin.q_min), b)
    torch.testing.assert_close(lin(x), ref)


def test_tiny_model_runs_int4_wo():
    base = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.01"]
    llm = LLM(overrides=base + ["quantization=int4_wo", "quantization.group_size=64"])
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, Int4WeightOnlyLinear) and layer.mlp.down_proj.group == 64
    assert isinstance(llm.engine.runner.model.lm_head_q, Int8WeightOnlyLinear)
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog."] * 4
    q = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in q)


@pytest.mark.parametrize("float_rows", [True, False])  # packed as the native forward packs a head; as k quads
def test_grouped_int8_rows_read_the_blocks_row_major_and_from_the_native_panels(float_rows):
    """What an embedding tied to a grouped-int8 head looks its tokens up with: the dequantized weight's rows,
    exactly, before and after the native backend packs the blocks (plain panels, or the int8 rows' k quads
    where they run) and lets the row-major copy go."""
    from appliance.kernels.cpu_native import NativeLinear, int8_quads
    from appliance.models.gguf_blocks import TiedBlockEmbedding
    from appliance.models.quant import GroupedInt8Linear

    g = torch.Generator().manual_seed(0)
    n, k, group = 37, 64, 32  # rows past a whole panel of 16
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    d, m = torch.rand(n, k // group, generator=g), torch.randn(n, k // group, generator=g)
    lin = GroupedInt8Linear((q, d, m), None)
    table = lin.dequantized()
    ids = torch.tensor([[0, 15, 16], [36, 17, 0]])
    emb = TiedBlockEmbedding(lin, torch.bfloat16)
    assert torch.equal(lin.rows(ids), table[ids.reshape(-1)])
    assert torch.equal(emb(ids), table[ids].to(torch.bfloat16))
    NativeLinear(lin, release=True, float_rows=float_rows)
    assert lin.weight_q8.numel() == 0  # held once: the panels
    assert lin.weight_packed.dtype == (torch.uint8 if int8_quads() and not float_rows else torch.int8)
    assert torch.equal(lin.rows(ids), table[ids.reshape(-1)]) and torch.equal(emb(ids), table[ids].to(torch.bfloat16))
    assert not list(emb.parameters()) and not list(emb.buffers())  # the head's blocks, not a copy
