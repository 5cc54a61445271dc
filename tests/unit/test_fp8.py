"""quantization=fp8: e4m3 weights with per-channel (or per-tensor) scales,
W8A8 with per-token or static activation scales; quantized at load or
loaded from an fp8 checkpoint; on CPUs the torch reference path (the
native whole-step backend steps aside, saying why)."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from appliance import LLM, SamplingParams
from appliance.config.compose import ConfigError, resolve
from appliance.models.fp8 import (FP8, FP8_MAX, Fp8Linear, quantize_per_channel_fp8, quantize_per_token_fp8)
from appliance.models.quant import PROJECTIONS
from appliance.models.tiny import generate_tiny
from tests.model_helpers import write_fp8_checkpoint

BASE = ["+profile=cpu", "cache.kv_cache_memory_gib=0.05"]
SOURCES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_per_channel_weights_keep_three_mantissa_bits():
    w = torch.randn(32, 64) * torch.logspace(-3, 3, 32)[:, None]
    q, scale = quantize_per_channel_fp8(w)
    assert q.dtype == FP8 and scale.shape == (32,)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((32,), FP8_MAX))  # each row's largest is 448
    rel = ((q.float() * scale[:, None] - w).abs() / w.abs().clamp(min=1e-30))[w.abs() > scale[:, None] * 2 ** -6]
    assert rel.max() <= 2 ** -4  # half a step of a 3-bit mantissa, for the normal values


@pytest.mark.parametrize("activations", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_reference_gemm_is_the_dequantized_one(activations, static):
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(24, 64, generator=g), torch.randn(24, generator=g), torch.randn(5, 64, generator=g)
    q, scale = quantize_per_channel_fp8(w)
    input_scale = torch.tensor(0.02) if static else None
    lin = Fp8Linear(q, scale, b, activations, input_scale)
    xs = x
    if activations:
        s = torch.full((5, 1), 0.02) if static else x.abs().amax(dim=1, keepdim=True) / 448
        xs = (x / s).clamp(-448, 448).to(FP8).float() * s
    assert torch.equal(lin(x), F.linear(xs, q.float() * scale[:, None], b))
    if not static:
        xq, s = quantize_per_token_fp8(x)
        assert torch.equal(xq.float().abs().amax(dim=1), torch.full((5,), 448.0))
    else:  # torch._scaled_mm takes dense row scales
        assert quantize_per_token_fp8(x, input_scale)[1].is_contiguous()


@pytest.mark.parametrize("rows,inputs,fits", [(32, 64, True), (24, 64, False), (32, 40, False)])
def test_scaled_mm_takes_only_multiples_of_16(rows, inputs, fits):
    """torch._scaled_mm refuses other sizes (a tensor-parallel shard of an
    odd width): such a projection runs the reference GEMM on the GPU too."""
    q, scale = quantize_per_channel_fp8(torch.randn(rows, inputs))
    assert Fp8Linear(q, scale, None, True).scaled_mm_fits == fits


def test_scales_are_one_or_one_per_row():
    q, _ = quantize_per_channel_fp8(torch.randn(8, 16))
    assert torch.equal(Fp8Linear(q, torch.tensor(0.5), None, False).weight_scale, torch.full((8,), 0.5))
    with pytest.raises(ValueError, match="an fp8 weight of 8 rows has 3 scales"):
        Fp8Linear(q, torch.ones(3), None, False)
    with pytest.raises(ValueError, match="fp8 weights are float8_e4m3fn"):
        Fp8Linear(torch.zeros(8, 16), torch.ones(8), None, False)


def test_online_fp8_runs_on_the_torch_path_and_says_why():
    llm = LLM(overrides=BASE + ["model=tiny_random", "quantization=fp8"])
    assert llm.execution.backend == "torch_sdpa"
    assert "quantization fp8 not in" in llm.execution.fallback_note()
    model = llm.engine.runner.model
    for path in PROJECTIONS:
        assert isinstance(model.model.layers[0].get_submodule(path), Fp8Linear)
    assert all(m.activations for m in model.modules() if isinstance(m, Fp8Linear))
    out = llm.generate(["Hello", "The quick brown fox"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    plan = llm.deployment.plan
    assert any("reference path" in n for n in plan.notes)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """The tiny model as an fp8 checkpoint: per-tensor weight scales and
    static input scales, as llm-compressor / vLLM's fp8 format stores them."""
    root = tmp_path_factory.mktemp("fp8")
    spec = resolve(BASE + ["model=tiny_random"], check=False).cfg.model
    plain = generate_tiny(spec, root / "plain")
    folder = root / "fp8"
    out = write_fp8_checkpoint(plain, folder)
    return folder, out


