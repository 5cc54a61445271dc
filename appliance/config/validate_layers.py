"""Validation of how a model's layers attend and route: their kinds
(``model.layer_types``) with the window or chunk each kind needs, Llama 4's
NoPE layers, their query temperature and its shared expert, DeepSeek-V3's
routing (GLM-4.5's), each refused on an architecture that does not build
it. Torch-free."""

from __future__ import annotations

from appliance.config.architectures import ARCHITECTURES
from appliance.config.hf_facts import DEEPSEEK_ROUTING_KEYS
from appliance.config.kv_groups import CHUNKED, LAYER_TYPES, SLIDING
from appliance.config.schema import ApplianceConfig, ModelConfig

SCORING_FUNCS = ("softmax", "sigmoid")


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
        owned = {"attention_chunk_size": m.attention_chunk_size, **temperature, "nope_layers": m.nope_layers or None}
        problems = [f"model.{k}={v} is Llama 4's (Llama4ForCausalLM); {m.architecture} does not build it: leave it "
                    f"{'[]' if k == 'nope_layers' else 'null'}" for k, v in owned.items() if v is not None]
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


def routing_problems(cfg: ApplianceConfig) -> list[str]:
    """DeepSeek-V3's routing (GLM-4.5's): sigmoid scores over groups of experts, refused on the architectures that
    route otherwise; its groups must split the experts and hold the top-k."""
    m = cfg.model
    row = ARCHITECTURES.get(m.architecture)
    if row is None or m.num_experts <= 0:  # an unserved name, or a dense model: the other checks'
        return []
    if m.scoring_func not in SCORING_FUNCS:
        return [f"model.scoring_func={m.scoring_func} is not one of {', '.join(SCORING_FUNCS)}"]
    defaults = ModelConfig()
    if row.routing != "deepseek":
        deepseek = ", ".join(a.name for a in ARCHITECTURES.values() if a.routing == "deepseek")
        problems = [f"model.{k}={getattr(m, k)} is DeepSeek-V3-style routing's ({deepseek}); {m.architecture} "
                    f"routes otherwise: leave it at {getattr(defaults, k)}"
                    for k in DEEPSEEK_ROUTING_KEYS if getattr(m, k) != getattr(defaults, k)]
        if row.shared_expert_gate and m.shared_expert_intermediate_size < 1:
            problems.append(f"{m.architecture}'s sparse layers hold a gated shared expert: set "
                            f"model.shared_expert_intermediate_size (positive)")
        if m.shared_expert_intermediate_size and not (row.llama4 or row.shared_expert_gate):
            owners = ", ".join(a.name for a in ARCHITECTURES.values()
                               if a.llama4 or a.routing == "deepseek" or a.shared_expert_gate)
            problems.append(f"model.shared_expert_intermediate_size={m.shared_expert_intermediate_size}: "
                            f"{m.architecture} has no shared experts ({owners} have): leave it 0")
        return problems
    problems = []
    if m.scoring_func != "sigmoid":
        problems.append(f"model.scoring_func={m.scoring_func} on {m.architecture}: group-limited routing of "
                        f"softmax scores (DeepSeek-V2's) is not built yet")
    if m.n_group < 1 or m.num_experts % m.n_group:
        problems.append(f"model.n_group={m.n_group} must split model.num_experts={m.num_experts} evenly")
    elif not 1 <= m.topk_group <= m.n_group:
        problems.append(f"model.topk_group={m.topk_group} must be in 1..{m.n_group} (model.n_group)")
    elif m.num_experts_per_tok > m.topk_group * (m.num_experts // m.n_group):
        problems.append(f"model.num_experts_per_tok={m.num_experts_per_tok} is more than the {m.topk_group} "
                        f"chosen groups hold ({m.topk_group * (m.num_experts // m.n_group)} experts)")
    if not m.routed_scaling_factor > 0:
        problems.append(f"model.routed_scaling_factor={m.routed_scaling_factor} must be positive")
    return problems
