"""gpt-oss's MXFP4 checkpoints: the reference dequantization against transformers', and a tiny gpt-oss whose
experts are stored in MXFP4 served token for token as transformers serves it dequantized. (The model itself
is in the HF parity matrix: tests/unit/test_generation.py, variant gpt_oss.)"""

import json
import shutil

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.errors import ModelLoadError
from appliance.models.loader import resolve_model_folder
from appliance.models.mxfp4 import FP4_VALUES, dequantize_mxfp4, expert_weight_from_mxfp4
from tests.model_helpers import PROMPTS, TINY_VARIANTS

# experts 64 wide: MXFP4 groups of 32 tile both projections' inputs
GPT_OSS = ["+profile=cpu", "model=tiny_random", "model.dtype=float32", *TINY_VARIANTS["gpt_oss"],
           "model.intermediate_size=64", "model.moe_intermediate_size=64"]


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] fp32 -> MXFP4 blocks [..., n / 32, 16] and scales [..., n / 32]: per 32 values the power of two
    that brings the largest within 6, each value the nearest e2m1 code, two codes a byte (the low nibble first)."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    e = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-126, 127)
    v = g / torch.ldexp(torch.ones_like(e), e).unsqueeze(-1)
    codes = (v.abs().unsqueeze(-1) - torch.tensor(FP4_VALUES[:8])).abs().argmin(-1) | ((v < 0).long() << 3)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), (e + 127).to(torch.uint8)


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (3, 8, 4), dtype=torch.uint8, generator=g)
    scales[0, 0, 0], scales[0, 0, 1] = 1, 254  # far down and up the e8m0 range
    ours = expert_weight_from_mxfp4(blocks, scales)
    assert ours.shape == (3, 128, 8)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    codes = torch.arange(16, dtype=torch.uint8)
    one = dequantize_mxfp4((codes[0::2] | (codes[1::2] << 4)).view(1, 8).repeat(1, 2), torch.tensor([127]))
    assert one[:16].tolist() == list(FP4_VALUES)
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[..., :3])
    with pytest.raises(ValueError, match="blocks are bytes"):  # a file's signed bytes are refused, not read backwards
        dequantize_mxfp4(blocks.to(torch.int8), scales)


