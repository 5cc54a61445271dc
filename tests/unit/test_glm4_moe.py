"""GLM-4.5's layers against transformers' on the same weights (DeepSeek-V3's routing, the shared experts), its
config.json read as transformers reads it, what validation refuses of the routing, and its multi-token-prediction
layer left unread. (The model is in the HF parity matrix: tests/unit/test_generation.py, variant glm4_moe.)"""

import json
import re
import shutil

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.config.compose import resolve
from appliance.config.hf_facts import hf_facts
from appliance.errors import ConfigError
from appliance.models.arch import ModelArch
from appliance.models.layers.moe import SparseMoe
from appliance.models.loader import resolve_model_folder
from tests.model_helpers import PROMPTS, TINY_VARIANTS

GLM = ["+profile=cpu", "model=tiny_random", "model.dtype=float32", *TINY_VARIANTS["glm4_moe"]]


def test_the_sparse_layer_routes_as_transformers_does():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    torch.manual_seed(0)
    hf_cfg = Glm4MoeConfig(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
                           n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2)
    ref = Glm4MoeMoE(hf_cfg).eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ref.gate.e_score_correction_bias.normal_(0.0, 0.5)
    arch = ModelArch(architecture="Glm4MoeForCausalLM", num_layers=1, hidden_size=32, intermediate_size=64,
                     num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=16, max_position_embeddings=64,
                     rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=16,
                     num_experts_per_tok=4, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                     scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    ours = SparseMoe(arch)
    state = {k: v.detach() for k, v in ref.state_dict().items()}
    gate_up, down = state.pop("experts.gate_up_proj"), state.pop("experts.down_proj")  # [E, 2I, H], [E, H, I]
    state["experts.w13"], state["experts.w2"] = gate_up, down
    shared = "shared_experts."
    state[shared + "gate_up_proj.weight"] = torch.cat([state.pop(shared + "gate_proj.weight"),
                                                       state.pop(shared + "up_proj.weight")])
    ours.load_state_dict(state)
    x = torch.randn(40, 32)
    with torch.no_grad():
        want = ref(x[None])[0]
        torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-5)
        # the groups bind: without them some token's experts differ
        _, ids = ours.route(ours.router_logits(x))
        free = torch.topk(torch.sigmoid(ours.router_logits(x)) + ours.gate.e_score_correction_bias, 4, dim=-1)[1]
        assert (ids.sort(-1)[0] != free.sort(-1)[0]).any()


GLM45_AIR = {  # zai-org/GLM-4.5-Air's config.json, as far as the facts read it
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "first_k_dense_replace": 1,
    "head_dim": 128, "hidden_size": 4096, "intermediate_size": 10944, "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000, "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1,
    "use_qk_norm": False, "vocab_size": 151552,
}


def test_glm45_airs_config_reads_as_transformers_reads_it():
    facts, problems = hf_facts(GLM45_AIR)
    got = {f.key: f.value for f in facts}
    assert not problems
    assert (got["num_experts"], got["num_experts_per_tok"], got["moe_intermediate_size"]) == (128, 8, 1408)
    assert (got["shared_expert_intermediate_size"], got["mlp_only_layers"], got["decoder_sparse_step"]) == (1408, [0], 1)
    assert (got["scoring_func"], got["n_group"], got["topk_group"], got["routed_scaling_factor"]) == (
        "sigmoid", 1, 1, 1.0)
    assert (got["qkv_bias"], got["qk_norm"], got["partial_rotary_factor"]) == (True, False, 0.5)
    without = {k: v for k, v in GLM45_AIR.items() if k != "partial_rotary_factor"}  # transformers' default: half
    assert {f.key: f.value for f in hf_facts(without)[0]}["partial_rotary_factor"] == 0.5
    qwen = {f.key: f.value for f in hf_facts({"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2,
                                              "hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2,
                                              "vocab_size": 8, "max_position_embeddings": 8, "num_experts": 4,
                                              "num_experts_per_tok": 2, "moe_intermediate_size": 4})[0]}
    assert (qwen["scoring_func"], qwen["shared_expert_intermediate_size"]) == ("softmax", 0)


@pytest.mark.parametrize("override,message", [
    (["model.scoring_func=softmax"], "group-limited routing of softmax scores (DeepSeek-V2's) is not built yet"),
    (["model.scoring_func=tanh"], "model.scoring_func=tanh is not one of softmax, sigmoid"),
    (["model.n_group=3"], "model.n_group=3 must split model.num_experts=8 evenly"),
    (["model.topk_group=5"], "model.topk_group=5 must be in 1..4"),
    (["model.topk_group=1", "model.num_experts_per_tok=3"], "more than the 1 chosen groups hold (2 experts)"),
    (["model.routed_scaling_factor=0"], "model.routed_scaling_factor=0.0 must be positive"),
])
def test_deepseek_routing_refuses_what_it_cannot_run(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(GLM + override)


@pytest.mark.parametrize("override,message", [
    (["model.scoring_func=sigmoid"], "model.scoring_func=sigmoid is DeepSeek-V3-style routing's"),
    (["model.routed_scaling_factor=2.5"], "Qwen3MoeForCausalLM routes otherwise: leave it at 1.0"),
    (["model.shared_expert_intermediate_size=32"], "Qwen3MoeForCausalLM has no shared experts (Qwen2MoeForCausalLM, "
                                                   "Llama4ForCausalLM, Glm4MoeForCausalLM have): leave it 0"),
])
def test_other_mixtures_of_experts_refuse_deepseek_routing(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(["+profile=cpu", "model=tiny_random_moe"] + override)


def test_the_multi_token_prediction_layer_is_not_read(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = resolve_model_folder(resolve(GLM).cfg.model)
    shutil.copytree(folder, tmp_path / "glm", dirs_exist_ok=True)
    glm = tmp_path / "glm"
    f = next(glm.glob("*.safetensors"))
    tensors = load_file(f)
    extra = {k.replace("model.layers.1.", "model.layers.2."): v + 1.0 for k, v in tensors.items()
             if k.startswith("model.layers.1.")}  # a layer after the model's two
    save_file({**tensors, **extra}, f, metadata={"format": "pt"})
    config = json.loads((glm / "config.json").read_text())
    (glm / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    p = SamplingParams(max_tokens=8, temperature=0)
    one = [o.outputs[0].token_ids for o in LLM(overrides=GLM).generate(PROMPTS[:3], p, use_tqdm=False)]
    llm = LLM(overrides=["+profile=cpu", f"model.path={glm}", "model.dtype=float32"])
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], p, use_tqdm=False)] == one
