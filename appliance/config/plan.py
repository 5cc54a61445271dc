"""What a resolved deployment would run, computed without a GPU: the
``Plan`` that ``appliance plan`` prints and the composition root sizes the
engine from. Its memory figures are ``config/memory.py``'s account."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from appliance.config.architectures import describe, tool_format
from appliance.config.execution import Execution, resolve_execution
from appliance.config.kv_connectors import describe_kv_transfer
from appliance.config.kv_groups import CHUNKED, SLIDING, kv_layout
from appliance.config.memory import (DTYPE_BYTES, GIB, DeviceMemory, active_weight_bytes, blocks_per_request,
                                     device_memory, draft_model, expert_bytes, experts_plan, int8_gemm,
                                     kv_bytes_per_token, kv_layer_bytes, lm_head_bytes, max_model_len, weight_bytes)
from appliance.config.quantization import fp8_gemm, method_of
from appliance.config.schema import ApplianceConfig, ModelConfig
from appliance.config.sizes import parameter_counts, pipeline_partition, rotary_dim
from appliance.config.unbuilt import not_built
from appliance.kernels.registry import BACKENDS

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
    # the KV-cache groups (config/kv_groups.py): each one's attention, layers, and blocks one max_model_len request
    # holds in it; and, for a model with sliding windows or chunks, the concurrency it would have if all were full attention
    kv_cache_groups: list[dict[str, Any]] = field(default_factory=list)
    max_concurrency_as_full_attention: Optional[float] = None
    kv_read_at_max_len: int = 0  # KV bytes a decode step of one max_model_len sequence reads on a device
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
    if m.partial_rotary_factor != 1.0:
        extras.append(f"rope over {rotary_dim(m)} of {m.head_dim} channels a head")
    if m.sliding_window is not None:
        sliding = m.num_layers if m.layer_types is None else m.layer_types.count(SLIDING)
        extras.append(f"sliding window {m.sliding_window} in {sliding} of {m.num_layers} layers")
    if m.attention_chunk_size is not None and m.layer_types is not None:
        extras.append(f"chunked local attention {m.attention_chunk_size} in {m.layer_types.count(CHUNKED)} of "
                      f"{m.num_layers} layers")
    if m.nope_layers:
        extras.append(f"no rope in {len(m.nope_layers)} of {m.num_layers} layers")
    return (f"{m.architecture}: {m.num_layers} layers, hidden {m.hidden_size}, intermediate {m.intermediate_size}, "
            f"{m.num_heads} heads / {m.num_kv_heads} kv heads x {m.head_dim}, vocab {m.vocab_size}"
            + (f"; {', '.join(extras)}" if extras else ""))


def _provider_here(cfg: ApplianceConfig, ex: Execution) -> tuple[Optional[str], list[str]]:
    """The chosen backend's package on this machine (probed here when the
    execution was resolved for the target), and a note when it has none."""
    sel = ex.selection
    if not sel.chosen or ex.probed:
        return sel.provider, []
    from appliance.kernels.registry import probe_provider

    provider, err = probe_provider(sel.chosen, ex.dtype, cfg.cache.kv_cache_dtype)
    if provider is None:
        return None, [f"{sel.chosen} has no usable package on this machine ({err}); it is chosen for the target "
                      "hardware"]
    return provider, []


def kv_read_at_max_len(cfg: ApplianceConfig, dtype: str, per_tok: int) -> int:
    """KV bytes a device reads for one sequence at ``max_model_len`` in a decode
    step: every position of every layer's (``per_tok`` a token), or, with
    sliding windows or chunks, each such layer's window or chunk only."""
    m, mml = cfg.model, max_model_len(cfg)
    layout = kv_layout(m, mml)
    if not any(g.gives_back for g in layout.groups):
        return mml * per_tok
    positions = sum(len(g.layers) * min(mml, g.sliding_window or g.attention_chunk or mml) for g in layout.groups)
    return positions * kv_layer_bytes(cfg, m, dtype) // cfg.parallel.pipeline_parallel_size


