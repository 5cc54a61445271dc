"""The architecture facts of a Hugging Face ``config.json`` (``hf_facts``),
as its architecture's row reads it (``config/architectures.py``): sizes,
rope and its scaling (transformers 5's ``rope_parameters`` too, Gemma 3's per
attention kind), sliding windows and which layers slide, Granite's
multipliers, Gemma 3's attention scale, experts; and the problems of a
config that names what is not built. ``config/checkpoint.py`` writes them over
the model option at resolve time. Torch-free."""

from __future__ import annotations

import dataclasses

from appliance.config import schema
from appliance.config.architectures import TEXT_OF, Architecture, by_model_type, support
from appliance.config.facts import Fact, shown
from appliance.config.kv_groups import CHUNKED, FULL, SLIDING

ROPE_SCALING_TYPES = ("llama3", "linear", "yarn", "longrope")
YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
LONGROPE_KEYS = ("short_factor", "long_factor")
# each rope scaling's keys besides its type: those it needs, then those it may set (longrope's
# original_max_position_embeddings and factor: see _longrope_facts)
ROPE_SCALING_KEYS = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"), YARN_KEYS),
    "longrope": (LONGROPE_KEYS, ("attention_factor",)),
}


def text_model_config(hf: dict) -> dict:
    """The config of an image-text checkpoint's text model (``architectures.TEXT_OF``) as transformers reads it
    (its ``text_config`` with the text model's defaults filled in and older keys, such as ``rope_scaling``,
    read as transformers 5 does), named as the text architecture; other configs as they are."""
    arch = (hf.get("architectures") or [None])[0]
    text_arch = TEXT_OF.get(arch) if isinstance(arch, str) else None
    if text_arch is None:
        return hf
    from transformers import CONFIG_MAPPING, AutoConfig  # the reference reader (imported for these only: it brings torch)

    whole = {k: v for k, v in hf.items() if k not in ("model_type", "quantization_config")}
    sub = dict(whole.get("text_config") or {})
    if sub.get("model_type") in CONFIG_MAPPING:  # switches released checkpoints write as numbers (Llama 4's
        # attn_temperature_tuning: 4), which transformers' strict fields refuse, read as the flags they are
        flags = {f.name for f in dataclasses.fields(CONFIG_MAPPING[sub["model_type"]]) if f.type in (bool, "bool")}
        whole["text_config"] = {k: bool(v) if k in flags and isinstance(v, int) else v for k, v in sub.items()}
    text = AutoConfig.for_model(hf.get("model_type", ""), **whole).get_text_config().to_dict()
    text["architectures"] = [text_arch]
    if "quantization_config" in hf:
        text["quantization_config"] = hf["quantization_config"]
    return text


