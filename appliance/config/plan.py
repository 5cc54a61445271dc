"""What a resolved deployment would run, computed without a GPU.

All figures are per device (one tensor/pipeline shard; a CPU host's rank)
unless named otherwise. Memory model, in the order vLLM's worker sizes the
KV pool:

    usable      = memory_gib * memory_utilization      (or cache.kv_cache_memory_gib)
                  (a CPU host's ranks share it: divided by tp x pp x dp)
    kv_bytes    = usable - weight_bytes - activation_bytes
    num_blocks  = kv_bytes // (block_size * kv_bytes_per_token)

``activation_bytes`` is an estimate of the forward pass's peak for one
``max_num_batched_tokens`` step; vLLM measures it with a profiling run and
the model runner does the same at start-up where it can.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from appliance.config.architectures import describe
from appliance.config.checkpoint import gguf_file
from appliance.config.gguf_header import gguf_embedding_in_head, gguf_head_bits, gguf_header
from appliance.config.execution import Execution, kv_dtype, resolve_execution
from appliance.config.kv_connectors import describe_kv_transfer
from appliance.config.quantization import fp8_gemm, method_of
from appliance.config.schema import ApplianceConfig, ModelConfig
from appliance.config.sizes import parameter_counts, pipeline_partition, sparse_layers
from appliance.config.unbuilt import not_built
from appliance.kernels.registry import BACKENDS

GIB = 1024**3

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_DTYPE_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1}


def weight_bytes(cfg: ApplianceConfig, dtype: str) -> int:
    """Bytes of all weights (before sharding).

    Quantized methods store the decoder's linear layers at
    ``quantization.weight_bits`` plus their group parameters (gguf's
    weight_bits already counts them: the file's own widths as loaded, see
    ``checkpoint.gguf_projection_bits``); embeddings, the LM head and norms
    stay in the compute dtype, as vLLM keeps them. A draft model's weights
    (unquantized, in the compute dtype) are added.
    """
    return _target_weight_bytes(cfg, dtype) + draft_weight_bytes(cfg, dtype)


def draft_weight_bytes(cfg: ApplianceConfig, dtype: str) -> int:
    """A draft model's weights (0 without one): every rank that samples (all
    of them, or the last pipeline stage's) holds the whole draft."""
    draft = draft_model(cfg)
    return parameter_counts(draft)["total"] * DTYPE_BYTES[draft_dtype(cfg, dtype)] if draft is not None else 0


def _target_weight_bytes(cfg: ApplianceConfig, dtype: str) -> int:
    counts = parameter_counts(cfg.model)
    full = DTYPE_BYTES[dtype]
    q, row = cfg.quantization, method_of(cfg)
    if row.scales == "none":
        return counts["total"] * full
    bits = q.weight_bits
    if q.group_size > 0 and row.scales != "blocks":  # a GGUF file's weight_bits count its blocks' parameters
        # fp8: an fp16 scale; int4_wo: an fp16 scale and min; AWQ/GPTQ: an fp32 scale and -scale x zero
        bits += row.group_param_bits / q.group_size
    linear = int(counts["linear"] * bits / 8)
    if row.scales == "channel":  # per-output-channel fp32 scales
        linear += 4 * output_channels(cfg.model)
    head = lm_head_bytes(cfg)
    if head is not None and embedding_read_from_head(cfg):  # one table: the head's blocks, looked up too
        return linear + head + counts["other"] * full
    if head is not None:  # a quantized head (a tied model keeps its embedding for lookups)
        return linear + head + (counts["embedding"] + counts["other"]) * full
    return linear + (counts["embedding"] + counts["lm_head"] + counts["other"]) * full


def int8_gemm(cfg: ApplianceConfig, backend: Optional[str]) -> bool:
    """Whether the batched GEMMs (prefill) multiply int8 rows: W8A8 does everywhere, and ``backend`` does
    for the weight formats it lists (cpu_native's 4- and 8-bit ones), on hardware with int8 dot products
    (``hardware.peak_tflops.int8`` > 0)."""
    method = cfg.quantization.method
    caps = BACKENDS.get(backend) if backend else None
    return cfg.hardware.peak_tflops.int8 > 0 and (
        method_of(cfg).activation_dtype == "int8" or (caps is not None and method in caps.int8_gemm_quantizations))