def test_an_fp8_checkpoint_loads_as_it_is_stored(fp8_checkpoint):
    folder, stored = fp8_checkpoint
    q = resolve(BASE + [f"model.path={folder}"]).cfg.quantization
    assert (q.method, q.weight_bits, q.activations) == ("fp8", 8.0, True)
    llm = LLM(overrides=BASE + [f"model.path={folder}"])
    qkv = llm.engine.runner.model.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.activations
    pre = "model.layers.1.self_attn."
    parts = [stored[f"{pre}{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(qkv.weight_fp8.view(torch.uint8), torch.cat(parts).view(torch.uint8))
    want = torch.cat([stored[f"{pre}{p}.weight_scale"].expand(t.shape[0]) for p, t in zip(("q_proj", "k_proj", "v_proj"), parts)])
    assert torch.equal(qkv.weight_scale, want)  # each part's scale on its own rows
    assert qkv.input_scale == max(stored[f"{pre}{p}.input_scale"] for p in ("q_proj", "k_proj", "v_proj"))
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def _per_channel(stored):
    """The checkpoint's projections requantized with a scale per output
    channel and no input scales (compressed-tensors' channel strategy); and
    the same tensors with every projection dequantized (e4m3 x scale, fp32)."""
    tensors = {k: v for k, v in stored.items() if not k.endswith("input_scale")}
    dequantized = {k: v for k, v in tensors.items() if not k.endswith("weight_scale")}
    for name in [k for k in tensors if k.endswith(".weight_scale")]:
        weight = name[: -len("_scale")]
        w = tensors[weight].float() * tensors[name]
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        tensors[weight], tensors[name] = (w / scale).clamp(-448, 448).to(FP8), scale
        dequantized[weight] = tensors[weight].float() * scale
    return tensors, dequantized


def test_a_compressed_tensors_fp8_checkpoint_loads(fp8_checkpoint, tmp_path):
    """llm-compressor's format: per-channel weight scales ([out, 1]) and
    dynamic per-token activations, under quant_method compressed-tensors."""
    folder, stored = fp8_checkpoint
    ct = shutil.copytree(folder, tmp_path / "ct")
    tensors, _ = _per_channel(stored)
    save_file(tensors, str(ct / "model.safetensors"))
    config = json.loads((ct / "config.json").read_text())
    scheme = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
              "targets": ["Linear"]}
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                     "config_groups": {"group_0": scheme}, "ignore": ["lm_head"]}
    (ct / "config.json").write_text(json.dumps(config))
    q = resolve(BASE + [f"model.path={ct}"]).cfg.quantization
    assert (q.method, q.activations) == ("fp8", True)
    llm = LLM(overrides=BASE + [f"model.path={ct}"])
    down = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(down, Fp8Linear) and down.input_scale is None
    assert torch.equal(down.weight_scale, tensors["model.layers.0.mlp.down_proj.weight_scale"].reshape(-1))
    scheme["weights"] = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
    config["quantization_config"]["format"] = "pack-quantized"
    (ct / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="compressed-tensors weights .* are not built"):
        resolve(BASE + [f"model.path={ct}"])