def _rooflines(cfg: ApplianceConfig, dtype: str, backend: Optional[str], w_dev: int, per_tok: int) -> dict[str, Any]:
    """Decode tokens/s at the device's memory bandwidth (a step reads the
    weights a token touches, and at ``max_model_len`` that much KV too) and
    prefill tokens/s at its peak in the GEMMs' compute dtype."""
    par = cfg.parallel
    shards = par.tensor_parallel_size * par.pipeline_parallel_size
    bw = cfg.hardware.memory_bandwidth_gbps * 1e9
    read_dev = w_dev
    experts = experts_plan(cfg, dtype)
    if experts is not None:  # a token reads the non-expert weights and its top-k experts (spread over the ranks)
        nonexpert = weight_bytes(cfg, dtype) - expert_bytes(cfg, dtype)
        split = experts["expert_parallel_size"] if experts["expert_parallel_size"] > 1 else par.tensor_parallel_size
        read_dev = nonexpert // shards + (active_weight_bytes(cfg, dtype) - nonexpert) // (
            split * par.pipeline_parallel_size)
    compute_dtype = "fp8" if fp8_gemm(cfg) else "int8" if int8_gemm(cfg, backend) else {
        "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    tflops = getattr(cfg.hardware.peak_tflops, compute_dtype)
    prefill = tflops * 1e12 * shards / (2 * parameter_counts(cfg.model)["active"]) if tflops else 0.0
    kv_read = kv_read_at_max_len(cfg, dtype, per_tok)
    return {
        "decode_roofline_tok_s": round(bw / read_dev, 1) if w_dev else 0.0,
        "decode_roofline_at_max_len_tok_s": round(bw / (read_dev + kv_read), 1) if w_dev else 0.0,
        "kv_read_at_max_len": kv_read,
        "prefill_roofline_tok_s": prefill,  # rounded in the plan
        "compute_dtype": compute_dtype,
    }


def _notes(cfg: ApplianceConfig, offloaded: int, comm: dict[str, Any]) -> list[str]:
    """What the plan says besides its figures: a parameter count the catalog
    contradicts, offloaded weights, what is not built yet, the quantization
    method's own notes, a communication share it cannot estimate."""
    notes = []
    counts = parameter_counts(cfg.model)
    if cfg.model.param_count_b and abs(counts["total"] / 1e9 - cfg.model.param_count_b) > 0.02 * cfg.model.param_count_b:
        notes.append(f"the architecture counts {counts['total'] / 1e9:.3f} B parameters but the catalog says "
                     f"{cfg.model.param_count_b} B: check the model.* facts")
    if offloaded:
        notes.append(f"{offloaded / GIB:.2f} GiB of weights per device offloaded to host memory (cache.cpu_offload_gib)")
    notes += [f"not built yet, serving refuses it: {u}" for u in not_built(cfg)]
    notes += method_of(cfg).plan_notes(cfg)
    if comm["collectives_per_step"] and comm["decode_comm_share"] is None:
        notes.append(f"hardware={cfg.hardware.name} sets no interconnect_gbps / collective_latency_us: the "
                     f"communication share of a decode step is not estimated")
    return notes


def _kv_groups(cfg: ApplianceConfig, dtype: str, mem: DeviceMemory) -> dict[str, Any]:
    """The KV-cache groups, and what a model with sliding windows or chunks gains from
    them: the concurrency at max_model_len were every layer full attention
    (a tensor per layer, every block kept) beside the plan's."""
    m, mml, bs = cfg.model, max_model_len(cfg), cfg.cache.block_size
    layout = kv_layout(m, mml)
    blocks = layout.blocks_per_request(mml, bs, cfg.scheduler.max_num_batched_tokens)
    groups = [{"attention": g.describe(), "layers": len(g.layers), "blocks_per_request": n}
              for g, n in zip(layout.groups, blocks)]
    if not any(g.gives_back for g in layout.groups):
        return {"kv_cache_groups": groups}
    full_blocks = mem.kv_cache // (bs * kv_layer_bytes(cfg, m, dtype) * max(
        pipeline_partition(m.num_layers, cfg.parallel.pipeline_parallel_size, cfg.parallel.pp_layer_partition)))
    return {"kv_cache_groups": groups,
            "max_concurrency_as_full_attention": round(full_blocks / -(-mml // bs), 2) if mml else 0.0}


def _group_lines(groups: list[dict[str, Any]]) -> list[str]:
    """The KV-cache groups in words, alike groups counted once."""
    counts: dict[tuple, int] = {}
    for g in groups:
        key = (g["attention"], g["layers"], g["blocks_per_request"])
        counts[key] = counts.get(key, 0) + 1
    return [f"{n} x {attention} ({layers} layers; {blocks} blocks per max_model_len request)"
            for (attention, layers, blocks), n in counts.items()]


def make_plan(cfg: ApplianceConfig, execution: Optional[Execution] = None) -> Plan:
    """The plan for the target hardware, or, given an ``Execution`` resolved on
    this machine, for what this machine will run."""
    ex = execution or resolve_execution(cfg)
    dtype = ex.dtype
    par = cfg.parallel
    devices = par.tensor_parallel_size * par.pipeline_parallel_size * par.data_parallel_size
    total_w = weight_bytes(cfg, dtype)
    experts = experts_plan(cfg, dtype)
    mem = device_memory(cfg, dtype)
    w_dev, act, kv_bytes, num_blocks = mem.weights, mem.activations, mem.kv_cache, mem.num_kv_blocks
    per_tok = kv_bytes_per_token(cfg, dtype)
    bs = cfg.cache.block_size
    mml = max_model_len(cfg)
    sel = ex.selection
    provider_here, notes = _provider_here(cfg, ex)
    rates = _rooflines(cfg, dtype, sel.chosen, w_dev, per_tok)
    swap_blocks = int(cfg.cache.swap_space_gib * GIB) // (bs * per_tok) if per_tok else 0
    comm = communication(cfg, dtype, w_dev)
    notes += _notes(cfg, mem.offloaded, comm)
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
        max_concurrency_at_max_len=round(num_blocks / blocks_per_request(cfg), 2) if mml else 0.0,
        **{**rates, "prefill_roofline_tok_s": round(rates["prefill_roofline_tok_s"], 1)},
        swap_kv_blocks=swap_blocks,
        **token_budget(cfg, rates["prefill_roofline_tok_s"], rates["decode_roofline_tok_s"]),
        engine_cores=par.data_parallel_size,
        experts=experts,
        **_kv_groups(cfg, dtype, mem),
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
            + _chat_output(cfg))


def _chat_output(cfg: ApplianceConfig) -> str:
    """How chat outputs are read: harmony's channels, or the tool format and reasoning parser."""
    tools = tool_format(cfg.model.architecture, cfg.server.tool_parser)
    if tools == "harmony":
        return ("; chat in harmony's format (openai-harmony renders the prompts; the analysis channel is the "
                "reasoning, messages to functions.NAME the tool calls; constraints on the final channel only)")
    return (f"; tool calls read as {tools}"
            + (f"; reasoning read as {cfg.server.reasoning_parser} (<think>...</think> apart from the answer, "
               f"constraints on the answer only)" if cfg.server.reasoning_parser is not None else ""))


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


def token_budget(cfg: ApplianceConfig, prefill_tok_s: float, decode_tok_s: float) -> dict[str, Any]:
    """The tokens a step may schedule: ``scheduler.max_num_batched_tokens``,
    or, under an objective, the prefill tokens the prefill roofline fits in
    ``scheduler.target_itl_ms`` and in ``scheduler.max_itl_ratio`` decode
    steps at the decode roofline, the smaller (a first estimate: the engine
    refits it to measured step times, at most the cap, and never starving a
    prompt below ``scheduler.min_prefill_share`` of a step)."""
    s = cfg.scheduler
    cap = s.max_num_batched_tokens
    objectives = []  # (seconds a step may take, what says so)
    if s.target_itl_ms is not None:
        objectives.append((s.target_itl_ms / 1e3, f"scheduler.target_itl_ms={s.target_itl_ms:g}"))
    if s.max_itl_ratio is not None:
        objectives.append((s.max_itl_ratio / decode_tok_s if decode_tok_s else math.inf,
                           f"scheduler.max_itl_ratio={s.max_itl_ratio:g} ({s.max_itl_ratio:g}x a decode step at "
                           f"the {decode_tok_s:.0f} tok/s decode roofline)"))
    if not objectives:
        return {"token_budget": cap, "token_budget_reason": "scheduler.max_num_batched_tokens"}
    step_s = min(t for t, _ in objectives)
    first = max(1, min(cap, int(step_s * prefill_tok_s))) if prefill_tok_s and step_s < math.inf else cap
    return {"token_budget": first,
            "token_budget_reason": f"first estimate for {' and '.join(why for _, why in objectives)} at the "
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
        *(["kv cache groups    " + "; ".join(_group_lines(p.kv_cache_groups))]
          if len(p.kv_cache_groups) > 1 or p.max_concurrency_as_full_attention is not None else []),
        f"max_model_len      {p.max_model_len}; max concurrency at that length {p.max_concurrency_at_max_len}x"
        + (f" ({p.max_concurrency_as_full_attention}x were every layer full attention)"
           if p.max_concurrency_as_full_attention is not None else ""),
        f"decode roofline    {p.decode_roofline_tok_s} tok/s per sequence at batch 1 (weights"
        + (" a token reads" if p.experts else "") + " / bandwidth); "
        f"{p.decode_roofline_at_max_len_tok_s} at max_model_len (its {p.kv_read_at_max_len / 1e6:.0f} MB "
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
