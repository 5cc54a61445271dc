"""Parameter counts of a model config and its layers per pipeline stage (no
other config module needed, so checkpoint reading, planning and the
composition root can all use them)."""

from __future__ import annotations

from typing import Optional

from appliance.config.architectures import ARCHITECTURES
from appliance.config.schema import ModelConfig


def attention_scale(m: ModelConfig) -> float:
    """What the attention scores are scaled by: ``model.attention_multiplier`` (Granite's),
    ``model.query_pre_attn_scalar ** -0.5`` (Gemma 3's), else head_dim ** -0.5."""
    if m.attention_multiplier is not None:
        return m.attention_multiplier
    return (m.query_pre_attn_scalar if m.query_pre_attn_scalar is not None else m.head_dim) ** -0.5


def rotary_dim(m: ModelConfig) -> int:
    """The channels of each head rope turns, the first ones: ``model.partial_rotary_factor`` of head_dim, as
    transformers counts them."""
    return int(m.head_dim * m.partial_rotary_factor)


def sparse_layers(m: ModelConfig) -> list[int]:
    """The decoder layers that route to experts (none for a dense model):
    every ``decoder_sparse_step``-th, except ``mlp_only_layers``."""
    if m.num_experts <= 0:
        return []
    step = max(1, m.decoder_sparse_step)
    return [i for i in range(m.num_layers) if (i + 1) % step == 0 and i not in set(m.mlp_only_layers)]


def parameter_counts(m: ModelConfig) -> dict[str, int]:
    """Parameters of a Llama-family decoder by where they live. ``linear``
    counts every projection, experts included (``experts`` of them);
    ``active`` is what one token reads (its ``num_experts_per_tok``
    experts of each sparse layer, not all of them, and its shared expert). Routers are ``other``
    (they stay unquantized, in fp32)."""
    embed = m.vocab_size * m.hidden_size
    q = m.hidden_size * m.num_heads * m.head_dim
    kv = 2 * m.hidden_size * m.num_kv_heads * m.head_dim
    o = m.num_heads * m.head_dim * m.hidden_size
    bias = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim if m.qkv_bias else 0
    row = ARCHITECTURES.get(m.architecture)
    qk_norm = 2 * m.head_dim if m.qk_norm and not (row is not None and row.llama4) else 0  # Llama 4's: no weight
    mlp = 3 * m.hidden_size * m.intermediate_size
    expert = 3 * m.hidden_size * m.moe_intermediate_size
    norms = (4 if row is not None and row.gemma else 2) * m.hidden_size  # Gemma 3's: before and after each
    sparse = len(sparse_layers(m))
    dense = m.num_layers - sparse
    experts = sparse * m.num_experts * expert
    router = sparse * m.num_experts * m.hidden_size
    attention = m.num_layers * (q + kv + o)
    shared = sparse * 3 * m.hidden_size * m.shared_expert_intermediate_size  # every token reads it
    linear = attention + dense * mlp + experts + shared
    other = m.num_layers * (bias + qk_norm + norms) + router + m.hidden_size
    lm_head = 0 if m.tie_word_embeddings else embed
    total = embed + lm_head + linear + other
    return {
        "embedding": embed,
        "lm_head": lm_head,
        "linear": linear,
        "experts": experts,
        "other": other,
        "total": total,
        "active": total - experts + sparse * m.num_experts_per_tok * expert,
    }


def pipeline_partition(num_layers: int, pp_size: int, partition: Optional[list[int]] = None) -> list[int]:
    """Layers per stage: ``partition`` when given, else an even split whose
    remainder goes one layer each to the stages before the last, from the
    second-to-last back (the last stage also runs the LM head), as vLLM splits."""
    if partition:
        return list(partition)
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    return parts
