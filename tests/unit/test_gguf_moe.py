"""A Qwen3-MoE GGUF file (``general.architecture=qwen3moe``) as llama.cpp's
converter writes one: each layer's experts stacked in one tensor per
projection (``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``) beside
its router (``ffn_gate_inp``), a layer without a router dense, Q and K
rows as Hugging Face stores them (llama.cpp interleaves only a llama
file's). Written here from the tiny random Qwen3-MoE (fp32, so exact),
with the folder's tokenizer: its facts resolve, it stays
unquantized on a CPU profile, and it generates the Hugging Face folder's
tokens and logprobs. A Mixtral file (``llama`` with experts, Q and K rows
interleaved) does too."""

import numpy as np
import pytest

from appliance import LLM, SamplingParams
from appliance.config.compose import resolve
from appliance.models.loader import resolve_model_folder

TINY_MOE = ["+profile=cpu", "model=tiny_random_moe", "cache.kv_cache_memory_gib=0.02"]
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def copy_tokenizer(w, folder):
    """The tiny model folder's byte-level BPE tokenizer into writer ``w`` as a
    GGUF states one (``gpt2``: tokens by id, their types, merges, BOS and
    EOS), so the file's tokenizer encodes as the folder's does and stays
    within the model's vocabulary."""
    import json

    import gguf

    t = json.loads((folder / "tokenizer.json").read_text())
    cfg = json.loads((folder / "config.json").read_text())
    vocab = sorted(t["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    special = {a["id"] for a in t["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([token for token, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for _, i in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in t["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])


def write_qwen3moe_gguf(folder, path, kinds=None):
    """The folder's model as a qwen3moe GGUF; ``kinds`` maps a GGUF tensor
    name's projection part (``attn_q``, ``ffn_gate_exps``, ...) to the block
    type it is quantized to (F32 otherwise)."""
    import json

    import gguf
    from safetensors.torch import load_file

    kinds = kinds or {}

    def put(name, array):
        kind = kinds.get(name.split(".")[-2]) if name.startswith("blk.") else kinds.get(name.split(".")[0])
        if kind is None:
            w.add_tensor(name, array)
            return
        t = getattr(gguf.GGMLQuantizationType, kind)
        raw = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), t)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=t)

    cfg = json.loads((folder / "config.json").read_text())
    tensors = {k: v.numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for add, v in [(w.add_block_count, cfg["num_hidden_layers"]), (w.add_embedding_length, cfg["hidden_size"]),
                   (w.add_feed_forward_length, cfg["intermediate_size"]),
                   (w.add_head_count, cfg["num_attention_heads"]), (w.add_head_count_kv, cfg["num_key_value_heads"]),
                   (w.add_key_length, cfg["head_dim"]), (w.add_value_length, cfg["head_dim"]),
                   (w.add_context_length, cfg["max_position_embeddings"]),
                   (w.add_layer_norm_rms_eps, cfg["rms_norm_eps"]), (w.add_rope_freq_base, 10000.0),
                   (w.add_vocab_size, cfg["vocab_size"]), (w.add_expert_count, cfg["num_local_experts"]),
                   (w.add_expert_used_count, cfg["num_experts_per_tok"]),
                   (w.add_expert_feed_forward_length, cfg["moe_intermediate_size"])]:
        add(v)
    copy_tokenizer(w, folder)
    put("token_embd.weight", tensors.pop("model.embed_tokens.weight"))
    put("output_norm.weight", tensors.pop("model.norm.weight"))
    put("output.weight", tensors.pop("lm_head.weight"))
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for hf, ours in LAYER.items():
            if pre + hf + ".weight" in tensors:
                put(f"blk.{i}.{ours}.weight", tensors.pop(pre + hf + ".weight"))
        for proj, ours in [("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")]:
            names = [f"{pre}mlp.experts.{e}.{proj}.weight" for e in range(cfg["num_local_experts"])]
            if names[0] in tensors:
                put(f"blk.{i}.{ours}.weight", np.stack([tensors.pop(n) for n in names]))
    assert not tensors, sorted(tensors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return cfg


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    folder = resolve_model_folder(resolve(TINY_MOE).cfg.model)
    path = tmp_path_factory.mktemp("gguf") / "tiny-moe.gguf"
    return folder, path, write_qwen3moe_gguf(folder, path)


def test_a_qwen3moe_gguf_states_its_experts_and_stays_unquantized(moe_gguf):
    _, path, cfg = moe_gguf
    resolved = resolve(["+profile=cpu", f"model.path={path}"]).cfg
    m = resolved.model
    assert m.architecture == "Qwen3MoeForCausalLM" and m.qk_norm
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (8, 2, 32)
    assert m.norm_topk_prob and m.mlp_only_layers == cfg["mlp_only_layers"] == [1]
    assert resolved.quantization.method == "none"  # F32 projections: nothing to keep at a width


def test_a_qwen3moe_gguf_generates_the_folders_tokens(moe_gguf):
    folder, path, _ = moe_gguf
    prompts = [[5, 77, 301, 12, 9], [400, 2, 2, 2, 2, 2, 17, 250], [1, 300]]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    outs = {}
    for name, source in [("folder", str(folder)), ("gguf", str(path))]:
        llm = LLM(overrides=[*TINY_MOE, f"model.path={source}", "model.dtype=float32"])
        outs[name] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(outs["folder"], outs["gguf"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


MIXTRAL = ["model.architecture=MixtralForCausalLM", "model.mlp_only_layers=[]", "model.qk_norm=false",
           "model.intermediate_size=32"]


def write_mixtral_gguf(folder, path):
    """The folder's tiny Mixtral as llama.cpp writes one: architecture
    ``llama`` with experts, Q and K rows interleaved (its converter's permute),
    experts stacked, fp32."""
    import json

    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    t = {k: v.numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    heads, kv, experts = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_local_experts"]

    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in [(w.add_block_count, cfg["num_hidden_layers"]), (w.add_embedding_length, cfg["hidden_size"]),
                   (w.add_feed_forward_length, cfg["intermediate_size"]), (w.add_head_count, heads),
                   (w.add_head_count_kv, kv), (w.add_key_length, cfg["head_dim"]),
                   (w.add_context_length, cfg["max_position_embeddings"]),
                   (w.add_layer_norm_rms_eps, cfg["rms_norm_eps"]), (w.add_rope_freq_base, 10000.0),
                   (w.add_vocab_size, cfg["vocab_size"]), (w.add_expert_count, experts),
                   (w.add_expert_used_count, cfg["num_experts_per_tok"])]:
        add(v)
    copy_tokenizer(w, folder)
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    w.add_tensor("output.weight", t["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", t[pre + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", t[pre + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(t[pre + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(t[pre + "self_attn.k_proj.weight"], kv))
        w.add_tensor(f"blk.{i}.attn_v.weight", t[pre + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", t[pre + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", t[pre + "block_sparse_moe.gate.weight"])
        for ours, theirs in [("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")]:
            w.add_tensor(f"blk.{i}.{ours}.weight", np.stack(
                [t[f"{pre}block_sparse_moe.experts.{e}.{theirs}.weight"] for e in range(experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_mixtral_gguf_generates_the_folders_tokens(tmp_path):
    """A Mixtral GGUF (``llama`` with experts): Mixtral's facts, its Q and K
    rows un-interleaved, and the Hugging Face folder's tokens and logprobs."""
    folder = resolve_model_folder(resolve([*TINY_MOE, *MIXTRAL]).cfg.model)
    path = tmp_path / "tiny-mixtral.gguf"
    write_mixtral_gguf(folder, path)
    m = resolve(["+profile=cpu", f"model.path={path}"]).cfg.model
    assert m.architecture == "MixtralForCausalLM" and not m.qk_norm and m.mlp_only_layers == []
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (8, 2, 32) and m.norm_topk_prob
    prompts = [[5, 77, 301, 12, 9], [400, 2, 2, 2, 2, 2, 17, 250], [1, 300]]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    outs = {}
    for name, source in [("folder", [*MIXTRAL, f"model.path={folder}"]), ("gguf", [f"model.path={path}"])]:
        llm = LLM(overrides=[*TINY_MOE, *source, "model.dtype=float32"])
        outs[name] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(outs["folder"], outs["gguf"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_a_gguf_of_one_tensor_per_expert_is_refused_by_name(tmp_path):
    import gguf

    from appliance.config.checkpoint import read_facts

    w = gguf.GGUFWriter(str(tmp_path / "old-mixtral.gguf"), "llama")
    for add, v in [(w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_feed_forward_length, 128),
                   (w.add_head_count, 4), (w.add_context_length, 256), (w.add_layer_norm_rms_eps, 1e-5),
                   (w.add_expert_count, 8), (w.add_expert_used_count, 2)]:
        add(v)
    w.add_tensor("blk.0.ffn_gate.3.weight", np.zeros((128, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _, problems = read_facts(tmp_path / "old-mixtral.gguf")
    assert any("stores each expert as its own tensor" in p for p in problems)


# a Q4_K_M-like mix: 4-bit attention and expert gate/up, 8-bit expert down, the dense layer's MLP in both
AT_WIDTH = {"attn_q": "Q4_1", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate_exps": "Q4_0",
            "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q8_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q8_0",
            "output": "Q8_0"}


def test_a_qwen3moe_gguf_runs_its_experts_at_their_width(tmp_path):
    """quantization=gguf (the default for the file on a CPU profile): each
    expert's gate|up and down are linears of the file's own blocks (int4,
    grouped int8 where a part is 8-bit), run in the native forward; greedy
    tokens and logprobs those of the same file dequantized."""
    from appliance.models.quant import GroupedInt8Linear, Int4WeightOnlyLinear
    from tests.kernel_helpers import float_rows

    folder = resolve_model_folder(resolve(TINY_MOE).cfg.model)
    path = tmp_path / "tiny-moe-q.gguf"
    write_qwen3moe_gguf(folder, path, AT_WIDTH)
    q = resolve(["+profile=cpu", f"model.path={path}"]).cfg.quantization
    assert q.method == "gguf" and 5 < q.weight_bits < 10
    prompts = [[5, 77, 301, 12, 9], [400, 2, 2, 2, 2, 2, 17, 250], [1, 300]]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    # fp32 rows in the native GEMMs: where the CPU has bf16 dot products or VNNI, batched int4 and grouped int8
    # rows would otherwise be rounded to bf16 or int8 (this random model moves by up to 0.05 nats on bf16)
    with float_rows():
        outs = {}
        for method in ("gguf", "none"):
            llm = LLM(overrides=[*TINY_MOE, f"model.path={path}", "model.dtype=float32", f"quantization={method}"])
            outs[method] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            if method == "gguf":
                runner = llm.engine.runner
                experts = runner.model.model.layers[0].mlp.experts
                assert experts.quantized == "gguf" and runner.uses_native_forward
                gate_up, down = experts.projections(0)
                assert isinstance(gate_up, Int4WeightOnlyLinear) and isinstance(down, GroupedInt8Linear)
    for a, b in zip(outs["gguf"], outs["none"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


def test_a_qwen3moe_ggufs_expert_blocks_are_its_dequantized_experts(tmp_path):
    """Each expert's blocks (``read_block_tensors``) dequantize to the very
    weights the dequantizing converter writes for it, bit for bit."""
    import torch
    from safetensors.torch import load_file

    from appliance.models.gguf import convert_gguf, read_block_tensors
    from appliance.models.quant import dequantize_int4

    folder = resolve_model_folder(resolve(TINY_MOE).cfg.model)
    path = tmp_path / "tiny-moe-q.gguf"
    write_qwen3moe_gguf(folder, path, AT_WIDTH)
    blocks, others = read_block_tensors(path)
    dequantized = load_file(str(convert_gguf(path, tmp_path / "whole") / "model.safetensors"))
    experts = [n for n in blocks if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3 and not any(".mlp.experts." in n for n in others)  # 2 sparse layers
    for name in experts:
        q, d, m = (torch.from_numpy(np.ascontiguousarray(x)) for x in blocks[name])
        assert torch.equal(dequantize_int4(q, d, m), dequantized[name]), name