def test_the_experts_layer_is_transformers_one():
    """gpt-oss's mixture of experts against transformers' GptOssMLP on the same weights, rows large enough that
    both clamps of its SwiGLU bind: the router's top-k softmax, the interleaved gate and up channels, the biases."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from appliance.models.arch import ModelArch
    from appliance.models.gpt_oss import GptOssMoe

    torch.manual_seed(0)
    hf_cfg = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=5, num_experts_per_tok=2,
                          swiglu_limit=1.5, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    ref = GptOssMLP(hf_cfg).eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    arch = ModelArch(architecture="GptOssForCausalLM", num_layers=1, hidden_size=32, intermediate_size=24,
                     num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=16, max_position_embeddings=64,
                     rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=5,
                     num_experts_per_tok=2, moe_intermediate_size=24, swiglu_limit=1.5, swiglu_alpha=1.702)
    ours = GptOssMoe(arch)
    ours.load_state_dict({k: v.detach() for k, v in ref.state_dict().items()})
    x = 4 * torch.randn(40, 32)
    with torch.no_grad():
        want = ref(x[None])[0][0]
        gate_up = x @ ref.experts.gate_up_proj[0] + ref.experts.gate_up_proj_bias[0]
        assert (gate_up[:, ::2] > 1.5).any() and (gate_up[:, 1::2].abs() > 1.5).any()  # both clamps bind
        torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """The tiny gpt-oss with its experts stored in MXFP4, as gpt-oss's checkpoints store them (blocks and scales
    by output row, quantization_config mxfp4)."""
    from safetensors.torch import load_file, save_file

    src = resolve_model_folder(LLM(overrides=GPT_OSS).resolved.cfg.model)
    dst = tmp_path_factory.mktemp("mxfp4") / "gpt-oss-mxfp4"
    shutil.copytree(src, dst)
    f = next(dst.glob("*.safetensors"))
    tensors = load_file(f)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = mxfp4_quantize(tensors.pop(name).transpose(1, 2))
    save_file(tensors, f, metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_an_mxfp4_checkpoint_serves_what_transformers_dequantizes(mxfp4_checkpoint):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    llm = LLM(overrides=["+profile=cpu", f"model.path={mxfp4_checkpoint}", "model.dtype=float32"])
    assert llm.resolved.cfg.quantization.method == "mxfp4" and llm.engine.runner.backend.name == "cpu_native"
    for layer in llm.engine.runner.model.model.layers:  # kept at 4 bits, the float parameters freed
        experts = layer.mlp.experts
        assert experts.gate_up_proj_blocks.dtype == experts.down_proj_scales.dtype == torch.uint8
        assert experts.gate_up_proj.numel() == experts.down_proj.numel() == 0
    hf = AutoModelForCausalLM.from_pretrained(mxfp4_checkpoint, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    eos = llm.tokenizer.eos_token_id
    for prompt, out in zip(ids, outs):
        x = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == ref


def test_mxfp4_is_refused_where_nothing_is_stored_in_it(mxfp4_checkpoint, tmp_path):
    from appliance.config.compose import resolve
    from appliance.errors import ConfigError

    with pytest.raises(ConfigError, match="quantization=mxfp4 reads a checkpoint folder's MXFP4 experts"):
        resolve([*GPT_OSS, "quantization=mxfp4"])
    with pytest.raises(ConfigError, match="quantization=mxfp4 reads gpt-oss's MXFP4 experts"):
        resolve(["+profile=cpu", "model=tiny_random", "quantization=mxfp4"])
    dense = resolve_model_folder(LLM(overrides=GPT_OSS).resolved.cfg.model)
    with pytest.raises(ConfigError, match="has no quantization_config; drop the override"):
        resolve(["+profile=cpu", f"model.path={dense}", "quantization=mxfp4"])


def test_an_mxfp4_checkpoint_missing_its_scales_is_refused(mxfp4_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(mxfp4_checkpoint, broken)
    f = next(broken.glob("*.safetensors"))
    tensors = load_file(f)
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="down_proj has MXFP4 blocks but not both blocks and scales"):
        LLM(overrides=["+profile=cpu", f"model.path={broken}", "model.dtype=float32"])


@pytest.mark.parametrize("experts", ["sliced", "whole"])
def test_an_mxfp4_checkpoint_over_two_ranks_equals_one(mxfp4_checkpoint, experts):
    """Each tensor-parallel rank keeps its channels of every expert at 4 bits (gate_up's output rows, down's
    input groups: 32 of 64 each), or with expert parallelism two of the four experts whole, and its heads and
    sinks."""
    base = ["+profile=cpu", f"model.path={mxfp4_checkpoint}", "model.dtype=float32", "cache.kv_cache_memory_gib=0.05"]
    p = SamplingParams(max_tokens=12, temperature=0)
    one = [o.outputs[0].token_ids for o in LLM(overrides=base).generate(PROMPTS, p, use_tqdm=False)]
    llm = LLM(overrides=[*base, "parallel.tensor_parallel_size=2",
                         f"parallel.enable_expert_parallel={experts == 'whole'}"])
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)] == one
    finally:
        llm.engine.runner.close()


def test_a_ranks_share_of_the_blocks_is_its_channels_or_none():
    """gate_up's output rows are split anywhere; down's inputs only in whole groups of 32 (else the loader
    dequantizes the projection)."""
    from appliance.models.mxfp4 import rank_mxfp4

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 48, 4, 16), dtype=torch.uint8, generator=g)  # 2 experts, 48 out, 128 in
    scales = torch.randint(120, 130, (2, 48, 4), dtype=torch.uint8, generator=g)
    whole = dequantize_mxfp4(blocks, scales)  # [2, 48, 128]
    rows = rank_mxfp4(blocks, scales, (2, 24, 48))
    assert torch.equal(dequantize_mxfp4(*rows), whole[:, 24:48])
    inputs = rank_mxfp4(blocks, scales, (1, 64, 128))
    assert torch.equal(dequantize_mxfp4(*inputs), whole[:, :, 64:128])
    assert rank_mxfp4(blocks, scales, (1, 48, 96)) is None and rank_mxfp4(blocks, scales, None) == (blocks, scales)
    expert = rank_mxfp4(blocks, scales, (0, 1, 2))  # expert parallelism: whole experts
    assert torch.equal(dequantize_mxfp4(*expert), whole[1:2])



def test_the_plan_counts_kept_experts_at_4_25_bits(mxfp4_checkpoint):
    from appliance.config.compose import resolve
    from appliance.config.memory import weight_bytes
    from appliance.config.plan import make_plan
    from appliance.config.quantization import mxfp4_dequantized_share
    from appliance.config.sizes import parameter_counts

    cfg = resolve(["+profile=cpu", f"model.path={mxfp4_checkpoint}", "model.dtype=float32"]).cfg
    counts = parameter_counts(cfg.model)
    assert weight_bytes(cfg, "float32") == int(counts["experts"] * 4.25 / 8) + (counts["total"] - counts["experts"]) * 4
    assert any("MXFP4 experts kept at 4 bits" in n for n in make_plan(cfg).notes)
    # down_proj's inputs over two ranks: 32 each are whole groups; 24 are not, and that third is dequantized
    assert mxfp4_dequantized_share(resolve([*GPT_OSS, "parallel.tensor_parallel_size=2"]).cfg) == 0
    narrow = resolve([*GPT_OSS, "model.intermediate_size=48", "model.moe_intermediate_size=48",
                      "parallel.tensor_parallel_size=2"]).cfg
    assert mxfp4_dequantized_share(narrow) == 1 / 3