def hf_facts(hf: dict) -> tuple[list[Fact], list[str]]:
    """The facts a config.json states, and what of it this model cannot run."""
    image_text = (hf.get("architectures") or [None])[0]
    if image_text in TEXT_OF:
        try:
            hf = text_model_config(hf)
        except Exception as e:  # transformers' config errors are of several kinds (strict fields: their own)
            return [], [f"cannot read {image_text}'s text_config ({type(e).__name__}: {e})"]
    typed = by_model_type(hf.get("model_type"))
    arch = (hf.get("architectures") or [typed.name if typed else str(hf.get("model_type"))])[0]
    row, why = support(arch)
    if row is None:
        return [], [why]
    facts = [Fact("architecture", arch, f"architectures={shown([image_text])} (its text model; images not built yet)"
                  if image_text in TEXT_OF else f"architectures={shown([arch])}")]
    problems = []
    dense_width = "intermediate_size_mlp" if row.llama4 else "intermediate_size"  # Llama 4's: its experts'
    for hf_key, key in [("num_hidden_layers", "num_layers"), ("hidden_size", "hidden_size"),
                        (dense_width, "intermediate_size"), ("num_attention_heads", "num_heads"),
                        ("vocab_size", "vocab_size"), ("max_position_embeddings", "max_position_embeddings")]:
        if hf_key in hf:
            facts.append(Fact(key, hf[hf_key], f"{hf_key}={hf[hf_key]}"))
        else:
            problems.append(f"config.json has no {hf_key}")
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    if hf.get("num_key_value_heads"):
        kv = hf["num_key_value_heads"]
        facts.append(Fact("num_kv_heads", kv, f"num_key_value_heads={kv}"))
    elif heads:
        facts.append(Fact("num_kv_heads", heads, f"num_attention_heads={heads} and no num_key_value_heads"))
    if hf.get("head_dim"):
        facts.append(Fact("head_dim", hf["head_dim"], f"head_dim={hf['head_dim']}"))
    elif heads and hidden:
        facts.append(Fact("head_dim", hidden // heads, f"hidden_size/num_attention_heads={hidden // heads}"))
    eps = float(hf.get("rms_norm_eps", 1e-6))
    facts.append(Fact("rms_norm_eps", eps, f"rms_norm_eps={eps}"))
    tie = bool(hf.get("tie_word_embeddings", False))
    facts.append(Fact("tie_word_embeddings", tie, f"tie_word_embeddings={shown(tie)}"))
    for more, more_problems in (_rope_facts(hf, row), _window_facts(hf, row), _multiplier_facts(hf, row),
                                _gemma_facts(hf, row), _swiglu_facts(hf, row), _llama4_facts(hf, row)):
        facts += more
        problems += more_problems
    if row.qkv_bias == "always":  # as in transformers: Qwen2's q/k/v projections always carry a bias
        facts.append(Fact("qkv_bias", True, f"architectures={shown([arch])} (always a q/k/v bias)"))
        if hf.get("qkv_bias") is False:  # Qwen2-MoE's config names it (transformers' default: true)
            problems.append(f"qkv_bias=false on {arch} is not built (its q/k/v projections carry a bias)")
    elif row.gpt_oss:  # q, k, v and o alike (transformers' default: biased)
        bias = bool(hf.get("attention_bias", True))
        facts.append(Fact("qkv_bias", bias, f"attention_bias={shown(bias)} (q, k, v and o)"))
    elif row.qkv_bias == "config":  # q, k and v alike, never o
        bias = bool(hf.get("attention_bias", False))
        facts.append(Fact("qkv_bias", bias, f"attention_bias={shown(bias)} (q, k and v)"))
    elif hf.get("attention_bias"):
        problems.append(f"attention_bias=true on {arch} (a bias on the output projection too) is not supported")
    else:
        facts.append(Fact("qkv_bias", False, f"architectures={shown([arch])} without attention_bias"))
    if row.config_qk_norm:
        qk_norm = bool(hf.get("use_qk_norm", row.qk_norm))
        facts.append(Fact("qk_norm", qk_norm, f"use_qk_norm={shown(qk_norm)}"))
    else:
        qk_norm = row.qk_norm
        facts.append(Fact("qk_norm", qk_norm, f"architectures={shown([arch])} ({'with' if qk_norm else 'no'} q/k norm)"))
    moe, moe_problems = _moe_facts(hf, row)
    return facts + moe, problems + moe_problems


def _rope_facts(hf: dict, row: Architecture) -> tuple[list[Fact], list[str]]:
    """rope_theta and the rope scaling (transformers 5 folds both into rope_parameters, Gemma 3's per attention
    kind: its full-attention layers' are these, its sliding layers' base is rope_local_theta); a rotary
    embedding over part of each head is not built."""
    rope = hf.get("rope_parameters") or {}
    facts: list[Fact] = []
    per_kind = row.gemma and "full_attention" in rope
    if row.gemma:  # Gemma 3's sliding layers' own base: the Hub's rope_local_base_freq, or transformers 5's per kind
        local = hf.get("rope_local_base_freq", (rope.get("sliding_attention") or {}).get(
            "rope_theta", 1e4 if row.family == "gemma3" else None))  # transformers' default: Gemma 3's only
        facts.append(Fact("rope_local_theta", None if local is None else float(local),
                          f"the sliding layers' rope base {local}" if local is not None else "one rope base"))
    if per_kind:
        rope = rope.get("full_attention") or {}
    theta = float(hf.get("rope_theta", rope.get("rope_theta", 1e6 if per_kind else 10000.0)))
    facts.append(Fact("rope_theta", theta, f"rope_theta={theta}"))
    problems: list[str] = []
    partial = float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor")) or row.rotary_default)
    if row.partial_rotary:
        facts.append(Fact("partial_rotary_factor", partial, f"partial_rotary_factor={partial}"))
    elif partial != 1.0:  # transformers' implementation of the architecture turns whole heads too
        problems.append(f"partial_rotary_factor={partial} on {row.name}, whose heads rope turns whole, is not "
                        f"supported")
    scaling = hf.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if row.model_type == "phi3" and rope_type in ("su", "yarn"):  # as transformers' Phi3Config reads them
        rope_type = "longrope"
    if rope_type == "longrope":
        facts += _longrope_facts(hf, scaling)
    if rope_type == "default":
        facts.append(Fact("rope_scaling.type", "none", "no rope scaling"))
    elif rope_type in ROPE_SCALING_TYPES:
        facts.append(Fact("rope_scaling.type", rope_type, f"rope scaling {rope_type}"))
        needed, optional = ROPE_SCALING_KEYS[rope_type]
        facts += [Fact(f"rope_scaling.{k}", [float(v) for v in scaling[k]], f"rope scaling {k} ({len(scaling[k])} values)")
                  if isinstance(scaling[k], list) else Fact(f"rope_scaling.{k}", scaling[k], f"rope scaling {k}={shown(scaling[k])}")
                  for k in (*needed, *optional) if k in scaling]
        problems += [f"rope scaling {rope_type} has no {k}" for k in needed if k not in scaling]
    else:
        problems.append(f"rope scaling {rope_type} is not supported; supported: {', '.join(ROPE_SCALING_TYPES)}")
    return facts, problems


def _longrope_facts(hf: dict, scaling: dict) -> list[Fact]:
    """LongRoPE's original context, as transformers takes it: config.json's own original_max_position_embeddings
    (Phi-3's), else rope_scaling's, else max_position_embeddings; and its factor (what the default attention factor
    comes from): rope_scaling's, else max_position_embeddings over that original context."""
    if "original_max_position_embeddings" in hf:
        original, where = int(hf["original_max_position_embeddings"]), "original_max_position_embeddings"
    elif "original_max_position_embeddings" in scaling:
        original, where = int(scaling["original_max_position_embeddings"]), "rope scaling's original context"
    else:
        original, where = int(hf.get("max_position_embeddings", 0)), "max_position_embeddings (no original one)"
    facts = [Fact("rope_scaling.original_max_position_embeddings", original, f"{where}={original}")]
    if scaling.get("factor") is not None:
        return facts + [Fact("rope_scaling.factor", float(scaling["factor"]), f"rope scaling factor={scaling['factor']}")]
    if original and hf.get("max_position_embeddings"):
        factor = hf["max_position_embeddings"] / original
        facts.append(Fact("rope_scaling.factor", factor, f"max_position_embeddings / {original}={factor:g}"))
    return facts


def _window_facts(hf: dict, row: Architecture) -> tuple[list[Fact], list[str]]:
    """The attention window its layers keep (``model.sliding_window``, ``model.layer_types``), as its architecture
    reads config.json (the row's ``window``): every layer's with sliding_window set (Mistral, Phi-3), or, with
    use_sliding_window, the layers layer_types names (else those from max_window_layers on: Qwen2/3; every other
    one below it: Qwen2-MoE)."""
    window = hf.get("sliding_window")
    if row.window == "every" and window:
        return [Fact("sliding_window", int(window), f"sliding_window={window}"),
                Fact("layer_types", None, "every layer slides")], []
    if row.window == "pattern" and window:  # Gemma: every global_every-th layer is global
        n, every = int(hf["num_hidden_layers"]), int(hf.get("sliding_window_pattern", row.global_every))
        kinds = hf.get("layer_types") or [SLIDING if (i + 1) % every else FULL for i in range(n)]
        how = "layer_types" if hf.get("layer_types") else f"sliding_window_pattern={every}"
        return [Fact("sliding_window", int(window), f"sliding_window={window}"),
                Fact("layer_types", list(kinds), f"{kinds.count(SLIDING)} of {n} layers slide ({how})")], []
    if row.window == "optional" and hf.get("use_sliding_window") and window:
        n = int(hf["num_hidden_layers"])
        first = int(hf.get("max_window_layers", n))
        if row.model_type == "qwen2_moe":  # transformers' Qwen2-MoE: every other layer below max_window_layers
            kinds = hf.get("layer_types") or [SLIDING if (i + 1) % 2 and i < first else FULL for i in range(n)]
        else:
            kinds = hf.get("layer_types") or [SLIDING if i >= first else FULL for i in range(n)]
        how = "layer_types" if hf.get("layer_types") else f"max_window_layers={first}"
        return [Fact("sliding_window", int(window), f"sliding_window={window} (use_sliding_window)"),
                Fact("layer_types", list(kinds), f"{kinds.count(SLIDING)} of {n} layers slide ({how})")], []
    if row.llama4:  # its layer_types: _llama4_facts
        return [Fact("sliding_window", None, "no sliding window")], []
    return [Fact("sliding_window", None, "no sliding window"), Fact("layer_types", None, "no sliding window")], []


def _llama4_facts(hf: dict, row: Architecture) -> tuple[list[Fact], list[str]]:
    """Llama 4's attention, as transformers defaults it: its NoPE layers (no_rope_layers' zeros, else every
    no_rope_layer_interval-th), chunked local attention in the others (attention_chunk_size, 8192), and the NoPE
    layers' query temperature (attn_temperature_tuning, floor_scale 8192, attn_scale 0.1)."""
    if not row.llama4:
        return [], []
    n, every = int(hf.get("num_hidden_layers", 0)), int(hf.get("no_rope_layer_interval", 4))
    rope = hf.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)]
    nope = [i for i, r in enumerate(rope) if not r]
    chunk = hf.get("attention_chunk_size", 8192)
    kinds = hf.get("layer_types") or [CHUNKED if r and chunk is not None else FULL for r in rope]
    facts = [Fact("nope_layers", nope, f"{len(nope)} of {n} layers without rope (no_rope_layers)"),
             Fact("attention_chunk_size", None if chunk is None else int(chunk), f"attention_chunk_size={chunk}"),
             Fact("layer_types", list(kinds), f"{kinds.count(CHUNKED)} of {n} layers attend in chunks")]
    tuning = bool(hf.get("attn_temperature_tuning", True))
    floor, scale = (int(hf.get("floor_scale", 8192)), float(hf.get("attn_scale", 0.1))) if tuning else (None, None)
    return facts + [Fact("attn_temperature_floor_scale", floor, f"floor_scale={floor}" if tuning else "no tuning"),
                    Fact("attn_temperature_scale", scale, f"attn_scale={scale}" if tuning else "no tuning")], []


