"""Validation of how a model's layers attend: their kinds (``model.layer_types``)
with the window or chunk each kind needs, Llama 4's NoPE layers, their query
temperature and its shared expert, each refused on an architecture that does
not build it. Torch-free."""

from __future__ import annotations

from appliance.config.architectures import ARCHITECTURES
from appliance.config.kv_groups import CHUNKED, LAYER_TYPES, SLIDING
from appliance.config.schema import ApplianceConfig, ModelConfig


def layer_type_problems(m: ModelConfig) -> list[str]:
    """``model.layer_types``: one known kind per layer, sliding ones with a window to slide, chunked ones with
    their chunk."""
    if m.layer_types is None:
        return []
    problems = []
    if len(m.layer_types) != m.num_layers:
        problems.append(f"model.layer_types has {len(m.layer_types)} entries for {m.num_layers} layers")
    unknown = sorted(set(m.layer_types) - set(LAYER_TYPES))
    if unknown:
        problems.append(f"model.layer_types: {unknown} not built; each layer is one of {list(LAYER_TYPES)}")
    if SLIDING in m.layer_types and m.sliding_window is None:
        problems.append("model.layer_types names sliding_attention layers but model.sliding_window is null")
    if CHUNKED in m.layer_types and m.attention_chunk_size is None:
        problems.append("model.layer_types names chunked_attention layers but model.attention_chunk_size is null")
    return problems


def llama4_problems(cfg: ApplianceConfig, max_model_len: int) -> list[str]:
    """Chunked local attention, NoPE layers, the query temperature and a shared expert: Llama 4's, set where its
    checkpoint says and only on it."""
    m = cfg.model
    row = ARCHITECTURES.get(m.architecture)
    if row is None:  # an unserved name is the architecture check's
        return []
    temperature = {"attn_temperature_floor_scale": m.attn_temperature_floor_scale,
                   "attn_temperature_scale": m.attn_temperature_scale}
    if not row.llama4:
        owned = {"attention_chunk_size": m.attention_chunk_size, **temperature,
                 "nope_layers": m.nope_layers or None,
                 "shared_expert_intermediate_size": m.shared_expert_intermediate_size or None}
        problems = [f"model.{k}={v} is Llama 4's (Llama4ForCausalLM); {m.architecture} does not build it: leave it "
                    f"{'0' if k == 'shared_expert_intermediate_size' else '[]' if k == 'nope_layers' else 'null'}"
                    for k, v in owned.items() if v is not None]
        if m.layer_types is not None and CHUNKED in m.layer_types:
            problems.append(f"model.layer_types names chunked_attention layers: {m.architecture} does not build "
                            f"chunked local attention (Llama4ForCausalLM does)")
        return problems
    problems = []
    chunk, bs = m.attention_chunk_size, cfg.cache.block_size
    if chunk is not None and chunk < 1:
        problems.append(f"model.attention_chunk_size={chunk} must be at least 1 (or null: none)")
    elif chunk is not None and chunk < max_model_len and chunk % bs:
        problems.append(f"model.attention_chunk_size={chunk} is not a multiple of cache.block_size={bs}: a chunk's "
                        f"blocks must be its own; choose a block size that divides it")
    outside = [i for i in m.nope_layers if not 0 <= i < m.num_layers]
    if outside:
        problems.append(f"model.nope_layers={list(m.nope_layers)}: layers {outside} are outside "
                        f"0..{m.num_layers - 1}")
    if (m.attn_temperature_floor_scale is None) != (m.attn_temperature_scale is None):
        problems.append("model.attn_temperature_floor_scale and model.attn_temperature_scale go together (both "
                        "null: no query temperature)")
    if m.attn_temperature_floor_scale is not None and m.attn_temperature_floor_scale < 1:
        problems.append(f"model.attn_temperature_floor_scale={m.attn_temperature_floor_scale} must be at least 1")
    if m.num_experts > 0 and m.shared_expert_intermediate_size != m.moe_intermediate_size:
        problems.append(f"model.shared_expert_intermediate_size={m.shared_expert_intermediate_size}: "
                        f"{m.architecture}'s sparse layers hold a shared expert as wide as their experts "
                        f"(model.moe_intermediate_size={m.moe_intermediate_size})")
    if m.num_experts > 0 and m.norm_topk_prob:
        problems.append(f"model.norm_topk_prob=true: {m.architecture} weighs each chosen expert by the sigmoid of "
                        f"its router logit (never renormalized); set it false")
    return problems
