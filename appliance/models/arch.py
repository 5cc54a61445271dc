"""The dimensions and features of one model as the layers build it
(``ModelArch``), made from the config's ``model`` section; a tensor-parallel
rank's part of it is ``layers.parallel.shard_arch``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from appliance.config.schema import ModelConfig


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: Optional[dict] = None
    # Mixture of experts: the layers in ``sparse_layers`` route each token to
    # ``num_experts_per_tok`` of ``num_experts`` experts (see models/layers/moe.py).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[int, ...] = ()
    num_physical_experts: int = 0  # expert slots per sparse layer with redundant ones (0: num_experts)
    # Granite's: the embedding's output, each attention and MLP output before its residual add, the logits' divisor
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # the layers declared sliding-window (``config/kv_groups.layer_kinds``), and the rope base they keep where it
    # is their own (Gemma 3's; None: rope_theta, and rope_scaling, as every layer)
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: Optional[float] = None
    rotary_dim: int = 0  # the channels of each head rope turns, the first ones (0: every one, head_dim)
    # gpt-oss's: o_proj biased too, a learned attention sink per head, the experts' clamped SwiGLU
    o_bias: bool = False
    attention_sinks: bool = False
    swiglu_limit: Optional[float] = None
    swiglu_alpha: Optional[float] = None
    final_logit_softcapping: Optional[float] = None  # Gemma's: the logits soft-capped, cap * tanh(logits / cap)
    # Llama 4's: the layers without rope, their query temperature (floor scale, scale; None: none), the width of
    # the shared expert beside the routed ones in each sparse layer (0: none)
    # DeepSeek-V3's routing (GLM-4.5's): sigmoid scores, the choice within the topk_group best of n_group groups
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    nope_layers: tuple[int, ...] = ()
    attn_temperature: Optional[tuple[int, float]] = None
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(x @ gate) per token (Qwen2-MoE's)

    @staticmethod
    def from_model_config(m: ModelConfig) -> "ModelArch":
        from appliance.config.kv_groups import SLIDING, layer_kinds
        from appliance.config.architectures import ARCHITECTURES
        from appliance.config.sizes import rotary_dim, sparse_layers

        row = ARCHITECTURES.get(m.architecture)
        gpt_oss = row is not None and row.gpt_oss

        rs = m.rope_scaling
        rs_type = rs.type
        scaling = None
        if rs_type != "none":
            scaling = {
                "rope_type": rs_type,
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
            if rs_type == "yarn":
                scaling.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, mscale=rs.mscale,
                               mscale_all_dim=rs.mscale_all_dim, attention_factor=rs.attention_factor,
                               truncate=rs.truncate)
            if rs_type == "longrope":
                scaling.update(short_factor=tuple(rs.short_factor or ()), long_factor=tuple(rs.long_factor or ()),
                               attention_factor=rs.attention_factor)
        return ModelArch(
            architecture=m.architecture,
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            intermediate_size=m.intermediate_size,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            vocab_size=m.vocab_size,
            max_position_embeddings=m.max_position_embeddings,
            rope_theta=m.rope_theta,
            rms_norm_eps=m.rms_norm_eps,
            tie_word_embeddings=m.tie_word_embeddings,
            qkv_bias=m.qkv_bias,
            qk_norm=m.qk_norm,
            rope_scaling=scaling,
            num_experts=m.num_experts,
            num_experts_per_tok=m.num_experts_per_tok,
            moe_intermediate_size=m.moe_intermediate_size,
            norm_topk_prob=m.norm_topk_prob,
            sparse_layers=tuple(sparse_layers(m)),
            embedding_multiplier=m.embedding_multiplier,
            residual_multiplier=m.residual_multiplier,
            logits_scaling=m.logits_scaling,
            sliding_layers=tuple(i for i, kind in enumerate(layer_kinds(m)) if kind == SLIDING),
            rope_local_theta=m.rope_local_theta,
            rotary_dim=rotary_dim(m),
            o_bias=gpt_oss and m.qkv_bias,
            attention_sinks=gpt_oss,
            swiglu_limit=m.swiglu_limit,
            swiglu_alpha=m.swiglu_alpha,
            final_logit_softcapping=m.final_logit_softcapping,
            scoring_func=m.scoring_func,
            n_group=m.n_group,
            topk_group=m.topk_group,
            routed_scaling_factor=m.routed_scaling_factor,
            nope_layers=tuple(m.nope_layers),
            attn_temperature=None if m.attn_temperature_floor_scale is None or m.attn_temperature_scale is None
            else (m.attn_temperature_floor_scale, m.attn_temperature_scale),
            shared_expert_intermediate_size=m.shared_expert_intermediate_size,
            shared_expert_gate=row is not None and row.shared_expert_gate,
        )

    @property
    def rope_dim(self) -> int:
        """The channels of each head rope turns (the first ones); the rope tables' row length."""
        return self.rotary_dim or self.head_dim
