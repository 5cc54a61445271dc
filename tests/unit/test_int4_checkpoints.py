"""AWQ and GPTQ checkpoints (4-bit; GPTQ also 8-bit and act-order): the
packed layouts, the quantization facts a folder's quantization_config
sets (and contradictions refused), and tiny checkpoints in each layout
loaded as grouped linears and run."""

import json
import shutil
import zlib

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from appliance import LLM, SamplingParams
from appliance.config.compose import ConfigError, resolve
from appliance.models.int4_checkpoints import (AWQ_ORDER, checkpoint_blocks, pack_awq, pack_gptq,
                                               quantize_zero_point, write_checkpoint)
from appliance.models.quant import PROJECTIONS, GroupedInt8Linear, Int4WeightOnlyLinear, dequantize_int4
from appliance.models.tiny import generate_tiny
from tests.kernel_helpers import float_rows
from tests.model_helpers import PROMPTS

BASE = ["+profile=cpu", "cache.kv_cache_memory_gib=0.05"]
PACK = {"awq": pack_awq, "gptq": pack_gptq}
SOURCES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _reference(q, z, s, g_idx=None):
    """The formats' own formula, s * (q - z), in fp32; input i in group
    g_idx[i] (i // group by default)."""
    if g_idx is None:
        g_idx = torch.arange(q.shape[1]) // (q.shape[1] // s.shape[1])
    g_idx = g_idx.long()
    return (q.float() - z.float()[:, g_idx]) * s.float()[:, g_idx]


def _act_order_quantized(w, group, bits, seed):
    """w quantized in act-order groups: a random g_idx giving each group
    ``group`` inputs, and (q, z, s) in GPTQ's terms for it."""
    k = w.shape[1]
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    q_sorted, z, s = quantize_zero_point(w[:, order], group, bits)
    q = torch.empty_like(q_sorted)
    q[:, order] = q_sorted
    return q, z, s, g_idx


def _dequantized(blocks):
    """fp32 weights of (q, d, m[, perm]) blocks, inputs in natural order."""
    w = dequantize_int4(*blocks[:3])
    if len(blocks) > 3:
        natural = torch.empty_like(w)
        natural[:, blocks[3]] = w
        return natural
    return w


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("group", [32, 64, 256])
def test_blocks_are_the_formula_bit_for_bit(method, group):
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(group))
    q, z, s = quantize_zero_point(w, group)
    assert (_reference(q, z, s) - w).abs().max() <= s.float().max() / 2 + 1e-6
    bq, d, m = checkpoint_blocks(method, PACK[method](q, z, s))
    assert torch.equal(bq, q) and d.dtype == m.dtype == torch.float32
    assert torch.equal(dequantize_int4(bq, d, m), _reference(q, z, s))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_blocks_at_each_width_and_order_are_the_formula(bits, act_order):
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(bits))
    if act_order:
        q, z, s, g_idx = _act_order_quantized(w, 32, bits, seed=3)
    else:
        (q, z, s), g_idx = quantize_zero_point(w, 32, bits), None
    assert (_reference(q, z, s, g_idx) - w).abs().max() <= s.float().max() / 2 + 1e-6
    blocks = checkpoint_blocks("gptq", pack_gptq(q, z, s, bits, g_idx), bits)
    assert blocks[0].dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert len(blocks) == (4 if act_order else 3)
    assert torch.equal(_dequantized(blocks), _reference(q, z, s, g_idx))


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


def test_a_g_idx_with_uneven_groups_is_refused():
    q, z, s = quantize_zero_point(torch.randn(8, 64), 32)
    packed = pack_gptq(q, z, s)
    packed["g_idx"][0] = 1  # group 1 gets 33 inputs
    with pytest.raises(ValueError, match="does not give each of the 2 groups 32 inputs"):
        checkpoint_blocks("gptq", packed)
    with pytest.raises(ValueError, match="GPTQ with 3-bit weights is not supported; supported: \\[4, 8\\]"):
        checkpoint_blocks("gptq", pack_gptq(q, z, s), bits=3)


