"""Loader: GGUF dequantization, name mapping, clear errors."""

import json

import numpy as np
import pytest

from appliance.config.compose import ConfigError, resolve
from appliance.models import gguf as our
from appliance.errors import ModelLoadError
from appliance.models.loader import check_checkpoint, resolve_model_folder


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16"])
def test_dequant_matches_reference_implementation(qtype):
    import gguf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(x, t)
    ref = gguf.quants.dequantize(raw, t)
    mine = our.dequantize(raw, qtype, (8, 64))
    np.testing.assert_array_equal(mine, ref.reshape(8, 64).astype(np.float32))
    if qtype.startswith("Q4"):
        assert np.abs(mine - x).max() < 0.5  # 4-bit grid over a N(0,1) block


@pytest.mark.parametrize("alignment", [None, 64])
def test_read_gguf_maps_the_tensors_gguf_reads(tmp_path, alignment):
    """Our header parse and the gguf package's reader give the same tensors
    (names, types, shapes, bytes) and metadata, at any alignment."""
    import gguf

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(1)
    w.add_token_list(["a", "bb", "ccc"])
    rng = np.random.default_rng(2)
    for name, qtype, shape in [("token_embd.weight", "Q8_0", (3, 64)), ("blk.0.attn_norm.weight", "F32", (64,)),
                               ("blk.0.ffn_down.weight", "Q4_1", (5, 96)), ("blk.0.ffn_up.weight", "F16", (7, 32)),
                               ("output.weight", "Q6_K", (2, 256))]:
        x = rng.standard_normal(shape).astype(np.float32)
        t = getattr(gguf.GGMLQuantizationType, qtype)
        if qtype == "Q6_K":  # gguf has no quantizer for it: any bytes of its block size
            raw = rng.integers(0, 256, gguf.quant_shape_to_byte_shape(shape, t), dtype=np.uint8)
        else:
            raw = x.astype(np.float16) if qtype == "F16" else x if qtype == "F32" else gguf.quants.quantize(x, t)
        w.add_tensor(name, raw, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, ours = our.read_gguf(path)
    ref = gguf.GGUFReader(str(path))
    assert meta["llama.block_count"] == 1 and meta["tokenizer.ggml.tokens"] == 3
    assert [t.name for t in ours] == [t.name for t in ref.tensors]
    for a, b in zip(ours, ref.tensors):
        assert a.kind == b.tensor_type.name and a.shape == tuple(reversed(b.shape.tolist()))
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        np.testing.assert_array_equal(a.data, b.data)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_blocks_are_the_block_formula_bit_for_bit(qtype):
    """quantization=gguf keeps 4-bit blocks as (q, d, m): d * q + m is the
    gguf package's own dequantization, exactly."""
    import gguf
    import torch

    from appliance.models.quant import dequantize_int4

    x = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32)
    raw = gguf.quants.quantize(x, getattr(gguf.GGMLQuantizationType, qtype))
    q, d, m = our.int4_blocks(raw, qtype, (8, 96))
    assert q.shape == (8, 96) and d.shape == m.shape == (8, 3) and d.dtype == np.float16 and int(q.max()) <= 15
    w = dequantize_int4(*(torch.from_numpy(a) for a in (q, d, m)))
    np.testing.assert_array_equal(w.numpy(), gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype)))
    with pytest.raises(ValueError, match="Q8_0 is not a 4-bit block type"):
        our.int4_blocks(raw, "Q8_0", (8, 96))


