"""Quantized mixture-of-experts checkpoints (every expert's projections
quantized, routers float, as Qwen3-MoE GPTQ/AWQ/FP8 releases are). AWQ and
GPTQ: each expert's gate|up and down load as linears of the checkpoint's
own blocks, near that expert's float weights (and no other's), and the
native forward generates what the torch layer path does from the same
blocks. fp8 (a checkpoint's, or quantized at load): each expert the stored
values times their scales."""

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.config.compose import resolve
from appliance.models.loader import resolve_model_folder

TINY_MOE = ["+profile=cpu", "model=tiny_random_moe", "cache.kv_cache_memory_gib=0.02", "model.dtype=float32"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from appliance.models.int4_checkpoints import write_checkpoint

    plain = resolve_model_folder(resolve(TINY_MOE).cfg.model)
    root = tmp_path_factory.mktemp("moe-int4")
    out = {}
    for method, bits in (("awq", 4), ("gptq", 4), ("gptq", 8)):
        out[f"{method}{bits}"] = root / f"{method}{bits}"
        write_checkpoint(plain, out[f"{method}{bits}"], method, bits, 32)
    return plain, out


@pytest.mark.parametrize("variant", ["awq4", "gptq4", "gptq8"])
def test_experts_load_as_their_blocks_and_run_natively(checkpoints, variant):
    from safetensors.torch import load_file

    from appliance.models.quant import GroupedInt8Linear, Int4WeightOnlyLinear, dequantize_int4
    from tests.kernel_helpers import float_rows

    plain, folders = checkpoints
    float_weights = load_file(str(plain / "model.safetensors"))
    model = [*TINY_MOE, f"model.path={folders[variant]}"]
    torch_path = LLM(overrides=[*model, "attention.backend=torch_sdpa"])
    runner = torch_path.engine.runner
    assert not runner.uses_native_forward
    for i, layer in enumerate(runner.model.model.layers):
        if not layer.sparse:
            continue
        experts = layer.mlp.experts
        assert experts.quantized == variant[:-1]
        for e in experts.slot_experts:
            gate_up, down = experts.projections(e)
            assert isinstance(gate_up, GroupedInt8Linear if variant == "gptq8" else Int4WeightOnlyLinear)
            pre = f"model.layers.{i}.mlp.experts."
            for lin, want in [(gate_up, torch.cat([float_weights[f"{pre}{e}.gate_proj.weight"],
                                                   float_weights[f"{pre}{e}.up_proj.weight"]])),
                              (down, float_weights[f"{pre}{e}.down_proj.weight"])]:
                got = dequantize_int4(getattr(lin, lin.weight_attr), lin.q_scale, lin.q_min)
                other = float_weights[f"{pre}{(e + 1) % 8}.down_proj.weight"] if lin is down else None
                assert (got - want).norm() / want.norm() < 0.1, (variant, i, e)  # its own expert, rounded
                if other is not None:
                    assert (got - other).norm() / other.norm() > 0.5  # not a neighbour's
    prompts = [[5, 77, 301, 12, 9], [400, 2, 2, 2, 2, 2, 17, 250], [1, 300]]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    ref = [o.outputs[0] for o in torch_path.generate(prompts, params, use_tqdm=False)]
    with float_rows():  # fp32 rows in the native GEMMs, as the torch path computes them
        native = LLM(overrides=model)
        assert native.engine.runner.uses_native_forward
        outs = [o.outputs[0] for o in native.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(outs, ref):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


@pytest.mark.parametrize("block", [0, 32], ids=["per-tensor, static activations", "block-wise"])
def test_fp8_checkpoint_experts(checkpoints, tmp_path, block):
    """An fp8 Qwen3-MoE checkpoint (llm-compressor's per-tensor layout, or
    Qwen3-FP8's [32, 32] blocks): each expert's gate|up and down are
    Fp8Linear of the stored weights and scales (the dequantized expert is
    the stored values times their scales exactly); generation runs."""
    from appliance.models.fp8 import Fp8Linear
    from tests.model_helpers import write_fp8_checkpoint

    plain, _ = checkpoints
    stored = write_fp8_checkpoint(plain, tmp_path / "fp8", block=block)
    llm = LLM(overrides=[*TINY_MOE, f"model.path={tmp_path / 'fp8'}"])
    assert llm.resolved.cfg.quantization.method == "fp8"
    layer = llm.engine.runner.model.model.layers[0]
    gate_up, down = layer.mlp.experts.projections(3)
    assert isinstance(gate_up, Fp8Linear) and isinstance(down, Fp8Linear)
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    if block:
        scale = stored[name + "_scale_inv"].repeat_interleave(block, 0).repeat_interleave(block, 1)
    else:
        scale = stored[name[: -len("weight")] + "weight_scale"]
    assert torch.equal(down.dequantized_weight(), stored[name].float() * scale)
    out = llm.generate([[5, 77, 301, 12, 9]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


def test_online_fp8_quantizes_the_experts(checkpoints):
    """quantization=fp8 on an unquantized MoE checkpoint: every expert's
    gate|up and down per output channel (exactly the per-channel fp8 of its
    float weights), the routers fp32; generation runs."""
    from safetensors.torch import load_file

    from appliance.models.fp8 import Fp8Linear, quantize_per_channel_fp8

    plain, _ = checkpoints
    float_weights = load_file(str(plain / "model.safetensors"))
    llm = LLM(overrides=[*TINY_MOE, "quantization=fp8"])
    mlp = llm.engine.runner.model.model.layers[0].mlp
    assert mlp.experts.quantized == "fp8" and mlp.gate.weight.dtype == torch.float32
    for e in (0, 5):
        gate_up, down = mlp.experts.projections(e)
        assert isinstance(gate_up, Fp8Linear) and isinstance(down, Fp8Linear)
        pre = f"model.layers.0.mlp.experts.{e}."
        w13 = torch.cat([float_weights[pre + "gate_proj.weight"], float_weights[pre + "up_proj.weight"]])
        for lin, w in [(gate_up, w13), (down, float_weights[pre + "down_proj.weight"])]:
            q, scale = quantize_per_channel_fp8(w)
            assert torch.equal(lin.dequantized_weight(), q.float() * scale[:, None])
    out = llm.generate([[5, 77, 301, 12, 9]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
