"""Cross-field rules of a composed config, all in one place.

``validate`` returns every problem at once; each message names the keys
involved and the fix. Per-key type and enum checks happen earlier, at
compose time, through the typed schema.
"""

from __future__ import annotations


from appliance.config.architectures import ARCHITECTURES, support
from appliance.config.execution import choose_dtype
from appliance.config.kv_connectors import kv_transfer_problems
from appliance.config.kv_groups import kv_group_problems
from appliance.config.memory import GIB, blocks_per_request, device_memory, max_model_len
from appliance.config.quantization import FP8_HARDWARE, method_of, quantization_problems
from appliance.config.hf_facts import LONGROPE_KEYS, MOE_KEYS, YARN_KEYS
from appliance.config.sizes import rotary_dim
from appliance.config.schema import ApplianceConfig, EplbConfig, ModelConfig, RopeScaling, SchedulerConfig
from appliance.config.validate_layers import layer_type_problems, llama4_problems, routing_problems
from appliance.config.validate_serving import (chat_format_problems, chat_template_problems, kv_events_problems,
                                                router_problems, tracing_problems)
from appliance.kernels.registry import BACKENDS

DEFAULTS = ApplianceConfig()


def _architecture_problems(cfg: ApplianceConfig) -> list[str]:
    """model.architecture must be one the registry serves (config/architectures.py), and the parallelism
    asked for one its row supports."""
    m, par = cfg.model, cfg.parallel
    row, why = support(m.architecture, f"model.architecture={m.architecture}")
    if row is None:
        return [why]
    problems = []
    multipliers = {"embedding_multiplier": (m.embedding_multiplier, 1.0), "residual_multiplier":
                   (m.residual_multiplier, 1.0), "attention_multiplier": (m.attention_multiplier, None),
                   "logits_scaling": (m.logits_scaling, 1.0)}
    if row.multipliers and m.attention_multiplier is None:
        problems.append(f"{m.architecture} scales attention by its checkpoint's attention_multiplier; set "
                        f"model.attention_multiplier")
    if row.multipliers and not m.logits_scaling > 0:
        problems.append(f"model.logits_scaling={m.logits_scaling} must be positive (the logits are divided by it)")
    elif not row.multipliers:
        problems += [f"model.{k}={v} is Granite's (GraniteForCausalLM); {m.architecture} has none: leave it at "
                     f"{default}" for k, (v, default) in multipliers.items() if v != default]
    gemma_keys = ("query_pre_attn_scalar", "rope_local_theta", "attn_logit_softcapping", "final_logit_softcapping")
    if not row.gemma:
        problems += [f"model.{k}={getattr(m, k)} is Gemma's (Gemma2ForCausalLM, Gemma3ForCausalLM); {m.architecture} "
                     f"has none: leave it null" for k in gemma_keys if getattr(m, k) is not None]
    else:
        problems += [f"model.{k}={getattr(m, k)} must be positive" for k in gemma_keys
                     if getattr(m, k) is not None and not getattr(m, k) > 0]
    swiglu = {"swiglu_limit": m.swiglu_limit, "swiglu_alpha": m.swiglu_alpha}
    if row.gpt_oss:
        problems += [f"{m.architecture}'s experts clamp their SwiGLU: set model.{k} (positive)"
                     for k, v in swiglu.items() if v is None or not v > 0]
        if method_of(cfg).scales != "none":  # float weights only: unquantized, or its MXFP4 dequantized at load
            problems.append(f"quantization={cfg.quantization.method} on {m.architecture} is not built yet (its "
                            f"experts run in the model dtype: a checkpoint's bf16, or its MXFP4 dequantized)")
        if not m.norm_topk_prob:
            problems.append(f"model.norm_topk_prob=false: {m.architecture} softmaxes each token's top-k router "
                            f"logits (its weights always sum to one)")
    else:
        problems += [f"model.{k}={v} is gpt-oss's (GptOssForCausalLM); {m.architecture} has none: leave it null"
                     for k, v in swiglu.items() if v is not None]
    for key, size, able in [("tensor_parallel_size", par.tensor_parallel_size, row.tensor_parallel),
                            ("pipeline_parallel_size", par.pipeline_parallel_size, row.pipeline_parallel)]:
        if size > 1 and not able:
            problems.append(f"parallel.{key}={size}: {m.architecture} has no {key.split('_')[0]}-parallel "
                            f"implementation yet; use parallel.{key}=1")
    return problems


