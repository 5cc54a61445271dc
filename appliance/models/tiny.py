"""A small random Llama-family model with its own trained BPE tokenizer,
generated deterministically from the model config (tests and benchmarks of
the machinery). The architecture flags pick the Hugging Face class, so
Qwen2-style (qkv bias), Qwen3-style (q/k norm) and Phi-3 (fused q/k/v and
gate/up tensors, a sliding window) variants come out too,
and the mixture-of-experts architectures (Qwen3-MoE, Mixtral) from their
``num_experts`` keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.config.architectures import ARCHITECTURES, chat_format

if TYPE_CHECKING:
    from appliance.config.schema import ModelConfig

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A scheduler hands out tokens under one budget every step.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Symbols: + - * / = ( ) [ ] { } < > ! ? . , ; :",
    "Unicode: café naïve résumé 東京 こんにちは 😀 🚀 — “quotes” ‘single’",
    "def main():\n    return 42\n",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there!<|im_end|>",
] * 20

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# a harmony model's (gpt-oss's) message tokens, which its outputs are read by
HARMONY_SPECIAL = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]


def build_tokenizer(vocab_size: int, special: tuple[str, ...] = tuple(SPECIAL)):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hf_config_dict(m: ModelConfig, vocab_size: int) -> dict:
    cfg: dict[str, Any] = {
        "architectures": [m.architecture],
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rope_theta": m.rope_theta,
        "rms_norm_eps": m.rms_norm_eps,
        "tie_word_embeddings": m.tie_word_embeddings,
        "initializer_range": 0.1,
        "attention_bias": m.qkv_bias,
        "torch_dtype": "float32",
    }
    if ARCHITECTURES[m.architecture].partial_rotary:
        cfg["partial_rotary_factor"] = m.partial_rotary_factor
    if ARCHITECTURES[m.architecture].multipliers:
        cfg.update(embedding_multiplier=m.embedding_multiplier, residual_multiplier=m.residual_multiplier,
                   attention_multiplier=m.attention_multiplier, logits_scaling=m.logits_scaling)
    if ARCHITECTURES[m.architecture].window == "every":  # written even when null: Mistral's default is 4096
        cfg["sliding_window"] = m.sliding_window
    elif ARCHITECTURES[m.architecture].gpt_oss:  # its layer kinds, clamped SwiGLU; its rope written out (else YaRN)
        cfg.update(sliding_window=m.sliding_window, layer_types=list(m.layer_types or []) or None,
                   swiglu_limit=m.swiglu_limit, swiglu_alpha=m.swiglu_alpha)
        if m.rope_scaling.type == "none":
            cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": m.rope_theta}
    elif ARCHITECTURES[m.architecture].window == "pattern":  # Gemma: its layer kinds, rope bases and caps
        cfg.update(sliding_window=m.sliding_window, layer_types=list(m.layer_types or []) or None,
                   query_pre_attn_scalar=int(m.query_pre_attn_scalar or m.head_dim),
                   hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=m.attn_logit_softcapping,
                   final_logit_softcapping=m.final_logit_softcapping)
        if ARCHITECTURES[m.architecture].family == "gemma3":
            cfg["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": m.rope_theta},
                                      "sliding_attention": {"rope_type": "default",
                                                            "rope_theta": m.rope_local_theta or m.rope_theta}}
            cfg.pop("rope_theta")
    elif ARCHITECTURES[m.architecture].window == "optional" and m.sliding_window is not None:  # Qwen2/3
        cfg.update(use_sliding_window=True, sliding_window=m.sliding_window,
                   layer_types=list(m.layer_types or ["sliding_attention"] * m.num_layers))
    cfg.update(_experts_config(m))
    rs = m.rope_scaling
    rs_type = rs.type
    if rs_type == "longrope":  # its own keys; Phi-3's original context is config.json's own key (it comes first)
        cfg["rope_scaling"] = {"rope_type": rs_type, "factor": rs.factor, "short_factor": list(rs.short_factor or []),
                               "long_factor": list(rs.long_factor or []),
                               **({} if rs.attention_factor is None else {"attention_factor": rs.attention_factor})}
        cfg["original_max_position_embeddings"] = rs.original_max_position_embeddings
    elif rs_type != "none":
        cfg["rope_scaling"] = {"rope_type": rs_type, "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                               "high_freq_factor": rs.high_freq_factor,
                               "original_max_position_embeddings": rs.original_max_position_embeddings}
        if rs_type == "yarn":
            cfg["rope_scaling"].update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, truncate=rs.truncate,
                                       **{k: v for k in ("mscale", "mscale_all_dim", "attention_factor")
                                          if (v := getattr(rs, k)) is not None})
    return cfg


def _experts_config(m: ModelConfig) -> dict:
    """config.json's keys of the model's experts (and Llama 4's attention), as its architecture names them."""
    row = ARCHITECTURES[m.architecture]
    cfg: dict[str, Any] = {}
    if row.llama4:  # its layer kinds and NoPE layers, the query temperature, its experts and shared expert
        tuning = m.attn_temperature_floor_scale is not None
        cfg.update(layer_types=list(m.layer_types or []) or None, attention_chunk_size=m.attention_chunk_size,
                   no_rope_layers=[int(i not in m.nope_layers) for i in range(m.num_layers)],
                   use_qk_norm=m.qk_norm, attn_temperature_tuning=tuning,
                   floor_scale=m.attn_temperature_floor_scale or 8192, attn_scale=m.attn_temperature_scale or 0.1,
                   intermediate_size_mlp=m.intermediate_size, intermediate_size=m.moe_intermediate_size,
                   num_local_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                   interleave_moe_layer_step=m.decoder_sparse_step,
                   moe_layers=[i for i in range(m.num_layers) if (i + 1) % m.decoder_sparse_step == 0
                               and i not in m.mlp_only_layers],
                   rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta})
    elif row.routing == "deepseek":  # GLM-4.5: its first layers dense, shared experts, DeepSeek-V3's routing
        if m.shared_expert_intermediate_size % m.moe_intermediate_size or list(m.mlp_only_layers) != list(
                range(len(m.mlp_only_layers))):
            raise ValueError("a tiny GLM-4.5 needs whole shared experts and its dense layers first")
        cfg.update(n_routed_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                   moe_intermediate_size=m.moe_intermediate_size, norm_topk_prob=m.norm_topk_prob,
                   n_shared_experts=m.shared_expert_intermediate_size // m.moe_intermediate_size,
                   first_k_dense_replace=len(m.mlp_only_layers), n_group=m.n_group, topk_group=m.topk_group,
                   routed_scaling_factor=m.routed_scaling_factor, use_qk_norm=m.qk_norm)
    elif row.experts == "every":  # Mixtral: every layer sparse; its experts' size is intermediate_size
        cfg.update(num_local_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                   intermediate_size=m.moe_intermediate_size)
    elif row.moe:
        cfg.update(num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                   moe_intermediate_size=m.moe_intermediate_size, norm_topk_prob=m.norm_topk_prob,
                   decoder_sparse_step=m.decoder_sparse_step, mlp_only_layers=list(m.mlp_only_layers))
        if row.shared_expert_gate:  # Qwen2-MoE's gated shared expert
            cfg.update(shared_expert_intermediate_size=m.shared_expert_intermediate_size)
    return cfg


def generate_tiny(m: ModelConfig, out_dir: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    harmony = chat_format(m.architecture) == "harmony"
    tok = build_tokenizer(m.vocab_size, tuple(SPECIAL + HARMONY_SPECIAL) if harmony else tuple(SPECIAL))
    if len(tok) != m.vocab_size:
        raise ValueError(f"tokenizer came out with {len(tok)} tokens, the config says {m.vocab_size}")
    model_type = ARCHITECTURES[m.architecture].model_type
    raw = hf_config_dict(m, m.vocab_size)
    raw.pop("architectures")
    if model_type in ("qwen2", "qwen2_moe", "mixtral", "phi3", "gemma3_text", "gemma2"):
        raw.pop("attention_bias")  # Qwen2 always has qkv bias, Mixtral and Phi-3 none
    # the special tokens first: Phi-3's embedding is built with its padding row
    config = AutoConfig.for_model(model_type, **raw, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
    torch.manual_seed(m.seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # non-trivial norms exercise the loader
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing correction: one that matters
                b.normal_(0.0, 0.3)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / "appliance_source.json").write_text(json.dumps({"generator": "tiny_random", "seed": m.seed}))
    tmp.rename(out_dir)
    return out_dir