def test_gguf_int4_tensors_are_the_projections_unpermuted_like_their_weights(tmp_path):
    """read_block_tensors takes block-quantized projections (q/k rows in
    Hugging Face order, as the converter writes the dequantized weights); a
    quantized embedding and other types are listed with their type, and a
    tied model's LM head is the embedding's blocks."""
    import torch

    from appliance.models.quant import dequantize_int4

    raw = _write_gguf(tmp_path / "t.gguf")
    blocks, others = our.read_block_tensors(tmp_path / "t.gguf")
    assert others == {"model.embed_tokens.weight": "Q4_0"}
    assert blocks["model.layers.0.self_attn.v_proj.weight"][0].dtype == np.int8  # Q8_0: grouped int8
    for gguf_name, heads in (("blk.0.attn_q.weight", 4), ("blk.0.attn_k.weight", 2), ("blk.0.attn_v.weight", None)):
        data, kind, shape = raw[gguf_name]
        want = our.dequantize(data, kind, shape)
        want = want if heads is None else our.unpermute(want, heads)
        got = dequantize_int4(*(torch.from_numpy(a) for a in blocks[our.hf_name(gguf_name)]))
        np.testing.assert_array_equal(got.numpy(), want)
    head = dequantize_int4(*(torch.from_numpy(a) for a in blocks["lm_head.weight"]))
    np.testing.assert_array_equal(head.numpy(), our.dequantize(*raw["token_embd.weight"]))


def test_the_plan_counts_a_gguf_files_own_widths(tmp_path):
    """quantization=gguf reads the loaded bits per projection weight from the
    file, each fused projection as the loader builds it: q (Q4_1) and k
    (Q4_0) beside v (Q8_0) all load as int8 with fp32 parameters per 32."""
    from appliance.config.gguf_header import gguf_projection_bits

    _write_gguf(tmp_path / "t.gguf")
    q = resolve(["+profile=cpu", f"model.path={tmp_path / 't.gguf'}", "quantization=gguf"], check=False).cfg.quantization
    assert q.weight_bits == 10.0
    layer = {"blk.0.attn_q.weight": (12, 100), "blk.0.attn_k.weight": (2, 50), "blk.0.attn_v.weight": (2, 50),
             "blk.0.ffn_down.weight": (14, 200)}  # Q4_K beside Q4_0: fp32 parameters; Q6_K: groups of 16
    assert gguf_projection_bits(layer) == (200 * 6 + 200 * 12) / 400
    assert gguf_projection_bits({**layer, "blk.0.ffn_up.weight": (1, 10)}) is None  # F16: not kept
    with pytest.raises(ConfigError, match="loads at 10.0 bits a projection weight"):
        resolve(["+profile=cpu", f"model.path={tmp_path / 't.gguf'}", "quantization=gguf", "quantization.weight_bits=5"])
    # A GGUF file on a CPU profile runs at its own width unless quantization is named.
    default = resolve(["+profile=cpu", f"model.path={tmp_path / 't.gguf'}"], check=False).cfg
    assert (default.quantization.method, default.quantization.weight_bits) == ("gguf", 10.0)
    from appliance.config.plan import format_plan, make_plan
    from appliance.config.sizes import parameter_counts

    plan = make_plan(default)  # the tied head runs the Q4_0 embedding's blocks: 5 bits a weight
    assert "quantization       gguf (10 bits per projection weight as loaded; LM head 5 bits a weight)" \
        in format_plan(plan)
    counts = parameter_counts(default.model)
    assert plan.weight_bytes_total == counts["linear"] * 10 // 8 + 64 * 64 * 5 // 8 + \
        (counts["embedding"] + counts["other"]) * 2
    named = resolve(["+profile=cpu", f"model.path={tmp_path / 't.gguf'}", "quantization=none"], check=False).cfg
    assert named.quantization.method == "none"
    assert resolve(["+profile=cpu_int8", f"model.path={tmp_path / 't.gguf'}"], check=False).cfg.quantization.method \
        == "int8_wo"


def test_a_gguf_file_with_a_type_not_kept_stays_dequantized(tmp_path):
    _write_gguf(tmp_path / "t.gguf", f32_down=True)
    q = resolve(["+profile=cpu", f"model.path={tmp_path / 't.gguf'}"], check=False).cfg.quantization
    assert q.method == "none"