def _moe_problems(cfg: ApplianceConfig) -> list[str]:
    """Mixture-of-experts keys, expert parallelism and EPLB."""
    m, par = cfg.model, cfg.parallel
    eplb = par.eplb
    problems = []
    row = ARCHITECTURES.get(m.architecture)  # an unserved name is _architecture_problems'
    moe_arch = row is not None and row.moe
    if m.num_experts <= 0:
        if m.num_experts < 0:
            problems.append(f"model.num_experts={m.num_experts} must not be negative (0: a dense model)")
        if moe_arch:
            problems.append(f"model.architecture={m.architecture} is a mixture of experts and needs model.num_experts")
        defaults = ModelConfig()
        for key in MOE_KEYS[1:]:
            if getattr(m, key) != getattr(defaults, key):
                problems.append(f"model.{key}={getattr(m, key)} has no effect on a dense model (model.num_experts=0)")
        if par.enable_expert_parallel:
            problems.append(f"parallel.enable_expert_parallel=true needs a mixture-of-experts model; "
                            f"model={m.name} is dense")
    else:
        if row is not None and not moe_arch:
            moe_names = ", ".join(a.name for a in ARCHITECTURES.values() if a.moe)
            problems.append(f"model.num_experts={m.num_experts} on model.architecture={m.architecture}, which is "
                            f"dense; mixture-of-experts architectures: {moe_names}")
        if not 1 <= m.num_experts_per_tok <= m.num_experts:
            problems.append(f"model.num_experts_per_tok={m.num_experts_per_tok} must be in 1..{m.num_experts} "
                            f"(model.num_experts)")
        if m.moe_intermediate_size < 1:
            problems.append(f"model.moe_intermediate_size={m.moe_intermediate_size} must be positive")
        if row is not None and row.experts == "every" and (m.intermediate_size != m.moe_intermediate_size
                                                            or m.decoder_sparse_step != 1 or list(m.mlp_only_layers)):
            problems.append(f"model.architecture={m.architecture} has only sparse layers whose experts are "
                            f"intermediate_size wide: model.moe_intermediate_size ({m.moe_intermediate_size}) must "
                            f"equal model.intermediate_size ({m.intermediate_size}), with "
                            f"model.decoder_sparse_step=1 and model.mlp_only_layers=[]")
        if m.decoder_sparse_step < 1:
            problems.append(f"model.decoder_sparse_step={m.decoder_sparse_step} must be at least 1")
        outside = [i for i in m.mlp_only_layers if not 0 <= i < m.num_layers]
        if outside:
            problems.append(f"model.mlp_only_layers={list(m.mlp_only_layers)}: layers {outside} are outside "
                            f"0..{m.num_layers - 1}")
    if par.enable_expert_parallel and row is not None and row.moe and not row.expert_parallel:
        problems.append(f"parallel.enable_expert_parallel=true: {m.architecture} has no expert-parallel "
                        f"implementation yet")
    elif par.enable_expert_parallel and row is not None and row.gpt_oss and (par.data_parallel_size > 1
                                                                            or eplb.enabled):
        problems.append(f"parallel.enable_expert_parallel=true on {m.architecture} splits its experts over one "
                        f"engine core's ranks; across data-parallel engine cores (parallel.data_parallel_size="
                        f"{par.data_parallel_size}) or with parallel.eplb.enabled=true is not built yet")
    if par.enable_expert_parallel and m.num_experts > 0:
        ep = par.tensor_parallel_size * par.data_parallel_size
        slots = m.num_experts + eplb.num_redundant_experts
        if ep < 2:
            problems.append("parallel.enable_expert_parallel=true with tp x dp = 1: one rank holds every expert; "
                            "use tensor_parallel_size or data_parallel_size above 1")
        elif slots % ep:
            problems.append(f"expert parallelism over tp x dp = {ep} ranks: {m.num_experts} experts"
                            f"{f' + {eplb.num_redundant_experts} redundant' if eplb.num_redundant_experts else ''} "
                            f"do not split evenly; choose a layout whose rank count divides {slots}")
    if eplb.enabled and not par.enable_expert_parallel:
        problems.append("parallel.eplb.enabled=true balances experts over expert-parallel ranks; set "
                        "parallel.enable_expert_parallel=true")
    if not eplb.enabled:
        eplb_defaults = EplbConfig()
        for key in ("window_size", "step_interval", "num_redundant_experts"):
            if getattr(eplb, key) != getattr(eplb_defaults, key):
                problems.append(f"parallel.eplb.{key}={getattr(eplb, key)} has no effect with "
                                f"parallel.eplb.enabled=false")
    for key in ("window_size", "step_interval"):
        if getattr(eplb, key) < 1:
            problems.append(f"parallel.eplb.{key}={getattr(eplb, key)} must be at least 1")
    if eplb.num_redundant_experts < 0:
        problems.append(f"parallel.eplb.num_redundant_experts={eplb.num_redundant_experts} must not be negative")
    return problems