def lm_head_bytes(cfg: ApplianceConfig) -> Optional[int]:
    """Bytes of the LM head as loaded, parameters included, where the
    quantization keeps it quantized: int8 with an fp32 scale per row
    (int8_wo, w8a8_int8, int4_wo), or a GGUF file's head blocks at their
    width (gguf; ``checkpoint.gguf_head_bits``). None: the head is in the
    model dtype (also when a GGUF file is not here to read)."""
    m, row = cfg.model, method_of(cfg)
    if row.cpu_at_load:
        return m.vocab_size * (m.hidden_size + 4)
    if row.scales != "blocks" or (path := gguf_file(m.path)) is None:
        return None
    try:
        bits = gguf_head_bits(gguf_header(path)[1])
    except (OSError, ValueError, struct.error):
        return None  # resolving the deployment has said why
    return None if bits is None else int(m.vocab_size * m.hidden_size * bits / 8)


def embedding_read_from_head(cfg: ApplianceConfig) -> bool:
    """A GGUF file's embedding tied to grouped-int8 head blocks, on one rank: held once, the head's blocks
    (``checkpoint.gguf_embedding_in_head``)."""
    par = cfg.parallel
    if method_of(cfg).scales != "blocks" or par.tensor_parallel_size * par.pipeline_parallel_size != 1 \
            or (path := gguf_file(cfg.model.path)) is None:
        return False
    try:
        return gguf_embedding_in_head(gguf_header(path)[1])
    except (OSError, ValueError, struct.error):
        return False


def output_channels(m: ModelConfig) -> int:
    """Output channels of every decoder projection (one scale each under a per-channel method)."""
    attention = m.num_heads * m.head_dim + 2 * m.num_kv_heads * m.head_dim + m.hidden_size
    sparse = len(sparse_layers(m))
    dense_mlp = 2 * m.intermediate_size + m.hidden_size
    experts = m.num_experts * (2 * m.moe_intermediate_size + m.hidden_size)
    return m.num_layers * attention + (m.num_layers - sparse) * dense_mlp + sparse * experts