def _swiglu_facts(hf: dict, row: Architecture) -> tuple[list[Fact], list[str]]:
    """gpt-oss's clamped SwiGLU, as transformers defaults it (limit 7, alpha 1.702)."""
    if not row.gpt_oss:
        return [], []
    return [Fact(key, float(hf.get(key, default)), f"{key}={float(hf.get(key, default))}")
            for key, default in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702))], []


def _multiplier_facts(hf: dict, row: Architecture) -> tuple[list[Fact], list[str]]:
    """Granite's multipliers, as transformers defaults them (attention_multiplier 1.0, not head_dim ** -0.5)."""
    if not row.multipliers:
        return [], []
    return [Fact(key, float(hf.get(key, 1.0)), f"{key}={float(hf.get(key, 1.0))}")
            for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")], []


def _gemma_facts(hf: dict, row: Architecture) -> tuple[list[Fact], list[str]]:
    """Gemma's attention scale and soft-capping (as transformers defaults them: Gemma 2 caps, Gemma 3 does
    not); the bidirectional attention it may name is not built."""
    if not row.gemma:
        return [], []
    scalar = float(hf.get("query_pre_attn_scalar", 256))
    facts = [Fact("query_pre_attn_scalar", scalar, f"query_pre_attn_scalar={scalar}")]
    capped = row.family == "gemma2"
    for key, default in (("attn_logit_softcapping", 50.0 if capped else None),
                         ("final_logit_softcapping", 30.0 if capped else None)):
        cap = hf.get(key, default)
        facts.append(Fact(key, None if cap is None else float(cap), f"{key}={cap}"))
    problems = []
    if hf.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=true (an encoder's attention) is not built yet")
    return facts, problems


def dense_facts(source: str) -> list[Fact]:
    """A dense checkpoint's mixture-of-experts keys: none, at their defaults."""
    defaults = schema.ModelConfig()
    return [Fact(key, getattr(defaults, key), source) for key in MOE_KEYS]


MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
            "mlp_only_layers", "shared_expert_intermediate_size", "scoring_func", "n_group", "topk_group",
            "routed_scaling_factor")
DEEPSEEK_ROUTING_KEYS = ("scoring_func", "n_group", "topk_group", "routed_scaling_factor")


def softmax_routing(source: str) -> list[Fact]:
    """The routing keys of an architecture whose router softmaxes (DeepSeek-V3's at their defaults)."""
    defaults = schema.ModelConfig()
    return [Fact(key, getattr(defaults, key), source) for key in DEEPSEEK_ROUTING_KEYS]


def _moe_facts(hf: dict, row: Architecture) -> tuple[list[Fact], list[str]]:
    """The mixture-of-experts facts of a config.json (a dense architecture
    states that it has no experts)."""
    if not row.moe:
        return dense_facts(f"architectures={shown([row.name])} (dense)"), []
    facts, problems = [], []
    experts_key = next((k for k in ("num_local_experts", "n_routed_experts") if k in hf), "num_experts")
    for hf_key, key in [(experts_key, "num_experts"), ("num_experts_per_tok", "num_experts_per_tok")]:
        if hf.get(hf_key):
            facts.append(Fact(key, hf[hf_key], f"{hf_key}={hf[hf_key]}"))
        else:
            problems.append(f"config.json has no {hf_key}")
    if row.llama4:
        more, more_problems = _llama4_experts(hf)
        return facts + more + softmax_routing("Llama 4 (its own router)"), problems + more_problems
    if row.routing == "deepseek":
        more, more_problems = _deepseek_experts(hf)
        return facts + more, problems + more_problems
    if row.experts == "every":  # Mixtral: experts of intermediate_size, weights always renormalized
        if "intermediate_size" in hf:
            facts.append(Fact("moe_intermediate_size", hf["intermediate_size"],
                              f"intermediate_size={hf['intermediate_size']} (Mixtral's experts)"))
        return facts + [Fact("norm_topk_prob", True, "Mixtral (top-k weights renormalized)"),
                        Fact("decoder_sparse_step", 1, "Mixtral (every layer sparse)"),
                        Fact("mlp_only_layers", [], "Mixtral (every layer sparse)"),
                        Fact("shared_expert_intermediate_size", 0, "Mixtral (no shared expert)"),
                        *softmax_routing("Mixtral (softmax routing)")], problems
    if hf.get("moe_intermediate_size"):
        facts.append(Fact("moe_intermediate_size", hf["moe_intermediate_size"],
                          f"moe_intermediate_size={hf['moe_intermediate_size']}"))
    else:
        problems.append("config.json has no moe_intermediate_size")
    norm = bool(hf.get("norm_topk_prob", False))  # transformers' Qwen3-MoE default
    step = int(hf.get("decoder_sparse_step", 1))
    dense = [int(i) for i in hf.get("mlp_only_layers") or []]
    if step < 1:
        problems.append(f"decoder_sparse_step={step} must be at least 1")
    facts += [Fact("norm_topk_prob", norm, f"norm_topk_prob={shown(norm)}"),
              Fact("decoder_sparse_step", step, f"decoder_sparse_step={step}"),
              Fact("mlp_only_layers", dense, f"mlp_only_layers={shown(dense)}"),
              _shared_expert(hf, row),
              *softmax_routing(f"architectures={shown([row.name])} (softmax routing)")]
    return facts, problems


def _shared_expert(hf: dict, row: Architecture) -> Fact:
    """The width of the gated shared expert (Qwen2-MoE's, as transformers defaults it), or none."""
    if not row.shared_expert_gate:
        return Fact("shared_expert_intermediate_size", 0, f"architectures={shown([row.name])} (no shared expert)")
    width = int(hf.get("shared_expert_intermediate_size", 5632))
    return Fact("shared_expert_intermediate_size", width, f"shared_expert_intermediate_size={width}")


def _llama4_experts(hf: dict) -> tuple[list[Fact], list[str]]:
    """Llama 4's experts and its shared expert, intermediate_size wide; its sparse layers (moe_layers, else
    every interleave_moe_layer_step-th); sigmoid scores, never renormalized."""
    n, step = int(hf.get("num_hidden_layers", 0)), int(hf.get("interleave_moe_layer_step", 1))
    if step < 1:
        return [], [f"interleave_moe_layer_step={step} must be at least 1"]
    pattern = [i for i in range(n) if (i + 1) % step == 0]
    named = [int(i) for i in hf["moe_layers"]] if hf.get("moe_layers") is not None else pattern
    if named != pattern:  # every layer a candidate, the others dense
        step, how = 1, f"moe_layers={shown(named)}"
    else:
        how = f"interleave_moe_layer_step={step}"
    width = hf.get("intermediate_size")
    if not width:
        return [], ["config.json has no intermediate_size (Llama 4's experts)"]
    return [Fact("moe_intermediate_size", width, f"intermediate_size={width} (Llama 4's experts)"),
            Fact("shared_expert_intermediate_size", width, f"intermediate_size={width} (its shared expert)"),
            Fact("norm_topk_prob", False, "Llama 4 (sigmoid scores, not renormalized)"),
            Fact("decoder_sparse_step", step, how),
            Fact("mlp_only_layers", [i for i in range(n) if (i + 1) % step == 0 and i not in named], how)], []


def _deepseek_experts(hf: dict) -> tuple[list[Fact], list[str]]:
    """DeepSeek-V3's routing as GLM-4.5 configures it: sigmoid scores, the bias-corrected choice within the
    topk_group best of n_group groups, routed_scaling_factor, n_shared_experts experts' width of shared expert,
    the first first_k_dense_replace layers dense."""
    problems = []
    width = hf.get("moe_intermediate_size")
    if not width:
        return [], ["config.json has no moe_intermediate_size"]
    n, first_dense = int(hf.get("num_hidden_layers", 0)), int(hf.get("first_k_dense_replace", 1))
    if not 0 <= first_dense <= n:
        problems.append(f"first_k_dense_replace={first_dense} is outside 0..{n}")
    shared = int(hf.get("n_shared_experts") or 0) * width
    return [Fact("moe_intermediate_size", width, f"moe_intermediate_size={width}"),
            Fact("norm_topk_prob", bool(hf.get("norm_topk_prob", True)), f"norm_topk_prob={hf.get('norm_topk_prob', True)}"),
            Fact("decoder_sparse_step", 1, "every layer past the dense ones sparse"),
            Fact("mlp_only_layers", list(range(first_dense)), f"first_k_dense_replace={first_dense}"),
            Fact("shared_expert_intermediate_size", shared, f"n_shared_experts={hf.get('n_shared_experts')} of "
                                                            f"{width}"),
            Fact("scoring_func", "sigmoid", "DeepSeek-V3's routing (sigmoid scores)"),
            Fact("n_group", int(hf.get("n_group", 1)), f"n_group={hf.get('n_group', 1)}"),
            Fact("topk_group", int(hf.get("topk_group", 1)), f"topk_group={hf.get('topk_group', 1)}"),
            Fact("routed_scaling_factor", float(hf.get("routed_scaling_factor", 1.0)),
                 f"routed_scaling_factor={hf.get('routed_scaling_factor', 1.0)}")], problems