def _range_problems(cfg: ApplianceConfig) -> list[str]:
    """Numeric ranges, and the keys that need another to mean something."""
    cache, s, par = cfg.cache, cfg.scheduler, cfg.parallel
    problems: list[str] = []
    for key, value, low in [
        ("scheduler.max_num_batched_tokens", s.max_num_batched_tokens, 1),
        ("scheduler.max_num_seqs", s.max_num_seqs, 1),
        ("scheduler.max_num_partial_prefills", s.max_num_partial_prefills, 1),
        ("scheduler.max_long_partial_prefills", s.max_long_partial_prefills, 1),
        ("cache.block_size", cache.block_size, 1),
        ("parallel.tensor_parallel_size", par.tensor_parallel_size, 1),
        ("parallel.pipeline_parallel_size", par.pipeline_parallel_size, 1),
        ("parallel.data_parallel_size", par.data_parallel_size, 1),
        ("server.max_queue_len", cfg.server.max_queue_len, 1),
        ("server.max_connections", cfg.server.max_connections, 1),
        ("structured_output.num_threads", cfg.structured_output.num_threads, 1),
        ("structured_output.cache_size_mib", cfg.structured_output.cache_size_mib, 1),
        ("structured_output.max_schema_bytes", cfg.structured_output.max_schema_bytes, 1),
        ("structured_output.max_schema_depth", cfg.structured_output.max_schema_depth, 1),
        # below it a compile's threads and first allocations fail, so nothing would compile
        ("structured_output.compile_memory_mib", cfg.structured_output.compile_memory_mib, 64),
        ("server.tokenizer_threads", cfg.server.tokenizer_threads, 1),
        ("server.max_core_restarts", cfg.server.max_core_restarts, 0),
        ("server.responses_store_max", cfg.server.responses_store_max, 0),
        ("server.responses_store_mib", cfg.server.responses_store_mib, 0),
    ]:
        if value < low:
            problems.append(f"{key}={value} must be at least {low}")
    if cfg.structured_output.backend != "xgrammar":
        problems.append(f"structured_output.backend={cfg.structured_output.backend} is not built yet; "
                        f"use structured_output.backend=xgrammar")
    if not cfg.structured_output.compile_timeout_s > 0:
        problems.append(f"structured_output.compile_timeout_s={cfg.structured_output.compile_timeout_s} must be "
                        f"positive")
    ws = cfg.structured_output.max_json_whitespace
    if ws is not None and ws < 1:
        problems.append(f"structured_output.max_json_whitespace={ws} must be at least 1 (or null: unbounded)")
    for key, gib in [("cache.swap_space_gib", cache.swap_space_gib), ("cache.cpu_offload_gib", cache.cpu_offload_gib)]:
        if gib < 0:
            problems.append(f"{key}={gib} must not be negative")
    if not 0.0 < cache.memory_utilization <= 1.0:
        problems.append(f"cache.memory_utilization={cache.memory_utilization} must be in (0, 1]")
    objective = s.target_itl_ms is not None or s.max_itl_ratio is not None
    if s.target_itl_ms is not None and not s.target_itl_ms > 0:
        problems.append(f"scheduler.target_itl_ms={s.target_itl_ms} must be positive")
    if objective and not s.enable_chunked_prefill:
        key = "target_itl_ms" if s.target_itl_ms is not None else "max_itl_ratio"
        problems.append(f"scheduler.{key} needs scheduler.enable_chunked_prefill=true (a prompt must be "
                        f"able to prefill in chunks of any budget)")
    if not 0.0 <= s.min_prefill_share < 1.0:
        problems.append(f"scheduler.min_prefill_share={s.min_prefill_share} must be in [0, 1) (a share of a step's "
                        f"time; the decodes keep the rest)")
    elif not objective and s.min_prefill_share != SchedulerConfig.min_prefill_share:
        problems.append(f"scheduler.min_prefill_share={s.min_prefill_share} has an effect only with an objective, "
                        f"scheduler.target_itl_ms or scheduler.max_itl_ratio (without one every step may use "
                        f"scheduler.max_num_batched_tokens)")
    elif s.max_itl_ratio is not None and not s.max_itl_ratio * (1.0 - s.min_prefill_share) >= 1.0:
        problems.append(f"scheduler.max_itl_ratio={s.max_itl_ratio} would leave a waiting prompt less than "
                        f"scheduler.min_prefill_share={s.min_prefill_share} of a step: it must be at least "
                        f"1 / (1 - min_prefill_share) = {1.0 / (1.0 - s.min_prefill_share):g}")
    if not 0 < cfg.server.port < 65536:
        problems.append(f"server.port={cfg.server.port} must be in 1..65535")
    for key in ("request_timeout_s", "shutdown_timeout_s", "header_timeout_s", "body_timeout_s", "keep_alive_timeout_s",
                "core_restart_window_s", "core_start_timeout_s", "core_heartbeat_timeout_s"):
        if not getattr(cfg.server, key) > 0:
            problems.append(f"server.{key}={getattr(cfg.server, key)} must be positive")
    if cfg.server.max_prompt_chars is not None and cfg.server.max_prompt_chars < 1:
        problems.append(f"server.max_prompt_chars={cfg.server.max_prompt_chars} must be at least 1 (null: derived)")
    if cfg.server.core_restart_backoff_s < 0:
        problems.append(f"server.core_restart_backoff_s={cfg.server.core_restart_backoff_s} must not be negative")
    problems += tracing_problems(cfg.server.otlp_traces_endpoint)
    return problems