def test_fused_parts_in_different_act_orders_are_refused():
    from appliance.models.quant import _input_order

    def blocks(seed):
        q, z, s, g_idx = _act_order_quantized(torch.randn(8, 64), 32, 4, seed)
        return checkpoint_blocks("gptq", pack_gptq(q, z, s, 4, g_idx))

    a, b = blocks(1), blocks(2)
    assert torch.equal(_input_order("qkv", [a, a]), a[3])
    with pytest.raises(ValueError, match="different act-order orders"):
        _input_order("qkv", [a, b])
    with pytest.raises(ValueError, match="different act-order orders"):
        _input_order("qkv", [a, a[:3]])


# checkpoint variants: (quant_method, bits, act-order)
VARIANTS = {"awq": ("awq", 4, False), "gptq": ("gptq", 4, False), "gptq-sym": ("gptq", 4, False),
            "gptq8": ("gptq", 8, False),
            "gptq-act": ("gptq", 4, True), "gptq8-act": ("gptq", 8, True)}
FUSED_INPUTS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _symmetric(w, group, bits):
    """GPTQ's symmetric quantization: z = 2^(bits - 1) everywhere, s = absmax / (2^(bits - 1) - 1) per group."""
    out, k = w.shape
    mid = 1 << (bits - 1)
    g = w.float().reshape(out, k // group, group)
    s = (g.abs().amax(dim=2) / (mid - 1)).clamp(min=1e-8).to(torch.float16)
    q = (torch.round(g / s.float()[..., None]) + mid).clamp(0, 2 * mid - 1)
    return q.reshape(out, k).to(torch.uint8), torch.full_like(s, mid, dtype=torch.uint8), s


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny random model, and the same model as AWQ and GPTQ checkpoints
    (groups of 32; each of VARIANTS) plus an fp32 folder of exactly their
    dequantized weights. Act-order variants draw one input order per layer
    input (q, k and v share one, as GPTQ's quantizer gives them)."""
    root = tmp_path_factory.mktemp("int4")
    spec = resolve(BASE + ["model=tiny_random"], check=False).cfg.model
    plain = generate_tiny(spec, root / "plain")
    tensors = load_file(str(plain / "model.safetensors"))
    out = {"plain": plain}
    for variant, (method, bits, act_order) in VARIANTS.items():
        folder = root / variant
        shutil.copytree(plain, folder)
        quantized, dequantized = dict(tensors), dict(tensors)
        for name in tensors:
            source = name.rsplit(".", 2)[-2]
            if source in SOURCES:
                g_idx = None
                if act_order:
                    layer_input = name.replace(source, FUSED_INPUTS.get(source, source))
                    q, z, s, g_idx = _act_order_quantized(tensors[name], 32, bits, zlib.crc32(layer_input.encode()))
                elif variant.endswith("-sym"):  # symmetric: every zero point 2^(bits - 1), scales from absmax
                    q, z, s = _symmetric(tensors[name], 32, bits)
                else:
                    q, z, s = quantize_zero_point(tensors[name], 32, bits)
                packed = pack_awq(q, z, s) if method == "awq" else pack_gptq(q, z, s, bits, g_idx)
                del quantized[name]
                quantized.update({f"{name[:-len('weight')]}{k}": v for k, v in packed.items()})
                dequantized[name] = _reference(q, z, s, g_idx)
        save_file(quantized, str(folder / "model.safetensors"))
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {"quant_method": method, "bits": bits, "group_size": 32,
                                         **({"version": "gemm", "zero_point": True} if method == "awq" else
                                            {"desc_act": act_order, "sym": variant.endswith("-sym")})}
        (folder / "config.json").write_text(json.dumps(config))
        out[variant] = folder
        ref = root / f"{variant}-dequantized"
        shutil.copytree(plain, ref)
        save_file(dequantized, str(ref / "model.safetensors"))
        out[f"{variant}-dequantized"] = ref
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
    from appliance.config.plan import make_plan
    from appliance.config.sizes import parameter_counts

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
    folder = shutil.copytree(checkpoints["gptq"], tmp_path / "three-bit")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="gptq with 3-bit weights is not supported; supported: 4, 8-bit"):
        resolve(BASE + [f"model.path={folder}"])


def test_an_eight_bit_gptq_checkpoint_sets_eight_bits(checkpoints):
    q = resolve(BASE + [f"model.path={checkpoints['gptq8-act']}"]).cfg.quantization
    assert (q.method, q.weight_bits, q.group_size) == ("gptq", 8.0, 32)
    with pytest.raises(ConfigError, match="quantization.weight_bits=6 does not match quantization.method=gptq"):
        resolve(BASE + ["model=tiny_random", "quantization=gptq", "quantization.weight_bits=6"], check=True)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_checkpoint_runs_as_its_dequantized_weights(checkpoints, variant):
    """Every projection a grouped linear holding s * (q - z) bit for bit
    (int4, or grouped int8 at 8 bits; act-order inputs in their order);
    generation equal to the fp32 model of those weights (fp32 activations
    throughout; grouped sums differ from fp32 ones only in order)."""
    llm = LLM(overrides=BASE + [f"model.path={checkpoints[variant]}", "model.dtype=float32"])
    ref_llm = LLM(overrides=BASE + [f"model.path={checkpoints[f'{variant}-dequantized']}", "model.dtype=float32"])
    kind = GroupedInt8Linear if VARIANTS[variant][1] == 8 else Int4WeightOnlyLinear
    for layer, ref_layer in zip(llm.engine.runner.model.model.layers, ref_llm.engine.runner.model.model.layers):
        for path in PROJECTIONS:
            mod = layer.get_submodule(path)
            assert isinstance(mod, kind) and (mod.in_perm is not None) == VARIANTS[variant][2]
            assert torch.equal(mod.dequantized(), ref_layer.get_submodule(path).weight.data)
    p = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    with float_rows():
        got = llm.generate(PROMPTS, p, use_tqdm=False)
    ref = ref_llm.generate(PROMPTS, p, use_tqdm=False)
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lb.logprob == pytest.approx(la.logprob, abs=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_linears_gather_their_inputs_on_the_native_path(bits):
    """The native GEMM gathers x[perm] (in blocks of rows) before the stored
    product: equal to the torch path at 1, 5 and 300 rows."""
    from appliance.kernels.cpu_native import NativeLinear

    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(bits))
    q, z, s, g_idx = _act_order_quantized(w, 32, bits, seed=5)
    blocks = checkpoint_blocks("gptq", pack_gptq(q, z, s, bits, g_idx), bits)
    kind = GroupedInt8Linear(blocks[:3], None, blocks[3]) if bits == 8 else \
        Int4WeightOnlyLinear(None, None, blocks=blocks[:3], in_perm=blocks[3])
    with float_rows():  # fp32 rows throughout (the vdpbf16ps and int8 rows paths round them)
        for m in (1, 5, 300):
            x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))
            ref = F.linear(x, _reference(q, z, s, g_idx))
            torch.testing.assert_close(kind(x), ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(NativeLinear(kind)(x), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method,bits", [("awq", 4), ("gptq", 4), ("gptq", 8)])
def test_write_checkpoint_writes_each_projection_in_the_layout(tmp_path, method, bits):
    """A folder written by ``write_checkpoint`` holds every projection as the
    format's tensors of round-to-nearest groups, the rest as it was, and
    loads as that method from its quantization_config."""
    spec = resolve(BASE + ["model=tiny_random"], check=False).cfg.model
    plain = generate_tiny(spec, tmp_path / "plain")
    write_checkpoint(plain, tmp_path / "q", method, bits, 32)
    dense, written = load_file(str(plain / "model.safetensors")), load_file(str(tmp_path / "q" / "model.safetensors"))
    n = 0
    for name, w in dense.items():
        prefix, source, _ = name.rsplit(".", 2)
        if source not in SOURCES:
            assert torch.equal(written[name], w)
            continue
        n += 1
        parts = {k[len(prefix) + len(source) + 2:]: v for k, v in written.items() if k.startswith(f"{prefix}.{source}.")}
        assert "weight" not in parts
        q, z, sc = quantize_zero_point(w, 32, bits)
        assert torch.equal(_dequantized(checkpoint_blocks(method, parts, bits)), _reference(q, z, sc))
    assert n == 7 * spec.num_layers
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["bits"], config["group_size"]) == (method, bits, 32)
    llm = LLM(overrides=BASE + [f"model.path={tmp_path / 'q'}"])
    assert llm.resolved.cfg.quantization.method == method
    assert len(llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_write_checkpoint_refuses_groups_that_do_not_divide_and_leaves_nothing(tmp_path):
    spec = resolve(BASE + ["model=tiny_random"], check=False).cfg.model
    plain = generate_tiny(spec, tmp_path / "plain")
    with pytest.raises(ValueError, match="do not split into groups of 48"):
        write_checkpoint(plain, tmp_path / "q", "gptq", 4, 48)
    assert not (tmp_path / "q").exists()
    with pytest.raises(ValueError, match="awq at 8 bits"):
        write_checkpoint(plain, tmp_path / "q", "awq", 8, 32)


@pytest.mark.parametrize("variant,legacy", [("gptq", "quantize_config.json"), ("awq", "quant_config.json")])
def test_an_older_folders_quantize_config_file_is_read(checkpoints, tmp_path, variant, legacy):
    """AutoGPTQ's quantize_config.json and AutoAWQ's quant_config.json (their
    own key names, no quant_method) beside a config.json without
    quantization_config: the folder loads as the same checkpoint."""
    folder = tmp_path / variant
    shutil.copytree(checkpoints[variant], folder)
    config = json.loads((folder / "config.json").read_text())
    qc = config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    if variant == "awq":
        old = {"w_bit": qc["bits"], "q_group_size": qc["group_size"], "zero_point": True, "version": "GEMM"}
    else:
        old = {"bits": qc["bits"], "group_size": qc["group_size"], "desc_act": False, "sym": False}
    (folder / legacy).write_text(json.dumps(old))
    q = resolve(BASE + [f"model.path={folder}"]).cfg.quantization
    assert (q.method, q.weight_bits, q.group_size) == (variant, 4.0, 32)
    p = SamplingParams(max_tokens=6, temperature=0)
    got = LLM(overrides=BASE + [f"model.path={folder}"]).generate(PROMPTS[:1], p, use_tqdm=False)
    want = LLM(overrides=BASE + [f"model.path={checkpoints[variant]}"]).generate(PROMPTS[:1], p, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


@pytest.mark.parametrize("folder, quantization, says", [
    ("awq", "none", "the checkpoint's quantization_config says awq; set quantization=awq"),
    ("gptq", "awq", "the checkpoint's quantization_config says gptq; set quantization=gptq"),
    ("plain", "gptq", "the checkpoint's quantization_config says none \\(unquantized\\); set quantization=none"),
])
def test_the_loader_refuses_a_method_other_than_the_checkpoints(checkpoints, folder, quantization, says):
    """Past validation (a caller of the loader itself), a quantized checkpoint loads only as its own method, and
    a checkpoint-only method only from its checkpoints."""
    from appliance.errors import ModelLoadError
    from appliance.models.loader import load_model

    spec = resolve(BASE + [f"model.path={checkpoints[folder]}"], check=False).cfg.model
    with pytest.raises(ModelLoadError, match=f"quantization={quantization} but {says}"):
        load_model(spec, None, torch.float32, torch.device("cpu"), quantization)  # refused before a backend runs
