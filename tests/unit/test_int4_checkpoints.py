"""AWQ and GPTQ 4-bit checkpoints: the packed layouts, the quantization
facts a folder's quantization_config sets (and contradictions refused),
and tiny checkpoints in each layout loaded as int4 linears and run."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance import LLM, SamplingParams
from appliance.config.compose import ConfigError, resolve
from appliance.kernels.cpu_native import bf16_dot
from appliance.models.int4_checkpoints import (AWQ_ORDER, checkpoint_blocks, pack_awq, pack_gptq,
                                               quantize_zero_point)
from appliance.models.quant import PROJECTIONS, Int4WeightOnlyLinear, dequantize_int4
from appliance.models.tiny import generate_tiny
from tests.model_helpers import PROMPTS

BASE = ["+profile=cpu", "cache.kv_cache_memory_gib=0.05"]
PACK = {"awq": pack_awq, "gptq": pack_gptq}
SOURCES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _reference(q, z, s):
    """The formats' own formula, s * (q - z), in fp32."""
    group = q.shape[1] // s.shape[1]
    return (q.float() - z.float().repeat_interleave(group, 1)) * s.float().repeat_interleave(group, 1)


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("group", [32, 64, 256])
def test_blocks_are_the_formula_bit_for_bit(method, group):
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(group))
    q, z, s = quantize_zero_point(w, group)
    assert (_reference(q, z, s) - w).abs().max() <= s.float().max() / 2 + 1e-6
    bq, d, m = checkpoint_blocks(method, PACK[method](q, z, s))
    assert torch.equal(bq, q) and d.dtype == m.dtype == torch.float32
    assert torch.equal(dequantize_int4(bq, d, m), _reference(q, z, s))


def test_awq_words_hold_channels_in_awq_order():
    q = torch.arange(8, dtype=torch.uint8).repeat(1, 1).T.repeat(1, 32)  # channel c is c everywhere
    packed = pack_awq(q, torch.zeros(8, 1, dtype=torch.uint8), torch.ones(8, 1))
    want = sum(AWQ_ORDER[i] << (4 * i) for i in range(8))
    assert packed["qweight"].shape == (32, 1) and (packed["qweight"] == want).all()


def test_gptq_words_hold_inputs_in_order_and_zeros_minus_one():
    q = torch.arange(8, dtype=torch.uint8).repeat(16, 4)  # input j holds j % 8
    packed = pack_gptq(q, torch.full((16, 1), 8, dtype=torch.uint8), torch.ones(16, 1))
    assert packed["qweight"].shape == (4, 16) and (packed["qweight"] == sum(j << (4 * j) for j in range(8))).all()
    assert (packed["qzeros"] == sum(7 << (4 * j) for j in range(8))).all()  # z = 8 stored as 7
    assert packed["g_idx"].tolist() == [0] * 32