def _dtype_problems(cfg: ApplianceConfig, dtype: str) -> list[str]:
    """The compute and KV dtypes, and the quantization method, against the hardware."""
    hw, cache = cfg.hardware, cfg.cache
    problems: list[str] = []
    if dtype not in hw.supported_dtypes:
        problems.append(
            f"model.dtype={dtype} is not supported by hardware={hw.name} (supported: {list(hw.supported_dtypes)}); "
            f"set model.dtype to one of those"
        )
    problems += quantization_problems(cfg)
    kv = cache.kv_cache_dtype
    if kv.startswith("fp8") and not hw.fp8 and hw.device_kind != "cpu":  # CPU kernels convert in software
        problems.append(
            f"cache.kv_cache_dtype={kv} needs native fp8 and hardware={hw.name} has none; "
            f"use cache.kv_cache_dtype=auto, or a profile on {FP8_HARDWARE}"
        )
    if kv == "fp8_e5m2" and hw.device_kind == "rocm":
        problems.append("cache.kv_cache_dtype=fp8_e5m2 is not available on ROCm; use fp8_e4m3")
    return problems


def _block_size_problems(cfg: ApplianceConfig) -> list[str]:
    """The block size: the hardware's limits and at least one backend of its list."""
    hw, cache = cfg.hardware, cfg.cache
    problems: list[str] = []
    bs = cache.block_size
    if not hw.min_block_size <= bs <= hw.max_block_size:
        problems.append(
            f"cache.block_size={bs} is outside hardware={hw.name}'s range "
            f"[{hw.min_block_size}, {hw.max_block_size}] (hardware.min_block_size, hardware.max_block_size)"
        )
    known = [b for b in hw.attention_backends if b in BACKENDS]
    for b in hw.attention_backends:
        if b not in BACKENDS:
            problems.append(f"hardware.attention_backends names unknown backend {b!r}; known: {sorted(BACKENDS)}")
    if known and not any(BACKENDS[b].supports_block_size(bs) for b in known):
        problems.append(
            f"cache.block_size={bs} is supported by none of hardware={hw.name}'s backends {known}; "
            f"use a multiple of {min(BACKENDS[b].block_size_multiple for b in known)} such as 16"
        )
    if cfg.attention.backend != "auto" and cfg.attention.backend not in BACKENDS:
        problems.append(f"attention.backend={cfg.attention.backend} is unknown; use auto or one of {sorted(BACKENDS)}")
    return problems