def _write_gguf(path, f32_down=False):
    """A one-layer llama GGUF: a Q4_0 embedding, q/k/v in Q4_1/Q4_0/Q8_0 (and,
    with ``f32_down``, an F32 ffn_down). Returns {name: (raw blocks, type, shape)}."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in [(w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_feed_forward_length, 128),
                   (w.add_head_count, 4), (w.add_head_count_kv, 2), (w.add_context_length, 256),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, 64)]:
        add(v)
    rng, raw = np.random.default_rng(0), {}
    for name, shape, kind in [("token_embd.weight", (64, 64), "Q4_0"), ("blk.0.attn_q.weight", (64, 64), "Q4_1"),
                              ("blk.0.attn_k.weight", (32, 64), "Q4_0"), ("blk.0.attn_v.weight", (32, 64), "Q8_0")]:
        t = getattr(gguf.GGMLQuantizationType, kind)
        raw[name] = (gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), t), kind, shape)
        w.add_tensor(name, raw[name][0], raw_shape=raw[name][0].shape, raw_dtype=t)
    if f32_down:
        w.add_tensor("blk.0.ffn_down.weight", rng.standard_normal((64, 128)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return raw


def test_int4_blocks_must_tile_their_rows():
    import torch

    from appliance.models.quant import Int4WeightOnlyLinear

    q, d = torch.zeros(4, 96, dtype=torch.uint8), torch.ones(4, 2, dtype=torch.float16)
    Int4WeightOnlyLinear(None, None, blocks=(q, d, d))  # groups of 48
    for bad in (torch.ones(4, 5, dtype=torch.float16), torch.ones(4, 32, dtype=torch.float16)):  # 96 / 5, groups of 3
        with pytest.raises(ValueError, match="must tile its inputs in an even number"):
            Int4WeightOnlyLinear(None, None, blocks=(q, bad, bad))


def _tiny_model():
    from appliance import LLM

    return LLM(overrides=["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.01",
                          "model.dtype=float32"]).engine.runner.model


def _checkpoint_blocks(model):
    """Every projection of ``model`` as 4-bit blocks under its checkpoint name (q/k/v and gate/up apart)."""
    import torch

    from appliance.models.quant import quantize_groups_int4

    arch, out = model.arch, {}
    q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    for i, layer in enumerate(model.model.layers):
        pre = f"model.layers.{i}."
        qkv, gate_up = layer.self_attn.qkv_proj.weight.data, layer.mlp.gate_up_proj.weight.data
        for name, w in {"self_attn.q_proj": qkv[:q], "self_attn.k_proj": qkv[q:q + kv], "self_attn.v_proj": qkv[q + kv:],
                        "self_attn.o_proj": layer.self_attn.o_proj.weight.data, "mlp.gate_proj": gate_up[:inter],
                        "mlp.up_proj": gate_up[inter:], "mlp.down_proj": layer.mlp.down_proj.weight.data}.items():
            out[f"{pre}{name}.weight"] = tuple(t.numpy() for t in quantize_groups_int4(torch.as_tensor(w), 32))
    return out


def test_gguf_blocks_replace_each_projection_in_its_row_order():
    import torch

    from appliance.models.gguf_blocks import keep_gguf_blocks
    from appliance.models.quant import PROJECTIONS, Int4WeightOnlyLinear, dequantize_int4

    model = _tiny_model()
    blocks = _checkpoint_blocks(model)
    k = blocks["model.layers.1.self_attn.k_proj.weight"]
    blocks["model.layers.1.self_attn.k_proj.weight"] = (k[0], k[1].astype(np.float32), k[2].astype(np.float32))
    before = {p: model.model.layers[1].get_submodule(p).weight.data.clone() for p in PROJECTIONS}
    keep_gguf_blocks(model, blocks, {"model.embed_tokens.weight": "Q8_0"})
    for p in PROJECTIONS:
        mod = model.model.layers[1].get_submodule(p)
        assert isinstance(mod, Int4WeightOnlyLinear)
        # the stacked blocks dequantize to the fused weight quantized part by part, in place
        assert (dequantize_int4(mod.weight_q4, mod.q_scale, mod.q_min) - before[p]).abs().max() < 0.1
    q = blocks["model.layers.1.self_attn.k_proj.weight"]
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert torch.equal(qkv.weight_q4[64:96], torch.from_numpy(q[0]))  # 4 heads x 16, then 2 kv heads x 16
    assert qkv.q_scale.dtype == torch.float32  # one part with fp32 parameters (a Q4_K tensor) widens the rest
    assert torch.equal(qkv.q_scale[:64], torch.from_numpy(blocks["model.layers.1.self_attn.q_proj.weight"][1]).float())
    assert model.model.layers[1].mlp.down_proj.q_scale.dtype == torch.float16


def test_gguf_projections_of_another_width_are_refused_by_name():
    from appliance.models.gguf_blocks import keep_gguf_blocks

    model = _tiny_model()
    blocks = _checkpoint_blocks(model)
    del blocks["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.v_proj.weight \(Q5_0\) are not built at their "
                                         r"width yet: serve it with quantization=none"):
        keep_gguf_blocks(model, blocks, {"model.layers.0.self_attn.v_proj.weight": "Q5_0"})


def test_a_projection_with_an_8_bit_part_becomes_grouped_int8_of_the_same_weights():
    """A Q4_K_M-style layer: q/k 4-bit (groups of 32), v Q6_K-style int8 in
    groups of 16: the fused qkv holds all three exactly, at groups of 16."""
    import torch

    from appliance.models.gguf_blocks import keep_gguf_blocks
    from appliance.models.quant import GroupedInt8Linear, Int4WeightOnlyLinear, dequantize_int4

    model = _tiny_model()
    blocks = _checkpoint_blocks(model)
    g = torch.Generator().manual_seed(0)
    v = (torch.randint(-32, 32, (32, 64), generator=g, dtype=torch.int8), torch.rand(32, 4, generator=g),
         torch.zeros(32, 4))
    blocks["model.layers.0.self_attn.v_proj.weight"] = tuple(t.numpy() for t in v)
    keep_gguf_blocks(model, blocks, {})
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GroupedInt8Linear) and qkv.group == 16
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, Int4WeightOnlyLinear)
    parts = [dequantize_int4(*(torch.as_tensor(a) for a in blocks[f"model.layers.0.self_attn.{p}_proj.weight"]))
             for p in "qkv"]
    assert torch.equal(dequantize_int4(qkv.weight_q8, qkv.q_scale, qkv.q_min), torch.cat(parts))


def test_mixed_block_layers_generate_alike_on_both_paths():
    """The same mixed int4 / grouped-int8 layers through the native whole-step
    forward and through the torch path: the same greedy tokens."""
    import torch

    from appliance import LLM, SamplingParams
    from appliance.kernels.registry import Selection
    from appliance.models.gguf_blocks import keep_gguf_blocks
    from tests.kernel_helpers import float_rows

    overrides = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.01", "model.dtype=float32"]
    outs = []
    for selection in (None, Selection(chosen="torch_sdpa")):
        llm = LLM(overrides=overrides, selection=selection)
        blocks = _checkpoint_blocks(llm.engine.runner.model)
        g = torch.Generator().manual_seed(0)
        blocks["model.layers.0.self_attn.v_proj.weight"] = (
            torch.randint(-32, 32, (32, 64), generator=g, dtype=torch.int8).numpy(),
            (torch.rand(32, 4, generator=g) * 0.05).numpy(), torch.zeros(32, 4).numpy())
        keep_gguf_blocks(llm.engine.runner.model, blocks, {})  # before the first step builds the native forward
        with float_rows():
            outs.append(llm.generate(["Hello there", "The quick brown fox jumps"],
                                     SamplingParams(max_tokens=8, temperature=0, logprobs=2), use_tqdm=False))
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lb.logprob == pytest.approx(la.logprob, abs=1e-4)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_K", "Q6_K"])
def test_int8_blocks_are_the_block_formula_bit_for_bit(qtype):
    import gguf
    import torch

    from appliance.models.quant import dequantize_int4

    if qtype == "Q8_0":
        x = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
        raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(-1)
    else:
        raw = _random_k_blocks(qtype, 4, seed=3)
    q, d, m = our.int8_blocks(raw, qtype, (4, 256))
    assert q.dtype == np.int8 and d.dtype == m.dtype == np.float32
    assert d.shape == (4, 16 if qtype == "Q6_K" else 8)
    w = dequantize_int4(*(torch.from_numpy(a) for a in (q, d, m)))
    np.testing.assert_array_equal(w.numpy(), our.dequantize(raw, qtype, (4, 256)))


def _random_k_blocks(qtype, n_blocks, seed=0, scales=(1e-3, 0.1)):
    """Random K-quant super-blocks (every bit pattern of the packed fields) with finite fp16 scales in ``scales``."""
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    fp16 = rng.uniform(*scales, (n_blocks, 2)).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":
        raw[:, 208:210] = fp16[:, :2]
    else:
        raw[:, 0:4] = fp16
    return raw.reshape(-1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_dequantize_like_the_reference(qtype):
    import gguf

    raw = _random_k_blocks(qtype, 6)
    ref = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype)).reshape(-1)
    np.testing.assert_array_equal(our.dequantize(raw, qtype, (6 * 256,)), ref)


def test_q4_k_blocks_are_int4_with_fp32_sub_block_parameters():
    import torch

    from appliance.models.quant import dequantize_int4

    raw = _random_k_blocks("Q4_K", 4, seed=1)
    q, d, m = our.int4_blocks(raw, "Q4_K", (2, 512))
    assert d.dtype == m.dtype == np.float32 and d.shape == (2, 16) and int(q.max()) <= 15
    w = dequantize_int4(*(torch.from_numpy(a) for a in (q, d, m)))
    np.testing.assert_array_equal(w.numpy(), our.dequantize(raw, "Q4_K", (2, 512)))


def test_unsupported_tensor_type_is_named():
    with pytest.raises(ValueError, match="GGUF tensor type Q2_K is not supported"):
        our.dequantize(np.zeros(84, np.uint8), "Q2_K", (256,))


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    n_head = 2
    permuted = w.reshape(n_head, 2, 8 // n_head // 2, 3).swapaxes(1, 2).reshape(w.shape)  # llama.cpp's converter
    np.testing.assert_array_equal(our.unpermute(permuted, n_head), w)


def test_gguf_names_map_to_hf_names():
    assert our.hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert our.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="no mapping"):
        our.hf_name("blk.0.mystery.weight")


def test_missing_path_and_offline_hub_errors(tmp_path, monkeypatch):
    m = resolve(["+profile=cpu", f"model.path={tmp_path}/nope"], check=False).cfg.model
    with pytest.raises(ModelLoadError, match="no such folder or file"):
        resolve_model_folder(m)
    (tmp_path / "empty").mkdir()
    m = resolve(["+profile=cpu", f"model.path={tmp_path}/empty"], check=False).cfg.model
    with pytest.raises(ModelLoadError, match="folder has no config.json"):
        resolve_model_folder(m)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = resolve(["+profile=cpu", "model.path=someone/some-model"], check=False).cfg.model
    with pytest.raises(ModelLoadError, match="could not download from the Hugging Face hub"):
        resolve_model_folder(m)


def test_checkpoint_mismatch_and_unsupported_architecture(tmp_path):
    m = resolve(["+profile=cpu"], check=False).cfg.model
    hf = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 12, "hidden_size": 576, "intermediate_size": 1536,
          "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
    with pytest.raises(ModelLoadError, match=r"model.num_layers=30 but the checkpoint has num_hidden_layers=12"):
        check_checkpoint(m, hf, tmp_path)
    with pytest.raises(ModelLoadError, match="architecture GPT2LMHeadModel is not supported"):
        check_checkpoint(m, {**hf, "architectures": ["GPT2LMHeadModel"]}, tmp_path)


def test_missing_tensor_is_reported(tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from appliance.kernels.torch_sdpa import TorchSDPABackend
    from appliance.models.loader import load_model
    import torch

    m = resolve(["+profile=cpu", "model=tiny_random"], check=False).cfg.model
    src = resolve_model_folder(m)
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(dst / "model.safetensors"))
    m2 = resolve(["+profile=cpu", "model=tiny_random", f"model.path={dst}"], check=False).cfg.model
    backend = TorchSDPABackend(4, 2, 16, 0.25)
    with pytest.raises(ModelLoadError, match="checkpoint lacks 1 tensors"):
        load_model(m2, backend, torch.float32)
    assert json.loads((dst / "config.json").read_text())["num_hidden_layers"] == 2


def test_every_quantization_method_composes_on_the_gpu_profiles():
    """fp8 through torch._scaled_mm, the 4-bit formats through the Triton
    int4 GEMM (written for the hardware, tested under the interpreter)."""
    from appliance.config.unbuilt import not_built

    assert not_built(resolve(["+profile=h100_fp8", "model=llama3_1_8b"]).cfg) == []
    for method in ("awq", "gptq"):
        assert not_built(resolve(["+profile=h100_bf16", "model=llama3_1_8b", f"quantization={method}"]).cfg) == []
    assert not_built(resolve(["+profile=h100_bf16", "quantization=gguf"]).cfg) == []


def test_the_suite_never_writes_into_the_users_cache():
    """Models and kernels built by tests land in the suite's temporary cache."""
    import os

    from appliance.kernels.cpu_build import _cache_root
    from appliance.models.loader import cache_dir

    test_cache = os.environ["APPLIANCE_CACHE_DIR"]  # set by tests/conftest.py
    assert not test_cache.startswith(os.path.expanduser("~/.cache"))
    for path in (cache_dir(), _cache_root()):
        assert str(path).startswith(test_cache)