@pytest.mark.parametrize("extra,message", [
    ({"weight_block_size": [128, 128]}, "weight_block_size with activation_scheme=static is not supported"),
    ({"weight_block_size": [128], "activation_scheme": "dynamic"}, "must be two positive integers"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head"}}, None),
])
def test_fp8_layouts_not_built_are_refused(fp8_checkpoint, tmp_path, extra, message):
    folder, _ = fp8_checkpoint
    other = shutil.copytree(folder, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    if message is None:  # the compressed-tensors form of the same weights, with per-layer KV scales
        scheme = {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}
        config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {"g": scheme}}
        message = "kv_cache_scheme type=float num_bits=8 strategy=attn_head is not supported"
    config["quantization_config"].update(extra)
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        resolve(BASE + [f"model.path={other}"])


def test_an_fp8_checkpoint_refuses_another_method(fp8_checkpoint):
    folder, _ = fp8_checkpoint
    with pytest.raises(ConfigError, match="quantization=int8_wo but the checkpoint .* has "
                                          "quantization_config.quant_method=fp8"):
        resolve(BASE + [f"model.path={folder}", "quantization=int8_wo"])


# Per-layer fp8 KV scales in each naming a checkpoint uses (layer 0: vLLM's fp8 format, layer 1: one scale for both)
KV_SCALES = {0: {"self_attn.k_scale": 4.0, "self_attn.v_scale": 0.25}, 1: {"self_attn.kv_scale": 2.0}}
KV_SCALE_NAMINGS = [{"self_attn.k_proj.output_scale": 4.0, "self_attn.v_proj.output_scale": 0.25},  # compressed-tensors
                    {"self_attn.k_proj.k_scale": 4.0, "self_attn.v_proj.v_scale": 0.25}]  # ModelOpt


def _with_kv_scales(folder, tmp_path, name, scales):
    out = shutil.copytree(folder, tmp_path / name)
    tensors = load_file(str(out / "model.safetensors"))
    for layer, given in scales.items():
        tensors.update({f"model.layers.{layer}.{tail}": torch.tensor(v) for tail, v in given.items()})
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_checkpoint_kv_scales_set_each_layer_and_run_alike_on_both_cpu_paths(tmp_path):
    """k_scale / v_scale tensors give each layer its scales (1.0 where
    absent); with an fp8 KV cache the native forward and torch_sdpa give
    the same tokens over them, and the scales change what is stored."""
    from appliance.kernels.registry import Selection

    plain = generate_tiny(resolve(BASE + ["model=tiny_random"], check=False).cfg.model, tmp_path / "plain")
    scaled = _with_kv_scales(plain, tmp_path, "scaled", KV_SCALES)
    overrides = BASE + [f"model.path={scaled}", "cache.kv_cache_dtype=fp8_e4m3", "model.dtype=float32"]
    p = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
    prompts = ["Hello there", "The quick brown fox jumps"]
    nat = LLM(overrides=overrides)
    layers = nat.engine.runner.model.model.layers
    assert [(a.self_attn.backend.k_scale, a.self_attn.backend.v_scale) for a in layers] == [(4.0, 0.25), (2.0, 2.0)]
    assert nat.engine.runner.backend.name == "cpu_native"
    got = nat.generate(prompts, p, use_tqdm=False)
    ref = LLM(overrides=overrides, selection=Selection(chosen="torch_sdpa")).generate(prompts, p, use_tqdm=False)
    unscaled = LLM(overrides=BASE + [f"model.path={plain}", "cache.kv_cache_dtype=fp8_e4m3", "model.dtype=float32"]
                   ).generate(prompts, p, use_tqdm=False)
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # the paths' attention sums run in other orders: a K or V value the next layer computes a bit apart may
        # round to the neighbouring fp8 value (seen: one byte of the second layer's cache, 1.0e-4 in a logprob)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lb.logprob == pytest.approx(la.logprob, abs=1e-3)
    assert any(la.logprob != lb.logprob for a, b in zip(unscaled, got)
               for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs))


@pytest.mark.parametrize("naming", range(len(KV_SCALE_NAMINGS)))
def test_kv_scales_load_under_each_naming(tmp_path, naming, fp8_checkpoint):
    folder, _ = fp8_checkpoint
    scaled = _with_kv_scales(folder, tmp_path, "named", {1: KV_SCALE_NAMINGS[naming]})
    llm = LLM(overrides=BASE + [f"model.path={scaled}", "cache.kv_cache_dtype=fp8_e4m3"])
    layers = llm.engine.runner.model.model.layers
    assert [(a.self_attn.backend.k_scale, a.self_attn.backend.v_scale) for a in layers] == [(1.0, 1.0), (4.0, 0.25)]
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("value,message", [(torch.ones(4), r"a k KV cache scale of shape \(4,\); one scale per layer"),
                                           (torch.tensor(0.0), "KV cache scales must be positive and finite")])
def test_kv_scales_that_cannot_run_are_refused(tmp_path, fp8_checkpoint, value, message):
    from appliance.errors import ModelLoadError

    folder, _ = fp8_checkpoint
    bad = shutil.copytree(folder, tmp_path / "bad")
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = value
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=message):
        LLM(overrides=BASE + [f"model.path={bad}"])