def _rope_scaling_problems(m: ModelConfig) -> list[str]:
    """Keys of one rope scaling set under another (YaRN's, LongRoPE's factor lists), and LongRoPE without its
    lists or with lists that do not name every rotated pair."""
    rs, rs_defaults = m.rope_scaling, RopeScaling()
    theirs = {"yarn": set(YARN_KEYS), "longrope": {*LONGROPE_KEYS, "attention_factor"}}
    names = {"yarn": "YaRN", "longrope": "LongRoPE"}
    problems = []
    for k in sorted(set().union(*theirs.values())):
        owners = [owner for owner, keys in theirs.items() if k in keys]
        if rs.type not in owners and getattr(rs, k) != getattr(rs_defaults, k):
            problems.append(f"model.rope_scaling.{k}={getattr(rs, k)} is {' or '.join(names[o] for o in owners)}'s; "
                            f"model.rope_scaling.type={rs.type}: set model.rope_scaling.type={owners[0]} or leave "
                            f"it at {getattr(rs_defaults, k)}")
    if rs.type == "longrope":
        pairs = rotary_dim(m) // 2
        for k in LONGROPE_KEYS:
            v = getattr(rs, k)
            if v is None or len(v) != pairs or not all(x > 0 for x in v):
                problems.append(f"model.rope_scaling.{k} must be {pairs} positive divisors (one per pair of the "
                                f"{2 * pairs} rotated dimensions) with model.rope_scaling.type=longrope; it is {v}")
    return problems


def _rotary_problems(m: ModelConfig) -> list[str]:
    """A partial rotary factor: on an architecture that turns part of each head, an even number of channels."""
    f = m.partial_rotary_factor
    if f == 1.0:
        return []
    row = ARCHITECTURES.get(m.architecture)
    if row is not None and not row.partial_rotary:
        return [f"model.partial_rotary_factor={f}: {m.architecture} turns whole heads (only "
                f"{', '.join(a.name for a in ARCHITECTURES.values() if a.partial_rotary)} take part of each)"]
    if not 0 < f <= 1 or rotary_dim(m) < 2 or rotary_dim(m) % 2:
        return [f"model.partial_rotary_factor={f} must turn an even number of each head's {m.head_dim} channels "
                f"(between 0 and 1; it turns {rotary_dim(m)})"]
    return []


def _length_problems(cfg: ApplianceConfig) -> list[str]:
    """Lengths and token budgets."""
    m, s = cfg.model, cfg.scheduler
    problems: list[str] = []
    mml = max_model_len(cfg)
    if mml > m.max_position_embeddings:
        problems.append(
            f"model.max_model_len={mml} exceeds {m.name}'s max_position_embeddings={m.max_position_embeddings}; "
            f"lower model.max_model_len"
        )
    problems += layer_type_problems(m) + llama4_problems(cfg, mml)
    problems += _rope_scaling_problems(m) + _rotary_problems(m)
    if m.sliding_window is not None and m.sliding_window < 1:
        problems.append(f"model.sliding_window={m.sliding_window} must be at least 1 (or null: none)")
    if not s.enable_chunked_prefill and s.max_num_batched_tokens < mml:
        problems.append(
            f"scheduler.max_num_batched_tokens={s.max_num_batched_tokens} is below max_model_len={mml} with "
            f"chunked prefill off, so a long prompt could never be scheduled; enable scheduler.enable_chunked_prefill, "
            f"raise max_num_batched_tokens, or lower model.max_model_len"
        )
    if s.max_long_partial_prefills > s.max_num_partial_prefills:
        problems.append(
            f"scheduler.max_long_partial_prefills={s.max_long_partial_prefills} exceeds "
            f"scheduler.max_num_partial_prefills={s.max_num_partial_prefills}"
        )
    if s.long_prefill_token_threshold < 0:
        problems.append("scheduler.long_prefill_token_threshold must be 0 (no cap) or positive")
    return problems


