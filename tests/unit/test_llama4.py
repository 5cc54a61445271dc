"""Llama 4's own layers against transformers' on the same weights: its mixture of experts (sigmoid top-k scores
on the input, the shared expert) and its rope over interleaved channel pairs. (The model is in the HF parity
matrix: tests/unit/test_generation.py, variant llama4.)"""

import torch

from appliance.models.arch import ModelArch
from appliance.models.layers.moe import grouped_experts
from appliance.models.layers.rotary import rope_tables
from appliance.models.llama4 import Llama4Moe, interleaved_rope


def _arch(**kw) -> ModelArch:
    return ModelArch(architecture="Llama4ForCausalLM", num_layers=1, hidden_size=32, intermediate_size=40,
                     num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=16, max_position_embeddings=64,
                     rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, **kw)


def test_the_experts_layer_is_transformers_one():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    torch.manual_seed(0)
    hf_cfg = Llama4TextConfig(hidden_size=32, intermediate_size=24, num_local_experts=5, num_experts_per_tok=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    ref = Llama4TextMoe(hf_cfg).eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = Llama4Moe(_arch(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
                           shared_expert_intermediate_size=24))
    state = {k: v.detach() for k, v in ref.state_dict().items()}
    shared = "shared_expert."
    state[shared + "gate_up_proj.weight"] = torch.cat([state.pop(shared + "gate_proj.weight"),
                                                       state.pop(shared + "up_proj.weight")])
    ours.load_state_dict(state)
    x = torch.randn(40, 32)
    with torch.no_grad():
        want = ref(x)[0]
        torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-5)
        # the score scales the expert's input, not its output: the two differ through the gated activation
        top, ids = torch.topk(ours.router(x), 2, dim=-1)
        on_output = ours.shared_expert(x) + grouped_experts(x, torch.sigmoid(top), ids, 0, 5, ours.experts.expert)
        assert (on_output - want).abs().max() > 0.1


def test_interleaved_rope_turns_channel_pairs_as_transformers_does():
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

    arch = _arch()
    cos, sin = rope_tables(arch, 64)
    positions = torch.tensor([0, 3, 17, 63])
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    freqs = torch.polar(torch.ones(4, 8), positions[:, None].float() * inv_freq)
    want_q, want_k = apply_rotary_emb(q[None], k[None], freqs[None])
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    torch.testing.assert_close(interleaved_rope(q, c, s), want_q[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(interleaved_rope(k, c, s), want_k[0], rtol=1e-5, atol=1e-5)