def _write_k_quant_gguf(path, tokenizer_folder):
    """A two-layer llama GGUF (hidden 256, ffn 512) whose projections are
    random K-quant blocks: q/k/v/o Q4_K, gate/up Q5_K, down Q6_K."""
    import gguf

    from tests.unit.test_gguf_moe import copy_tokenizer

    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in [(w.add_block_count, 2), (w.add_embedding_length, 256), (w.add_feed_forward_length, 512),
                   (w.add_head_count, 4), (w.add_head_count_kv, 2), (w.add_context_length, 256),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, 512), (w.add_rope_freq_base, 10000.0)]:
        add(v)
    copy_tokenizer(w, tokenizer_folder)
    rng = np.random.default_rng(7)
    w.add_tensor("token_embd.weight", (rng.standard_normal((512, 256)) * 0.05).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    kinds = {"attn_q": ("Q4_K", 256, 256), "attn_k": ("Q4_K", 128, 256), "attn_v": ("Q4_K", 128, 256),
             "attn_output": ("Q4_K", 256, 256), "ffn_gate": ("Q5_K", 512, 256), "ffn_up": ("Q5_K", 512, 256),
             "ffn_down": ("Q6_K", 256, 512)}
    for layer in range(2):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(256, np.float32))
        for i, (part, (kind, rows, cols)) in enumerate(kinds.items()):
            raw = _random_k_blocks(kind, rows * cols // 256, seed=10 * layer + i, scales=(2e-4, 6e-4))
            raw = raw.reshape(rows, -1)
            w.add_tensor(f"blk.{layer}.{part}.weight", raw, raw_shape=raw.shape,
                         raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_k_quant_gguf_runs_at_its_width(tmp_path):
    """A file of Q4_K, Q5_K and Q6_K projections: quantization=gguf (its
    default on a CPU profile) keeps them as int4 panels and grouped int8;
    greedy tokens and logprobs those of the same file dequantized."""
    from appliance import LLM, SamplingParams
    from appliance.models.quant import GroupedInt8Linear, Int4WeightOnlyLinear
    from tests.kernel_helpers import float_rows

    path = tmp_path / "k-quants.gguf"
    _write_k_quant_gguf(path, resolve_model_folder(resolve(["+profile=cpu", "model=tiny_random"]).cfg.model))
    q = resolve(["+profile=cpu", f"model.path={path}"]).cfg.quantization
    assert q.method == "gguf"
    prompts = [[5, 77, 301, 12, 9], [400, 2, 2, 2, 17, 250]]
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=1, ignore_eos=True)
    with float_rows():  # fp32 rows in the native GEMMs, as in the dequantized model
        outs = {}
        for method in ("gguf", "none"):
            llm = LLM(overrides=["+profile=cpu", f"model.path={path}", "model.dtype=float32",
                                 "cache.kv_cache_memory_gib=0.02", f"quantization={method}"])
            outs[method] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            if method == "gguf":
                layer = llm.engine.runner.model.model.layers[0]
                assert isinstance(layer.self_attn.qkv_proj, Int4WeightOnlyLinear)
                assert isinstance(layer.mlp.down_proj, GroupedInt8Linear)
    for a, b in zip(outs["gguf"], outs["none"]):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-3)  # NaN would not pass