def _parallel_problems(cfg: ApplianceConfig) -> list[str]:
    """Parallelism: the devices, the executor, and how the model splits over the ranks."""
    m, hw, par = cfg.model, cfg.hardware, cfg.parallel
    problems: list[str] = []
    world = par.tensor_parallel_size * par.pipeline_parallel_size * par.data_parallel_size
    if world > hw.num_devices:
        problems.append(
            f"parallel tp x pp x dp = {par.tensor_parallel_size} x {par.pipeline_parallel_size} x "
            f"{par.data_parallel_size} = {world} devices, but hardware={hw.name} has {hw.num_devices}; "
            f"choose a smaller parallel option"
        )
    if m.num_heads % par.tensor_parallel_size:
        problems.append(
            f"model.num_heads={m.num_heads} is not divisible by parallel.tensor_parallel_size={par.tensor_parallel_size}"
        )
    if par.pipeline_parallel_size > m.num_layers:
        problems.append(f"parallel.pipeline_parallel_size={par.pipeline_parallel_size} exceeds model.num_layers={m.num_layers}")
    per_engine = par.tensor_parallel_size * par.pipeline_parallel_size
    if par.executor == "uni" and per_engine > 1:
        problems.append(f"parallel.executor=uni runs one rank, and an engine core of this layout spans tp x pp = "
                        f"{per_engine}; use parallel.executor=mp (or auto)")
    if par.executor == "ray" and par.data_parallel_size > 1 and par.ray_address is None:
        problems.append(f"parallel.executor=ray with data_parallel_size={par.data_parallel_size} needs "
                        f"parallel.ray_address (a cluster the engine cores share; with null each would start its own "
                        f"local Ray instance)")
    if par.ray_address is not None and par.executor != "ray":
        problems.append(f"parallel.ray_address={par.ray_address} has no effect with parallel.executor="
                        f"{par.executor}; set parallel.executor=ray or leave it null")
    if par.cpu_collectives != "shm" and hw.device_kind != "cpu":
        problems.append(f"parallel.cpu_collectives={par.cpu_collectives} has no effect on hardware={hw.name} "
                        f"({hw.device_kind} ranks use {'RCCL' if hw.device_kind == 'rocm' else 'NCCL'}); leave it shm")
    parts = par.pp_layer_partition
    if parts is not None:
        if len(parts) != par.pipeline_parallel_size or sum(parts) != m.num_layers or min(parts, default=0) < 1:
            problems.append(f"parallel.pp_layer_partition={list(parts)} must give each of the "
                            f"{par.pipeline_parallel_size} pipeline stages at least one layer, "
                            f"{m.num_layers} (model.num_layers) in all")
    if not par.step_timeout_s > 0:
        problems.append(f"parallel.step_timeout_s={par.step_timeout_s} must be positive")
    kv_heads, tp = m.num_kv_heads, par.tensor_parallel_size
    if kv_heads % tp and tp % kv_heads:
        problems.append(f"model.num_kv_heads={kv_heads} and parallel.tensor_parallel_size={tp}: one must divide the "
                        f"other (KV heads split across ranks, or each replicated on tp / kv ranks)")
    if m.intermediate_size % tp:
        problems.append(f"model.intermediate_size={m.intermediate_size} is not divisible by "
                        f"parallel.tensor_parallel_size={tp}")
    if m.num_experts > 0 and not par.enable_expert_parallel and m.moe_intermediate_size % tp:
        problems.append(f"model.moe_intermediate_size={m.moe_intermediate_size} is not divisible by "
                        f"parallel.tensor_parallel_size={tp} (each rank holds a slice of every expert; or set "
                        f"parallel.enable_expert_parallel=true to split whole experts)")
    return problems


