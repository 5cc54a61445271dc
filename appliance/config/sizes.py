"""Parameter counts of a model config and its layers per pipeline stage (no
other config module needed, so checkpoint reading, planning and the
composition root can all use them)."""

from __future__ import annotations

from typing import Optional

from appliance.config.schema import ModelConfig


def parameter_counts(m: ModelConfig) -> dict[str, int]:
    """Parameters of a Llama-family decoder by where they live."""
    embed = m.vocab_size * m.hidden_size
    q = m.hidden_size * m.num_heads * m.head_dim
    kv = 2 * m.hidden_size * m.num_kv_heads * m.head_dim
    o = m.num_heads * m.head_dim * m.hidden_size
    bias = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim if m.qkv_bias else 0
    qk_norm = 2 * m.head_dim if m.qk_norm else 0
    mlp = 3 * m.hidden_size * m.intermediate_size
    norms = 2 * m.hidden_size
    per_layer_linear = q + kv + o + mlp
    per_layer_other = bias + qk_norm + norms
    lm_head = 0 if m.tie_word_embeddings else embed
    return {
        "embedding": embed,
        "lm_head": lm_head,
        "linear": m.num_layers * per_layer_linear,
        "other": m.num_layers * per_layer_other + m.hidden_size,
        "total": embed + lm_head + m.num_layers * (per_layer_linear + per_layer_other) + m.hidden_size,
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
