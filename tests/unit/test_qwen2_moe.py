"""Qwen2-MoE's config.json read as transformers reads it (its gated shared expert, its q/k/v bias, its sliding
layers), and what validation refuses of it. (The model is in the HF parity matrix: tests/unit/test_generation.py,
variant qwen2_moe; over ranks in tests/integration/test_tensor_parallel.py.)"""

import re

import pytest

from appliance.config.compose import resolve
from appliance.config.hf_facts import hf_facts
from appliance.errors import ConfigError
from tests.model_helpers import TINY_VARIANTS

QWEN15_MOE = {  # Qwen/Qwen1.5-MoE-A2.7B's config.json, as far as the facts read it
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "decoder_sparse_step": 1,
    "hidden_size": 2048, "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "shared_expert_intermediate_size": 5632, "sliding_window": 32768,
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
}


def test_qwen15_moes_config_reads_as_transformers_reads_it():
    facts, problems = hf_facts(QWEN15_MOE)
    got = {f.key: f.value for f in facts}
    assert not problems
    assert (got["num_experts"], got["num_experts_per_tok"], got["moe_intermediate_size"]) == (60, 4, 1408)
    assert (got["shared_expert_intermediate_size"], got["scoring_func"], got["qkv_bias"]) == (5632, "softmax", True)
    assert got["sliding_window"] is None and got["mlp_only_layers"] == []
    # with use_sliding_window, transformers' Qwen2-MoE slides every other layer below max_window_layers
    sliding = {f.key: f.value for f in hf_facts({**QWEN15_MOE, "use_sliding_window": True, "sliding_window": 4096,
                                                 "max_window_layers": 4})[0]}
    assert sliding["layer_types"][:6] == ["sliding_attention", "full_attention"] * 2 + ["full_attention"] * 2
    assert "qkv_bias=false on Qwen2MoeForCausalLM is not built" in hf_facts({**QWEN15_MOE, "qkv_bias": False})[1][0]


def test_qwen2_moe_needs_its_shared_expert():
    base = ["+profile=cpu", "model=tiny_random", *TINY_VARIANTS["qwen2_moe"]]
    with pytest.raises(ConfigError, match=re.escape("Qwen2MoeForCausalLM's sparse layers hold a gated shared "
                                                    "expert: set model.shared_expert_intermediate_size")):
        resolve(base + ["model.shared_expert_intermediate_size=0"])
    with pytest.raises(ConfigError, match=re.escape("model.scoring_func=sigmoid is DeepSeek-V3-style routing's")):
        resolve(base + ["model.scoring_func=sigmoid"])