def _speculative_problems(cfg: ApplianceConfig) -> list[str]:
    """Speculative decoding."""
    m, hw, spec = cfg.model, cfg.hardware, cfg.speculative
    problems: list[str] = []
    if spec.method == "off":
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
                    "draft_model", "draft_dtype"):
            value, default = getattr(spec, key), getattr(DEFAULTS.speculative, key)
            if value != default:
                problems.append(f"speculative.{key}={value} has no effect with speculative=off; "
                                f"choose a speculative method or leave it at {'null' if default is None else default}")
    if spec.method != "off":
        if spec.num_speculative_tokens < 1:
            problems.append(f"speculative.method={spec.method} needs speculative.num_speculative_tokens >= 1")
        if spec.method == "ngram":
            lo, hi = spec.prompt_lookup_min, spec.prompt_lookup_max
            if lo is None or hi is None or not 1 <= lo <= hi:
                problems.append(f"speculative.prompt_lookup_min={lo} must be between 1 and prompt_lookup_max={hi}")
            for key in ("draft_model", "draft_dtype"):
                if getattr(spec, key) != getattr(DEFAULTS.speculative, key):
                    problems.append(f"speculative.{key}={getattr(spec, key)} has no effect with speculative=ngram; "
                                    f"use speculative=draft_model")
        else:
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(spec, key) is not None:
                    problems.append(f"speculative.{key}={getattr(spec, key)} has no effect with "
                                    f"speculative=draft_model (n-gram lookup only)")
            from appliance.config.draft import draft_problems

            problems += draft_problems(cfg, m.max_model_len or m.max_position_embeddings)
            if spec.draft_dtype != "auto" and spec.draft_dtype not in hw.supported_dtypes:
                problems.append(f"speculative.draft_dtype={spec.draft_dtype} is not supported by hardware={hw.name} "
                                f"(supported: {list(hw.supported_dtypes)})")
        if spec.disable_by_batch_size is not None and spec.disable_by_batch_size < 1:
            problems.append(f"speculative.disable_by_batch_size={spec.disable_by_batch_size} must be at least 1 "
                            f"(or null: speculate at every batch size)")
    return problems


def _memory_problems(cfg: ApplianceConfig, dtype: str) -> list[str]:
    """Memory (the plan's account of a device): weights must fit, and the pool must hold one full-length request."""
    hw, cache, par = cfg.hardware, cfg.cache, cfg.parallel
    problems: list[str] = []
    if dtype in ("float32", "bfloat16", "float16"):
        mem = device_memory(cfg, dtype)
        if mem.weights + mem.activations > mem.usable:
            ranks = par.tensor_parallel_size * par.pipeline_parallel_size * par.data_parallel_size
            shared = f", shared by {ranks} ranks" if hw.device_kind == "cpu" and ranks > 1 else ""
            problems.append(
                f"weights ({mem.weights / GIB:.1f} GiB per device) and activations do not fit in "
                f"{mem.usable / GIB:.1f} GiB ({hw.memory_gib} GiB x cache.memory_utilization={cache.memory_utilization}"
                f"{shared}); use more tensor parallelism, a quantization, or bigger hardware"
            )
        else:
            mml, bs = max_model_len(cfg), cache.block_size
            need = blocks_per_request(cfg)
            if mem.num_kv_blocks < need:
                problems.append(
                    f"the KV cache holds {mem.num_kv_blocks} blocks ({mem.num_kv_blocks * bs} tokens) but one "
                    f"max_model_len={mml} request needs {need}; lower model.max_model_len or give the cache more memory"
                )
    return problems


def validate(cfg: ApplianceConfig) -> list[str]:
    dtype = choose_dtype(cfg)[0]
    problems = [*_range_problems(cfg), *_dtype_problems(cfg, dtype), *_block_size_problems(cfg),
                *_length_problems(cfg), *_parallel_problems(cfg)]
    problems += _architecture_problems(cfg)
    problems += _moe_problems(cfg) + routing_problems(cfg)
    problems += kv_events_problems(cfg)
    problems += kv_group_problems(cfg, max_model_len(cfg))
    problems += kv_transfer_problems(cfg)
    problems += router_problems(cfg)
    problems += chat_template_problems(cfg.model.chat_template)
    problems += chat_format_problems(cfg)
    problems += _speculative_problems(cfg)
    if not problems:  # the memory account needs a config that holds together
        problems += _memory_problems(cfg, dtype)
    return problems