def test_act_order_is_refused():
    q, z, s = quantize_zero_point(torch.randn(8, 64), 32)
    packed = pack_gptq(q, z, s)
    packed["g_idx"] = packed["g_idx"].flip(0)
    with pytest.raises(ValueError, match="act-order"):
        checkpoint_blocks("gptq", packed)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny random model, and the same model as AWQ and GPTQ checkpoints
    (groups of 32) plus an fp32 folder of exactly their dequantized weights."""
    root = tmp_path_factory.mktemp("int4")
    spec = resolve(BASE + ["model=tiny_random"], check=False).cfg.model
    plain = generate_tiny(spec, root / "plain")
    tensors = load_file(str(plain / "model.safetensors"))
    out = {"plain": plain}
    for method in ("awq", "gptq"):
        folder = root / method
        shutil.copytree(plain, folder)
        quantized, dequantized = dict(tensors), dict(tensors)
        for name in tensors:
            if name.rsplit(".", 2)[-2] in SOURCES:
                q, z, s = quantize_zero_point(tensors[name], 32)
                del quantized[name]
                quantized.update({f"{name[:-len('weight')]}{k}": v for k, v in PACK[method](q, z, s).items()})
                dequantized[name] = _reference(q, z, s)
        save_file(quantized, str(folder / "model.safetensors"))
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 32,
                                         **({"version": "gemm", "zero_point": True} if method == "awq" else
                                            {"desc_act": False, "sym": False})}
        (folder / "config.json").write_text(json.dumps(config))
        out[method] = folder
        ref = root / f"{method}-dequantized"
        shutil.copytree(plain, ref)
        save_file(dequantized, str(ref / "model.safetensors"))
        out[f"{method}-dequantized"] = ref
    return out


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_the_checkpoint_sets_the_quantization_keys(checkpoints, method):
    q = resolve(BASE + [f"model.path={checkpoints[method]}"]).cfg.quantization
    assert (q.method, q.weight_bits, q.group_size) == (method, 4.0, 32)
    with pytest.raises(ConfigError, match=rf"quantization=int4_wo but the checkpoint .* has "
                                          rf"quantization_config.quant_method={method}"):
        resolve(BASE + [f"model.path={checkpoints[method]}", "quantization=int4_wo"])
    with pytest.raises(ConfigError, match="quantization.group_size=64 but the checkpoint"):
        resolve(BASE + [f"model.path={checkpoints[method]}", "quantization.group_size=64"])


def test_the_plan_counts_fp32_group_parameters(checkpoints):
    from appliance.config.plan import make_plan, parameter_counts

    cfg = resolve(BASE + [f"model.path={checkpoints['awq']}"]).cfg
    counts = parameter_counts(cfg.model)
    full = {"float32": 4, "bfloat16": 2}[make_plan(cfg).dtype]
    assert make_plan(cfg).weight_bytes_total == int(counts["linear"] * (4 + 64 / 32) / 8) + \
        (counts["embedding"] + counts["lm_head"] + counts["other"]) * full


def test_incomplete_quantization_configs_are_problems(tmp_path, checkpoints):
    folder = shutil.copytree(checkpoints["awq"], tmp_path / "no-bits")
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]["bits"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="needs integer bits and group_size; it has bits=None"):
        resolve(BASE + [f"model.path={folder}"])


def test_a_method_the_folder_does_not_have_is_refused(checkpoints, tmp_path):
    with pytest.raises(ConfigError, match="quantization=awq loads an AWQ checkpoint, and model.path=.* has no "
                                          "quantization_config"):
        resolve(BASE + [f"model.path={checkpoints['plain']}", "quantization=awq"])
    folder = shutil.copytree(checkpoints["gptq"], tmp_path / "act-order")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="GPTQ with desc_act=true .* is not built yet"):
        resolve(BASE + [f"model.path={folder}"])


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_the_checkpoint_runs_as_its_dequantized_weights(checkpoints, method):
    """Every projection an int4 linear holding s * (q - z) bit for bit;
    generation equal to the fp32 model of those weights (fp32 activations
    throughout; int4 sums differ from fp32 ones only in order)."""
    llm = LLM(overrides=BASE + [f"model.path={checkpoints[method]}", "model.dtype=float32"])
    ref_llm = LLM(overrides=BASE + [f"model.path={checkpoints[f'{method}-dequantized']}", "model.dtype=float32"])
    for layer, ref_layer in zip(llm.engine.runner.model.model.layers, ref_llm.engine.runner.model.model.layers):
        for path in PROJECTIONS:
            mod = layer.get_submodule(path)
            assert isinstance(mod, Int4WeightOnlyLinear)
            assert torch.equal(dequantize_int4(mod.weight_q4, mod.q_scale, mod.q_min),
                               ref_layer.get_submodule(path).weight.data)
    p = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    before = bf16_dot()
    bf16_dot(False)
    try:
        got = llm.generate(PROMPTS, p, use_tqdm=False)
    finally:
        bf16_dot(before)
    ref = ref_llm.generate(PROMPTS, p, use_tqdm=False)
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lb.logprob == pytest.approx(la.logprob, abs=1e-4)