def _block_quantize(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale per [bn, bk] block) as DeepSeek-V3 / Qwen3 FP8 checkpoints store them."""
    n, k = w.shape
    blocks = w.float().reshape(n // bn, bn, k // bk, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(n, k)
    return q, scale


def test_a_block_wise_fp8_checkpoint_loads_and_runs(fp8_checkpoint, tmp_path):
    """weight_block_size [32, 32] with weight_scale_inv per block: the weight
    is q times its block's scale bit for bit (fused parts keep their own
    blocks), and activations are quantized per token per 32 inputs."""
    from appliance.models.fp8 import quantize_per_token_group_fp8

    folder, stored = fp8_checkpoint
    blk = shutil.copytree(folder, tmp_path / "block")
    tensors = {k: v for k, v in stored.items() if not k.endswith(("input_scale", "weight_scale"))}
    originals = {}
    for name in [k for k in tensors if k.rsplit(".", 2)[-2] in SOURCES]:
        w = stored[name].float() * stored[name[: -len("weight")] + "weight_scale"]
        tensors[name], tensors[name + "_scale_inv"] = _block_quantize(w, 32, 32)
        originals[name] = (tensors[name], tensors[name + "_scale_inv"])
    save_file(tensors, str(blk / "model.safetensors"))
    config = json.loads((blk / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [32, 32]}
    (blk / "config.json").write_text(json.dumps(config))
    llm = LLM(overrides=BASE + [f"model.path={blk}", "model.dtype=float32"])
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.block_k == 32 and qkv.activations
    pre = "model.layers.0.self_attn."
    want = torch.cat([q.float() * s.repeat_interleave(32, 0).repeat_interleave(32, 1)
                      for q, s in (originals[f"{pre}{p}.weight"] for p in ("q_proj", "k_proj", "v_proj"))])
    assert torch.equal(qkv.dequantized_weight(), want)
    x = torch.randn(3, qkv.in_features, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(qkv(x), F.linear(quantize_per_token_group_fp8(x, 32), want))
    xq = quantize_per_token_group_fp8(x, 32)
    assert ((xq - x).abs() <= x.abs().reshape(3, -1, 32).amax(-1).repeat_interleave(32, 1) / 16 + 1e-6).all()
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_rocm_fnuz_weights_are_the_same_values_with_doubled_scales():
    """MI300's e4m3fnuz: every e4m3fn weight byte reinterpreted (half the
    value) times a doubled scale is the e4m3fn weight times its scale, bit
    for bit in fp32; -0 (fnuz's NaN bits) becomes 0. Checked on CPU over
    every byte; the ROCm GEMM itself is not yet run on hardware."""
    from appliance.models.fp8 import _to_fnuz

    every = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).view(torch.float8_e4m3fn)
    finite = ~torch.isnan(every.float())
    fnuz = _to_fnuz(every)
    assert fnuz.dtype == torch.float8_e4m3fnuz and not torch.isnan(fnuz.float()).any()
    scale = torch.tensor(0.37)
    assert torch.equal((fnuz.float() * (scale * 2))[finite], (every.float() * scale)[finite])
    assert fnuz.view(torch.int8)[every.view(torch.int8) == -128].item() == 0


def test_a_weight_only_fp8_checkpoint_gives_its_dequantized_models_tokens(fp8_checkpoint, tmp_path):
    """compressed-tensors fp8 weights (per-channel scales) with activations
    unquantized: greedy tokens and logprobs those of an fp32 folder holding
    exactly the dequantized weights (e4m3 x scale), fp32 activations both."""
    folder, stored = fp8_checkpoint
    wo, plain = shutil.copytree(folder, tmp_path / "wo"), shutil.copytree(folder, tmp_path / "dequantized")
    tensors, dequantized = _per_channel(stored)
    save_file(tensors, str(wo / "model.safetensors"))
    save_file(dequantized, str(plain / "model.safetensors"))
    config = json.loads((wo / "config.json").read_text())
    scheme = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
              "input_activations": None, "targets": ["Linear"]}
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                     "config_groups": {"group_0": scheme}, "ignore": ["lm_head"]}
    (wo / "config.json").write_text(json.dumps(config))
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    assert resolve(BASE + [f"model.path={wo}"]).cfg.quantization.activations is False
    p = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    prompts = ["Hello there", "The capital of France is"]
    got = LLM(overrides=BASE + [f"model.path={wo}", "model.dtype=float32"]).generate(prompts, p, use_tqdm=False)
    want = LLM(overrides=BASE + [f"model.path={plain}", "model.dtype=float32"]).generate(prompts, p, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