def expert_bytes(cfg: ApplianceConfig, dtype: str) -> int:
    """Bytes of every expert of every sparse layer (0 for a dense model)."""
    m = cfg.model
    if not m.num_experts:
        return 0
    dense = dataclasses.replace(m, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    return _target_weight_bytes(cfg, dtype) - _target_weight_bytes(dataclasses.replace(cfg, model=dense), dtype)


def active_weight_bytes(cfg: ApplianceConfig, dtype: str) -> int:
    """Bytes one token reads: every weight but the experts it is not routed
    to (all weights for a dense model)."""
    m = cfg.model
    if not m.num_experts:
        return _target_weight_bytes(cfg, dtype)
    active = dataclasses.replace(m, num_experts=m.num_experts_per_tok)
    return _target_weight_bytes(dataclasses.replace(cfg, model=active), dtype)


def experts_plan(cfg: ApplianceConfig, dtype: str) -> Optional[dict[str, Any]]:
    """Where a mixture-of-experts model's experts live: per sparse layer,
    how many each rank holds (all, a slice of each under tensor
    parallelism, or whole ones split over tp x dp ranks with expert
    parallelism), redundant slots, and the expert bytes per rank."""
    m, par = cfg.model, cfg.parallel
    if not m.num_experts:
        return None
    ep = par.tensor_parallel_size * par.data_parallel_size if par.enable_expert_parallel else 1
    redundant = par.eplb.num_redundant_experts if par.eplb.enabled else 0
    slots = m.num_experts + redundant
    stages = par.pipeline_parallel_size
    held = expert_bytes(cfg, dtype) * slots // m.num_experts
    per_rank = held // (ep * stages) if ep > 1 else held // (par.tensor_parallel_size * stages)
    return {"num_experts": m.num_experts, "top_k": m.num_experts_per_tok, "sparse_layers": len(sparse_layers(m)),
            "expert_parallel_size": ep, "experts_per_rank": slots // ep, "redundant_experts": redundant,
            "expert_bytes_per_rank": per_rank, "active_parameter_count": parameter_counts(m)["active"]}


def draft_model(cfg: ApplianceConfig) -> Optional[ModelConfig]:
    """The draft model of ``speculative.method=draft_model`` (None otherwise, or unresolvable)."""
    if cfg.speculative.method != "draft_model":
        return None
    from appliance.config.draft import draft_model_config

    return draft_model_config(cfg)[0]


def kv_bytes_per_token(cfg: ApplianceConfig, dtype: str) -> int:
    """K and V of every layer for one token, per device (a draft model's too:
    its cache shares the target's blocks; every rank that samples holds all
    its KV heads: the worst device's figure)."""
    draft = draft_model(cfg)
    return _kv_bytes(cfg, cfg.model, dtype) + (_kv_bytes(cfg, draft, draft_dtype(cfg, dtype), whole=True)
                                               if draft is not None else 0)


def draft_dtype(cfg: ApplianceConfig, dtype: str) -> str:
    """The dtype the draft model runs at: ``speculative.draft_dtype``, or the target's ``dtype``."""
    return dtype if cfg.speculative.draft_dtype == "auto" else str(cfg.speculative.draft_dtype)


def _kv_bytes(cfg: ApplianceConfig, m: ModelConfig, dtype: str, whole: bool = False) -> int:
    """``m``'s K and V per token on one device: its share of the KV heads and
    its stage's layers, or (``whole``: a draft model each rank holds) all of them."""
    tp = 1 if whole else cfg.parallel.tensor_parallel_size
    pp = 1 if whole else cfg.parallel.pipeline_parallel_size
    kv_heads = max(1, m.num_kv_heads // tp)  # kv heads replicate when tp > num_kv_heads
    partition = None if whole else cfg.parallel.pp_layer_partition
    layers = max(pipeline_partition(m.num_layers, pp, partition))  # the stage holding the most
    elem = KV_DTYPE_BYTES.get(kv_dtype(cfg, dtype), DTYPE_BYTES.get(kv_dtype(cfg, dtype), 2))
    return 2 * layers * kv_heads * m.head_dim * elem


def activation_bytes(cfg: ApplianceConfig, dtype: str) -> int:
    """Peak activations of one step: the widest intermediate tensors of one
    layer for ``max_num_batched_tokens`` tokens plus fp32 logits for the
    sampled rows (one per sequence)."""
    m = cfg.model
    s = cfg.scheduler
    tp = cfg.parallel.tensor_parallel_size
    per_token = (4 * m.hidden_size + 3 * m.intermediate_size // tp) * DTYPE_BYTES[dtype]
    logits = min(s.max_num_seqs, s.max_num_batched_tokens) * m.vocab_size * 4 // tp
    return s.max_num_batched_tokens * per_token + logits


@dataclass
class Plan:
    profile: str
    model: str
    architecture: str
    implementation: str  # the architecture registry's row: what builds it and what it supports
    hardware: str
    device_kind: str
    dtype: str
    quantization: str
    weight_bits: float  # bits per projection weight as loaded (quantization.weight_bits)
    lm_head_bits: float | None  # bits per LM head weight as loaded, parameters included; None: the model dtype
    kv_cache_dtype: str
    attention_backend: str | None
    attention_chain: list[str]
    attention_provider_here: str | None
    parallel: dict[str, int]
    num_devices_used: int
    num_devices: int  # the hardware's
    parameter_count: int
    weight_bytes_total: int
    weight_bytes_per_device: int
    activation_bytes_per_device: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    block_size: int
    num_kv_blocks: int
    kv_tokens: int
    max_model_len: int
    max_concurrency_at_max_len: float
    decode_roofline_tok_s: float
    decode_roofline_at_max_len_tok_s: float  # one sequence whose context fills max_model_len
    prefill_roofline_tok_s: float
    compute_dtype: str
    swap_kv_blocks: int
    token_budget: int  # tokens per step: the first one when it follows scheduler.target_itl_ms
    token_budget_reason: str
    engine_cores: int = 1  # data-parallel ranks: an engine core each, the whole model over tp x pp devices
    collectives_per_step: int = 0  # collective calls of one forward (tensor and pipeline parallel)
    collective_bytes_per_token: int = 0  # bytes each rank sends and receives per scheduled token
    collective_bytes_per_sampled_token: int = 0  # and per sampled row (the gathered logits)
    decode_comm_share: Optional[float] = None  # estimated share of a one-request decode step spent in collectives
    experts: Optional[dict[str, Any]] = None  # a mixture-of-experts model's experts per rank (experts_plan)
    speculative: str = "off"  # what drafts and how many, in words
    structured_output: str = ""  # how output constraints compile, in words
    kv_events: str = "off"  # where the KV cache's block events are published, in words
    kv_transfer: str = "off"  # the KV connector, in words
    execution: dict[str, Any] = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe_architecture(m: ModelConfig) -> str:
    extras = [x for x, on in (("qkv bias", m.qkv_bias), ("q/k norm", m.qk_norm),
                              ("tied embeddings", m.tie_word_embeddings)) if on]
    rope = m.rope_scaling.type
    if rope != "none":
        extras.append(f"{rope} rope x{m.rope_scaling.factor:g}")
    return (f"{m.architecture}: {m.num_layers} layers, hidden {m.hidden_size}, intermediate {m.intermediate_size}, "
            f"{m.num_heads} heads / {m.num_kv_heads} kv heads x {m.head_dim}, vocab {m.vocab_size}"
            + (f"; {', '.join(extras)}" if extras else ""))


def max_model_len(cfg: ApplianceConfig) -> int:
    return cfg.model.max_model_len or cfg.model.max_position_embeddings


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory (a CPU host: one rank's share of it), as the memory
    model above sizes it: the one account that validation and the plan read."""
    usable: int  # what the deployment may use of the device
    weights: int  # its shard of the weights, its experts, a whole draft, less what cache.cpu_offload_gib moves
    offloaded: int  # weight bytes of the device's shard held in host memory instead
    activations: int
    kv_cache: int  # the KV pool: cache.kv_cache_memory_gib, or what the rest leaves
    num_kv_blocks: int


def device_memory(cfg: ApplianceConfig, dtype: str) -> DeviceMemory:
    par = cfg.parallel
    shards = par.tensor_parallel_size * par.pipeline_parallel_size
    total_w = weight_bytes(cfg, dtype)
    # cache.cpu_offload_gib of each device's weights live in host memory (vLLM's --cpu-offload-gb).
    offload = min(int(cfg.cache.cpu_offload_gib * GIB), total_w // shards)
    experts = experts_plan(cfg, dtype)
    draft_w = draft_weight_bytes(cfg, dtype)  # not split: each rank holds the whole draft
    w_dev = (total_w - draft_w) // shards + draft_w - offload
    if experts is not None and experts["expert_parallel_size"] > 1:  # whole experts split over tp x dp ranks
        w_dev = (total_w - draft_w - expert_bytes(cfg, dtype)) // shards + experts["expert_bytes_per_rank"] \
            + draft_w - offload
    act = activation_bytes(cfg, dtype)
    usable = int(cfg.hardware.memory_gib * GIB * cfg.cache.memory_utilization)
    if cfg.hardware.device_kind == "cpu":  # a CPU host's ranks share its memory
        usable //= shards * par.data_parallel_size
    if cfg.cache.kv_cache_memory_gib is not None:
        kv_bytes = int(cfg.cache.kv_cache_memory_gib * GIB)
    else:
        kv_bytes = max(0, usable - w_dev - act)
    per_block = cfg.cache.block_size * kv_bytes_per_token(cfg, dtype)
    return DeviceMemory(usable=usable, weights=w_dev, offloaded=offload, activations=act, kv_cache=kv_bytes,
                        num_kv_blocks=kv_bytes // per_block if per_block else 0)


def make_plan(cfg: ApplianceConfig, execution: Optional[Execution] = None) -> Plan:
    """The plan for the target hardware, or, given an ``Execution`` resolved on
    this machine, for what this machine will run."""
    ex = execution or resolve_execution(cfg)
    dtype = ex.dtype
    par = cfg.parallel
    shards = par.tensor_parallel_size * par.pipeline_parallel_size
    devices = shards * par.data_parallel_size
    total_w = weight_bytes(cfg, dtype)
    experts = experts_plan(cfg, dtype)
    mem = device_memory(cfg, dtype)
    w_dev, offload, act, kv_bytes, num_blocks = mem.weights, mem.offloaded, mem.activations, mem.kv_cache, \
        mem.num_kv_blocks
    per_tok = kv_bytes_per_token(cfg, dtype)
    bs = cfg.cache.block_size
    mml = max_model_len(cfg)
    sel = ex.selection
    notes = []
    provider_here = sel.provider
    if sel.chosen and not ex.probed:
        from appliance.kernels.registry import probe_provider

        provider_here, err = probe_provider(sel.chosen, dtype, cfg.cache.kv_cache_dtype)
        if provider_here is None:
            notes.append(f"{sel.chosen} has no usable package on this machine ({err}); it is chosen for the target "
                         "hardware")
    bw = cfg.hardware.memory_bandwidth_gbps * 1e9
    read_dev = w_dev
    if experts is not None:  # a token reads the non-expert weights and its top-k experts (spread over the ranks)
        nonexpert = total_w - expert_bytes(cfg, dtype)
        split = experts["expert_parallel_size"] if experts["expert_parallel_size"] > 1 else par.tensor_parallel_size
        read_dev = nonexpert // shards + (active_weight_bytes(cfg, dtype) - nonexpert) // (
            split * par.pipeline_parallel_size)
    roofline = bw / read_dev if w_dev else 0.0
    # a sequence at max_model_len: its decode step reads that much KV besides the weights
    roofline_at_max_len = bw / (read_dev + mml * per_tok) if w_dev else 0.0
    peak = cfg.hardware.peak_tflops
    compute_dtype = "fp8" if fp8_gemm(cfg) else "int8" if int8_gemm(cfg, sel.chosen) else {
        "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    tflops = getattr(peak, compute_dtype)
    counts = parameter_counts(cfg.model)
    prefill_roofline = tflops * 1e12 * shards / (2 * counts["active"]) if tflops else 0.0
    if cfg.model.param_count_b and abs(counts["total"] / 1e9 - cfg.model.param_count_b) > 0.02 * cfg.model.param_count_b:
        notes.append(f"the architecture counts {counts['total'] / 1e9:.3f} B parameters but the catalog says "
                     f"{cfg.model.param_count_b} B: check the model.* facts")
    if offload:
        notes.append(f"{offload / GIB:.2f} GiB of weights per device offloaded to host memory (cache.cpu_offload_gib)")
    notes += [f"not built yet, serving refuses it: {u}" for u in not_built(cfg)]
    notes += method_of(cfg).plan_notes(cfg)
    swap_blocks = int(cfg.cache.swap_space_gib * GIB) // (bs * per_tok) if per_tok else 0
    comm = communication(cfg, dtype, w_dev)
    if comm["collectives_per_step"] and comm["decode_comm_share"] is None:
        notes.append(f"hardware={cfg.hardware.name} sets no interconnect_gbps / collective_latency_us: the "
                     f"communication share of a decode step is not estimated")
    return Plan(
        profile=cfg.profile,
        model=cfg.model.name,
        architecture=describe_architecture(cfg.model),
        implementation=describe(cfg.model.architecture),
        hardware=cfg.hardware.name,
        device_kind=cfg.hardware.device_kind,
        dtype=dtype,
        quantization=cfg.quantization.method,
        weight_bits=cfg.quantization.weight_bits,
        lm_head_bits=None if (head := lm_head_bytes(cfg)) is None
        else round(8 * head / (cfg.model.vocab_size * cfg.model.hidden_size), 3),
        kv_cache_dtype=ex.kv_cache_dtype,
        attention_backend=sel.chosen,
        attention_chain=sel.explain(),
        attention_provider_here=provider_here,
        parallel={
            "tensor_parallel_size": par.tensor_parallel_size,
            "pipeline_parallel_size": par.pipeline_parallel_size,
            "data_parallel_size": par.data_parallel_size,
            "expert_parallel_size": par.tensor_parallel_size * par.data_parallel_size
            if par.enable_expert_parallel
            else 1,
        },
        num_devices_used=devices,
        num_devices=cfg.hardware.num_devices,
        parameter_count=parameter_counts(cfg.model)["total"],
        weight_bytes_total=total_w,
        weight_bytes_per_device=w_dev,
        activation_bytes_per_device=act,
        kv_bytes_per_token=per_tok,
        kv_cache_bytes=kv_bytes,
        block_size=bs,
        num_kv_blocks=num_blocks,
        kv_tokens=num_blocks * bs,
        max_model_len=mml,
        max_concurrency_at_max_len=round(num_blocks * bs / mml, 2) if mml else 0.0,
        decode_roofline_tok_s=round(roofline, 1),
        decode_roofline_at_max_len_tok_s=round(roofline_at_max_len, 1),
        prefill_roofline_tok_s=round(prefill_roofline, 1),
        compute_dtype=compute_dtype,
        swap_kv_blocks=swap_blocks,
        **token_budget(cfg, prefill_roofline),
        engine_cores=par.data_parallel_size,
        experts=experts,
        **comm,
        speculative=describe_speculative(cfg),
        structured_output=describe_structured_output(cfg),
        kv_events=describe_kv_events(cfg),
        kv_transfer=describe_kv_transfer(cfg),
        execution=ex.to_dict(),
        summary=ex.summary(),
        notes=notes,
    )


GLOO_LOOPBACK_LATENCY_US = 1000.0  # a few-kB gloo all-reduce between two CPU ranks over loopback (2-vCPU EPYC)


def communication(cfg: ApplianceConfig, dtype: str, weight_bytes_per_device: int) -> dict[str, Any]:
    """The collectives of one forward and their estimated share of a decode step.

    Tensor parallelism all-reduces the hidden row of each token after
    o_proj and down_proj (two per layer) and after the vocabulary-parallel
    embedding, and gathers the fp32 logits of each sampled row (the
    vocabulary padded to 64 x tp); pipeline parallelism hands each token's
    hidden row from stage to stage (a broadcast per stage boundary, every
    rank taking part) and the last stage's fp32 logits to every rank. Bytes
    are what one rank moves: a ring all-reduce sends and receives 2 (tp - 1) / tp of the
    row, an all-gather (tp - 1) / tp of the gathered row. The share is for
    one request: ``calls x collective_latency_us + bytes / interconnect_gbps``
    against the weights streamed (``pp`` stages in sequence)."""
    par, m, hw = cfg.parallel, cfg.model, cfg.hardware
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    row = m.hidden_size * DTYPE_BYTES[dtype]
    layers = max(pipeline_partition(m.num_layers, pp, par.pp_layer_partition))
    calls = per_token = per_sampled = 0
    if tp > 1:
        calls += 2 * layers + 2
        per_token += int((2 * layers + 1) * row * 2 * (tp - 1) / tp)
        unit = 64 * tp
        per_sampled += int(-(-m.vocab_size // unit) * unit * 4 * (tp - 1) / tp)
    if pp > 1:  # each stage boundary a broadcast every rank takes part in, then the logits to every rank
        calls += pp
        per_token += (pp - 1) * row
        per_sampled += m.vocab_size * 4
    share = None
    latency_us = hw.collective_latency_us
    if hw.device_kind == "cpu" and par.cpu_collectives == "gloo":
        latency_us = GLOO_LOOPBACK_LATENCY_US
    if calls and hw.interconnect_gbps > 0 and latency_us > 0 and hw.memory_bandwidth_gbps > 0:
        comm_s = calls * latency_us * 1e-6 + (per_token + per_sampled) / (hw.interconnect_gbps * 1e9)
        compute_s = pp * weight_bytes_per_device / (hw.memory_bandwidth_gbps * 1e9)
        share = round(comm_s / (comm_s + compute_s), 3)
    return {"collectives_per_step": calls, "collective_bytes_per_token": per_token,
            "collective_bytes_per_sampled_token": per_sampled, "decode_comm_share": share}


def describe_kv_events(cfg: ApplianceConfig) -> str:
    ev = cfg.kv_events
    if not ev.enabled:
        return "off"
    dp = cfg.parallel.data_parallel_size
    where = f"{ev.endpoint}" + (f" (engine core r: port + r, {dp} cores)" if dp > 1 else "")
    replay = (f"the last {ev.buffer_steps} steps replayable at {ev.replay_endpoint}" if ev.replay_endpoint
              else "no replay")
    tokens = "with the blocks' token ids" if ev.include_token_ids else "hashes only (no token ids)"
    who = "CURVE: authorized subscribers only" if ev.curve_secret_key_file else "no subscriber authentication"
    return f"block events in vLLM's format on {where}, topic {ev.topic!r}; {replay}; {tokens}; {who}"


def describe_structured_output(cfg: ApplianceConfig) -> str:
    so = cfg.structured_output
    return (f"{so.backend}: JSON schema, regex, choice, EBNF and forced tool calls compiled on {so.num_threads} "
            f"thread(s) off the step loop, {so.cache_size_mib} MiB of compiled grammars kept"
            + ("; compact JSON unless a request allows whitespace" if so.disable_any_whitespace else
               f"; at most {so.max_json_whitespace} whitespace characters between JSON tokens"
               if so.max_json_whitespace is not None else "")
            + f"; tool calls read as {cfg.server.tool_parser}")


def describe_speculative(cfg: ApplianceConfig) -> str:
    spec = cfg.speculative
    if spec.method == "off":
        return "off"
    if spec.method == "draft_model":
        words = _describe_draft(cfg)
    else:
        words = (f"{spec.method}: up to {spec.num_speculative_tokens} draft tokens per request per step, from the "
                 f"last {spec.prompt_lookup_min}..{spec.prompt_lookup_max} tokens' earlier occurrence in prompt + "
                 f"output; verified in one forward (greedy: equal to the target's argmax; sampled: rejection "
                 f"sampling)")
    if spec.disable_by_batch_size is not None:
        words += f"; off while more than {spec.disable_by_batch_size} requests run"
    return words


def _describe_draft(cfg: ApplianceConfig) -> str:
    spec = cfg.speculative
    draft = draft_model(cfg)
    size = f" ({parameter_counts(draft)['total'] / 1e6:.1f} M parameters)" if draft is not None else ""
    if spec.draft_dtype != "auto":
        size += f" at {spec.draft_dtype}"
    return (f"draft_model {spec.draft_model}{size}: up to {spec.num_speculative_tokens} draft tokens per request "
            f"per step, drawn from the draft (run by the same runner, its K/V in the target's blocks); verified in "
            f"one forward (greedy: equal to the target's argmax; sampled: rejection sampling)")


def token_budget(cfg: ApplianceConfig, prefill_tok_s: float) -> dict[str, Any]:
    """The tokens a step may schedule: ``scheduler.max_num_batched_tokens``,
    or, with ``scheduler.target_itl_ms``, the prefill tokens the prefill
    roofline fits in that time (a first estimate: the engine refits it to
    measured step times, at most the cap, and never starving a prompt below
    ``scheduler.min_prefill_share`` of a step)."""
    s = cfg.scheduler
    cap = s.max_num_batched_tokens
    if s.target_itl_ms is None:
        return {"token_budget": cap, "token_budget_reason": "scheduler.max_num_batched_tokens"}
    first = max(1, min(cap, int(s.target_itl_ms / 1e3 * prefill_tok_s))) if prefill_tok_s else cap
    return {"token_budget": first,
            "token_budget_reason": f"first estimate for scheduler.target_itl_ms={s.target_itl_ms:g} at the "
                                   f"{prefill_tok_s:.0f} tok/s prefill roofline; refitted to measured step times, "
                                   f"at most {cap} (max_num_batched_tokens); a waiting prompt gets at least "
                                   f"{s.min_prefill_share:.0%} of each step (scheduler.min_prefill_share), the "
                                   f"step running past the objective where the decodes leave it less"}


def _widths(p: Plan) -> str:
    """The loaded widths a quantized plan states: projections, and a quantized LM head."""
    if p.quantization == "none":
        return ""
    head = f"; LM head {p.lm_head_bits:.3g} bits a weight" if p.lm_head_bits is not None else ""
    return f" ({p.weight_bits:g} bits per projection weight as loaded{head})"


def format_plan(p: Plan) -> str:
    def gib(b: int) -> str:
        return f"{b / GIB:.2f} GiB"

    par = p.parallel
    lines = [
        f"profile            {p.profile}",
        f"model              {p.model} ({p.parameter_count / 1e9:.3f} B parameters)",
        f"architecture       {p.architecture}",
        f"implementation     {p.implementation}",
        f"hardware           {p.hardware} ({p.device_kind}), {p.num_devices_used} of {p.num_devices} device(s) used",
        f"parallel           tp={par['tensor_parallel_size']} pp={par['pipeline_parallel_size']} "
        f"dp={par['data_parallel_size']} ep={par['expert_parallel_size']}",
        *p.summary,
        f"quantization       {p.quantization}{_widths(p)}",
        f"attention backend  {p.attention_backend or 'NONE'}",
    ]
    lines += [f"  {line}" for line in p.attention_chain]
    lines += [
        f"weights            {gib(p.weight_bytes_total)} total, {gib(p.weight_bytes_per_device)} per device",
        f"activations        {gib(p.activation_bytes_per_device)} per device (estimate)",
        f"kv cache           {gib(p.kv_cache_bytes)} per device, {p.kv_bytes_per_token} bytes/token",
        f"kv blocks          {p.num_kv_blocks} x {p.block_size} tokens = {p.kv_tokens} tokens"
        + (f" in each of {p.engine_cores} engine cores (data parallel: own KV and prefix cache)"
           if p.engine_cores > 1 else ""),
        *([f"collectives        {p.collectives_per_step} per forward; per rank {p.collective_bytes_per_token} bytes "
           f"per token + {p.collective_bytes_per_sampled_token} per sampled token; "
           + (f"~{p.decode_comm_share:.0%} of a one-request decode step (estimate)"
              if p.decode_comm_share is not None else "share not estimated")]
          if p.collectives_per_step else []),
        *([f"experts            {p.experts['num_experts']} per sparse layer x {p.experts['sparse_layers']} layers, "
           f"top {p.experts['top_k']} per token ({p.experts['active_parameter_count'] / 1e9:.3f} B parameters "
           f"active); {p.experts['experts_per_rank']} per rank over ep={p.experts['expert_parallel_size']}"
           + (f" (a slice of each over tp={p.parallel['tensor_parallel_size']})"
              if p.experts['expert_parallel_size'] == 1 and p.parallel['tensor_parallel_size'] > 1 else "")
           + f", {p.experts['redundant_experts']} redundant; {gib(p.experts['expert_bytes_per_rank'])} of experts "
             f"per rank"] if p.experts else []),
        f"max_model_len      {p.max_model_len}; max concurrency at that length {p.max_concurrency_at_max_len}x",
        f"decode roofline    {p.decode_roofline_tok_s} tok/s per sequence at batch 1 (weights"
        + (" a token reads" if p.experts else "") + " / bandwidth); "
        f"{p.decode_roofline_at_max_len_tok_s} at max_model_len (its {p.max_model_len * p.kv_bytes_per_token / 1e6:.0f} MB "
        f"of {p.kv_cache_dtype} KV read each step too)",
        f"prefill roofline   {p.prefill_roofline_tok_s} tok/s ({p.compute_dtype} peak / 2 x "
        + ("active " if p.experts else "") + "parameters)",
        f"token budget       {p.token_budget} tokens per step ({p.token_budget_reason})",
        f"speculative        {p.speculative}",
        f"structured output  {p.structured_output}",
        f"kv events          {p.kv_events}",
        f"kv transfer        {p.kv_transfer}",
        *([f"kv swap space      {p.swap_kv_blocks} blocks in host memory (cache.swap_space_gib)"] if p.swap_kv_blocks else []),
    ]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


__all__ = ["BACKENDS", "Plan", "make_plan", "format_plan", "parameter_counts"]
