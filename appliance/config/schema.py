"""Typed schema of the config tree.

Every key a deployment may set is a field here. The top-level schema is
registered in Hydra's ConfigStore as ``appliance_schema`` and is the first
entry of ``conf/appliance.yaml``'s defaults list, so composition runs in
struct mode: an unknown key, a wrong type or a bad enum value fails at
compose time with the key path (see ``appliance.config.compose``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore

from appliance.config.enums import (
    CpuCollectives,
    DType,
    DeviceKind,
    Fallback,
    HashAlgo,
    KVCacheDType,
    ParallelExecutor,
    Policy,
    QuantMethod,
    ReasoningParserName,
    RopeScalingType,
    SpecMethod,
    StructuredBackend,
    ToolParser,
)


@dataclass
class RopeScaling:
    type: RopeScalingType = RopeScalingType.none
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (as transformers reads a checkpoint's rope_scaling): the ramp between extrapolated and interpolated
    # frequencies, and the cos/sin scale (attention_factor; null: from factor, and mscale / mscale_all_dim)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None  # yarn's and longrope's (longrope's null: from factor)
    truncate: bool = True
    # longrope (Phi-3's): each frequency's divisor, one per rotated pair; a sequence of more tokens than
    # original_max_position_embeddings takes long_factor at every position (computed again as it grows past)
    short_factor: Optional[list[float]] = None
    long_factor: Optional[list[float]] = None


@dataclass
class ModelConfig:
    name: str = "???"
    # Where weights come from: a folder, a .gguf file, a Hugging Face id, or "smollm2_gguf" / "tiny_random".
    path: str = "???"
    architecture: str = "LlamaForCausalLM"
    num_layers: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    vocab_size: int = 0
    max_position_embeddings: int = 0
    # Catalog figure (billions); plan checks it against the architecture count.
    param_count_b: float = 0.0
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    # the share of each head's channels rope turns (the first ones; Phi-4-mini's 0.75), where the architecture's
    # row says its model does (config/architectures.py: partial_rotary)
    partial_rotary_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    qkv_bias: bool = False
    qk_norm: bool = False
    # A layer with a sliding window attends to the last sliding_window tokens only (itself included); its KV
    # lives in a KV-cache group that gives back blocks behind the window (config/kv_groups.py). null: none.
    sliding_window: Optional[int] = None
    # Each layer's attention, full_attention, sliding_attention or chunked_attention (a checkpoint's layer_types);
    # null: every layer alike, sliding when sliding_window is set (Mistral v0.1, Phi-3).
    layer_types: Optional[list[str]] = None
    # Llama 4's (a checkpoint's): a chunked_attention layer attends within its chunk of attention_chunk_size
    # tokens (position p to p - p % size .. p; its KV in a group that gives back finished chunks; null: none); the
    # layers without rope (NoPE); their queries scaled by 1 + scale * log(1 + floor((p + 1) / floor_scale))
    attention_chunk_size: Optional[int] = None
    nope_layers: list[int] = field(default_factory=list)
    attn_temperature_floor_scale: Optional[int] = None
    attn_temperature_scale: Optional[float] = None
    # Gemma's (a checkpoint's; others leave them null): attention scores scaled by query_pre_attn_scalar ** -0.5,
    # not head_dim ** -0.5; its sliding layers' rope base (rope_theta and rope_scaling: its full layers')
    query_pre_attn_scalar: Optional[float] = None
    rope_local_theta: Optional[float] = None
    # Gemma 2's (and Gemma 3's where its checkpoint names them): attention scores and final logits soft-capped,
    # cap * tanh(x / cap); null: not capped
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    # gpt-oss's clamped SwiGLU in its experts (a checkpoint's; other architectures leave them null):
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
    swiglu_limit: Optional[float] = None
    swiglu_alpha: Optional[float] = None
    # Granite's multipliers (a checkpoint's; others keep the defaults): the embedding's output, each attention and
    # MLP output before its residual add, the attention scores (null: head_dim ** -0.5), and the logits' divisor
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: Optional[float] = None
    logits_scaling: float = 1.0
    # Mixture of experts (num_experts=0: dense). A sparse layer routes each token to num_experts_per_tok of
    # num_experts experts of moe_intermediate_size by the router's scoring_func, softmax or sigmoid (a sigmoid's
    # choice adds the checkpoint's e_score_correction_bias and keeps to the topk_group best of n_group groups of
    # experts: DeepSeek-V3's), weighted by the scores (renormalized over the chosen with norm_topk_prob) times
    # routed_scaling_factor. Layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in
    # mlp_only_layers (those run a dense MLP of intermediate_size), as Qwen3-MoE configures.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # A gated MLP of this width beside the routed experts of a sparse layer, for every token; 0: none
    shared_expert_intermediate_size: int = 0
    dtype: DType = DType.auto
    max_model_len: Optional[int] = None
    seed: int = 0
    # A Jinja chat template file used instead of the checkpoint's (chat, /tokenize, the offline LLM's chat); null:
    # the checkpoint's. Requests never bring their own template text.
    chat_template: Optional[str] = None


@dataclass
class QuantizationConfig:
    method: QuantMethod = QuantMethod.none
    # Bits per weight of the quantized linear layers (plan's weight bytes).
    weight_bits: float = 16.0
    # Quantize activations as well (W8A8): fp8 optionally, w8a8_int8 always.
    activations: bool = False
    group_size: int = -1


@dataclass
class EplbConfig:
    # Expert-parallel load balancing: every step_interval steps, replicate the
    # most loaded experts into num_redundant_experts extra slots and repack
    # experts over the ranks by the load of the last window_size steps.
    enabled: bool = False
    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    executor: ParallelExecutor = ParallelExecutor.auto
    # How long the engine waits for the ranks' result of one step before it
    # declares the engine dead (loading may take 600 s, or this if longer).
    step_timeout_s: float = 300.0
    # How CPU ranks on one host run their collectives: shm (shared memory,
    # microseconds each) or gloo (torch.distributed over loopback TCP).
    cpu_collectives: CpuCollectives = CpuCollectives.shm
    # Layers per pipeline stage, e.g. [8, 7, 7, 8] (null: an even split, the
    # remainder to the stages before the last, as vLLM splits).
    pp_layer_partition: Optional[list[int]] = None
    # executor=ray: the cluster to run on. null: start a local Ray instance
    # (stopped with the engine); "auto": the one `ray start` or RAY_ADDRESS
    # names; else an address (host:port, or ray://host:10001 for a client).
    ray_address: Optional[str] = None
    eplb: EplbConfig = field(default_factory=EplbConfig)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    policy: Policy = Policy.fcfs
    enable_chunked_prefill: bool = True
    # Latency objectives for a running stream's inter-token gap, either or
    # both (the token budget of each step then follows them, refitted to
    # measured step times, at most max_num_batched_tokens; neither: every
    # step may use it): a step's time in ms, and a multiple of the running
    # decodes' own step (at least 1 / (1 - min_prefill_share)).
    target_itl_ms: Optional[float] = None
    max_itl_ratio: Optional[float] = None
    # Under an objective a waiting prompt gets at least this share of each
    # step; where it would leave less, the step lasts the decodes' time /
    # (1 - share). 0: one token a step where the decodes overrun it.
    min_prefill_share: float = 0.5


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: KVCacheDType = KVCacheDType.auto
    memory_utilization: float = 0.9
    # Explicit KV pool size; when set it replaces the utilization estimate
    # (the CPU profile uses it, as vLLM's VLLM_CPU_KVCACHE_SPACE does).
    kv_cache_memory_gib: Optional[float] = None
    # Exact number of KV blocks (null block included); overrides both sizes above.
    num_blocks: Optional[int] = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: HashAlgo = HashAlgo.sha256
    swap_space_gib: float = 0.0
    cpu_offload_gib: float = 0.0


@dataclass
class PeakTflops:
    fp32: float = 0.0
    bf16: float = 0.0
    fp16: float = 0.0
    fp8: float = 0.0
    # int8 products (tera-ops a second); 0: the hardware has no int8 dot products the kernels use
    int8: float = 0.0


@dataclass
class HardwareConfig:
    name: str = "???"
    device_kind: DeviceKind = DeviceKind.cpu
    compute_capability: Optional[str] = None
    num_devices: int = 1
    memory_gib: float = 0.0
    memory_bandwidth_gbps: float = 0.0
    # Between ranks (plan estimates only): a collective's bandwidth per rank
    # and the latency of a small one (NVLink / xGMI with NCCL or RCCL;
    # shared memory between a CPU host's ranks). 0: unknown.
    interconnect_gbps: float = 0.0
    collective_latency_us: float = 0.0
    peak_tflops: PeakTflops = field(default_factory=PeakTflops)
    attention_backends: list[str] = field(default_factory=list)
    supported_dtypes: list[str] = field(default_factory=list)
    fp8: bool = False
    min_block_size: int = 1
    max_block_size: int = 1024


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Keys also come from api_key_file (one per line, each a tenant) and the
    # APPLIANCE_API_KEY environment variable; none is ever hashed, logged or shown.
    api_key: Optional[str] = None
    api_key_file: Optional[str] = None
    allow_unauthenticated: bool = False  # listen beyond loopback without a key
    # The secret this deployment's instances and router share (also internal_key_file and the
    # APPLIANCE_INTERNAL_KEY environment variable; never hashed, logged or shown): the router signs the requests
    # it sends with kv_transfer_params, and KV transfer producers and consumers sign their messages with it.
    # kv_transfer=p2p/nixl and router.policy=pd need it.
    internal_key: Optional[str] = None
    internal_key_file: Optional[str] = None
    tenant_isolation: bool = False  # per-key prefix-cache salt
    served_model_name: Optional[str] = None
    max_queue_len: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 600.0
    shutdown_timeout_s: float = 30.0
    # HTTP/1.1 connections: a request's head must arrive within
    # header_timeout_s (of the connection, or of its first byte on a kept-alive
    # one) and its body within body_timeout_s of the head, else 408 and close;
    # an idle kept-alive connection closes after keep_alive_timeout_s. Beyond
    # max_connections open connections requests get 503 (/health, /ready and
    # /metrics excepted).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 2048
    # Prompts longer than this (characters) get 400 before they are tokenized;
    # null: 16 characters per token of the model's max_model_len.
    max_prompt_chars: Optional[int] = None
    tokenizer_threads: int = 2  # tokenization and chat templates run here, off the event loop
    # Engine-core supervision: a core that dies is started again after
    # core_restart_backoff_s, doubled for each restart in the last
    # core_restart_window_s; when max_core_restarts there have not kept it up
    # the server exits 1. A (re)start slower than core_start_timeout_s fails.
    max_core_restarts: int = 3
    core_restart_window_s: float = 600.0
    core_restart_backoff_s: float = 1.0
    core_start_timeout_s: float = 600.0
    # A running core's step loop sends a heartbeat between steps and while
    # idle; one not heard from for this long is unresponsive (frozen, or stuck
    # in a step): /health and /ready answer 503 until it is heard again. It is
    # not restarted (that is the orchestrator's call, on /health). Keep it above
    # the longest step, a prefill chunk of scheduler.max_num_batched_tokens on
    # this host, or a long step reads as a stuck core; the default is
    # parallel.step_timeout_s's, the longest step a multi-rank executor waits for.
    core_heartbeat_timeout_s: float = 300.0
    cors_origins: list[str] = field(default_factory=list)
    dev_mode: bool = False
    # How tool calls are read from the model's text under tool_choice=auto:
    # hermes (<tool_call>{...}</tool_call>, Qwen and SmolLM-style templates) or
    # llama3_json ({"name": ..., "parameters": ...}, Llama 3.x); auto: the model's own (messages to
    # functions.NAME on a harmony model, gpt-oss; hermes otherwise).
    tool_parser: ToolParser = ToolParser.auto
    # A thinking model's <think>...</think> text returned apart, as chat's reasoning_content (server/reasoning.py):
    # deepseek_r1 (the output opens in reasoning) or qwen3 (only an output that opens with <think>); output
    # constraints then apply to the answer after </think>. null: the text is all content (a harmony model's
    # analysis channel is its reasoning whatever this says: it takes none).
    reasoning_parser: Optional[ReasoningParserName] = None
    # The Responses API's stored responses (store, previous_response_id, GET/DELETE /v1/responses/{id}), per API
    # key, in the server's memory: at most this many, and this many MiB, the least recently used dropped first.
    # 0: nothing is stored (store: true is refused).
    responses_store_max: int = 1000
    responses_store_mib: int = 64
    # OpenTelemetry: an OTLP/HTTP collector's URL (http://host:4318, /v1/traces implied) to export a span per
    # request to, with the engine core's timings; null: no tracing. Needs the tracing extra.
    otlp_traces_endpoint: Optional[str] = None


@dataclass
class SpeculativeConfig:
    method: SpecMethod = SpecMethod.off
    num_speculative_tokens: int = 0  # k: draft tokens proposed per step
    # ngram: the lengths of context suffix looked up; when neither is set both are 5, when one is the other copies it
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    disable_by_batch_size: Optional[int] = None  # no drafts while more than this many requests run
    # draft_model: a model option or local checkpoint sharing the target's tokenizer, and the dtype it runs at
    # (auto: the target's)
    draft_model: Optional[str] = None
    draft_dtype: DType = DType.auto


@dataclass
class StructuredOutputConfig:
    """Output constraints (response_format, structured_outputs, forced tool calls)."""

    backend: StructuredBackend = StructuredBackend.xgrammar
    # grammars compile on these threads, off the step loop; as many of the server's trial compiles run at once
    num_threads: int = 2
    cache_size_mib: int = 512  # compiled grammars kept, least recently used dropped first
    # JSON constraints without free whitespace between tokens, unless a request says otherwise
    disable_any_whitespace: bool = False
    # otherwise at most this many whitespace characters between two JSON tokens (null: any number), so a
    # model cannot pad its JSON with whitespace until max_tokens
    max_json_whitespace: Optional[int] = 16
    # What one request's constraint may cost; over a limit is a 400 naming the key and the request's field.
    # Its size in UTF-8 bytes (a JSON schema's text, a regex, a grammar, the choices together), checked
    # before anything parses it: tool and response schemas are a few KB, a forced call over dozens of tools
    # tens of KB; 256 KiB (8,000 properties) compiles in about 3 s, where 1.8 MB (12,000) took 18 s and 0.5 GB
    max_schema_bytes: int = 262144
    # a JSON schema's nesting in objects and arrays (the schema is level 1): as deep as a request body may
    # nest at all; xgrammar's schema conversion grows with its cube (64 levels ~10 ms, 200 ~1 s, 400 ~7 s)
    max_schema_depth: int = 64
    # The server compiles each new constraint first in a child process, and the engine compiles only what
    # finished there: past this many seconds the child is killed (a 400); real schemas take milliseconds,
    # 256 KiB of properties a few seconds, so 10 s leaves room on a slower or busier host ...
    compile_timeout_s: float = 10.0
    # ... and past this much address space (heap and thread stacks, above the child's own) it is refused,
    # which bounds the memory the engine's own compile of it takes (once per compiling thread); compiled
    # grammars of real schemas are a few MiB, a 256 KiB schema's some tens
    compile_memory_mib: int = 1024


@dataclass
class AttentionConfig:
    # "auto" walks hardware.attention_backends; a backend name forces it.
    backend: str = "auto"
    fallback: Fallback = Fallback.deny


@dataclass
class KVEventsConfig:
    # Publish the KV cache's block events over ZeroMQ in vLLM's format (for
    # KV-aware routers): a PUB socket at endpoint, the last buffer_steps
    # batches replayable from replay_endpoint (null: no replay); engine core
    # r of a data-parallel deployment binds port + r.
    enabled: bool = False
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: Optional[str] = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000  # the PUB socket's send high-water mark (messages)
    max_queue_size: int = 100_000  # steps queued for the publishing thread before events are dropped
    # BlockStored events carry their blocks' token ids (what a KV-aware router matches prompts with; they decode
    # to the prompts' text) only when true; with server.tenant_isolation only if token_ids_with_tenants is true
    # too, since every subscriber then reads every tenant's prompts.
    include_token_ids: bool = False
    token_ids_with_tenants: bool = False
    # ZeroMQ CURVE on both sockets: this publisher's certificate (a secret key file made by
    # zmq.auth.create_certificates, "<name>.key_secret") and a folder of the public certificates ("*.key") of the
    # subscribers allowed to connect; others are refused and nothing is sent in the clear. Both or neither.
    curve_secret_key_file: Optional[str] = None
    curve_authorized_keys: Optional[str] = None
    # An endpoint other machines can reach (not loopback, not ipc) needs CURVE, unless this is true.
    allow_unauthenticated: bool = False


@dataclass
class KVOffloadConfig:
    # The offload connector's tier. medium: disk (a folder on local disk: path, null for kv_offload under the
    # appliance's cache folder, $APPLIANCE_CACHE_DIR or ~/.cache/appliance; one subfolder per model and KV
    # layout, so a restart finds its blocks again), host (host memory, pinned on GPUs; gone with the process),
    # or auto (host on GPU profiles, disk on CPU ones). At most max_gib of blocks, least recently used dropped
    # first.
    medium: str = "auto"
    path: Optional[str] = None
    max_gib: float = 16.0


@dataclass
class KVP2PConfig:
    # Disaggregated prefill over ZeroMQ/TCP (connector p2p). A producer listens on bind_host:port and tells
    # consumers to fetch from host:port (null: bind_host); it holds a finished prefill's blocks for timeout_s
    # (freed once fetched), and a consumer gives up on a fetch after timeout_s (and computes the prompt).
    host: Optional[str] = None
    bind_host: str = "127.0.0.1"
    port: int = 14579
    timeout_s: float = 120.0
    # A consumer acts on a request's kv_transfer_params when the request comes from this deployment's router
    # (signed with server.internal_key) or names one of these producers: "host:port" ("[v6addr]:port"), or a
    # host alone for any of its ports (a data-parallel producer's cores answer on port + r x ranks). Others: 400.
    trusted_producers: list[str] = field(default_factory=list)


@dataclass
class KVNixlConfig:
    # Disaggregated prefill over NIXL (connector nixl): the consumer reads the producer's blocks straight from
    # its KV cache (GPU or host memory) through these NIXL backends; the p2p keys give the side channel where
    # a consumer asks a producer for a transfer's blocks and releases them (ZeroMQ/TCP, a few hundred bytes).
    backends: list[str] = field(default_factory=lambda: ["UCX"])


@dataclass
class KVTransferConfig:
    # A KV connector (vLLM V1's two-sided interface): null for none; "offload" (full blocks saved to a
    # second tier keyed by block hash as they fill; a prefix found there loads instead of recomputing); or
    # "p2p" (disaggregated prefill: a producer's finished prefill is fetched by a consumer, which decodes,
    # the blocks sent over ZeroMQ/TCP) or "nixl" (the same, the consumer reading the blocks through NIXL).
    # role: producer | consumer | both (disaggregated prefill's roles; an offload tier is both).
    connector: Optional[str] = None
    role: str = "both"
    offload: KVOffloadConfig = field(default_factory=KVOffloadConfig)
    p2p: KVP2PConfig = field(default_factory=KVP2PConfig)
    nixl: KVNixlConfig = field(default_factory=KVNixlConfig)


@dataclass
class RouterConfig:
    # `appliance route`: an OpenAI-compatible front over appliance instances (base URLs). policy:
    # round_robin | least_load (their /metrics) | kv_aware (their KV events, kv_events: one ZeroMQ endpoint
    # per instance, in order; where an instance holds kv_match_threshold of a prompt, a cached prefix of
    # kv_load_weight tokens outweighs one request in flight; below it, new prefixes go where least is cached).
    # pd: disaggregated prefill, each prompt prefilled on one of prefill_instances (kv_transfer=p2p producers),
    # then decoded by one of instances (consumers) that fetches its KV.
    policy: str = "round_robin"
    instances: list[str] = field(default_factory=list)
    prefill_instances: list[str] = field(default_factory=list)
    kv_events: list[str] = field(default_factory=list)
    # kv_aware: each instance's KV events replay endpoint, in order (empty: none); batches the router missed
    # (before it joined, or dropped) are asked for again there
    kv_events_replay: list[str] = field(default_factory=list)
    # kv_aware with instances that publish over CURVE (kv_events.curve_*): the router's certificate (its secret key
    # file, whose public half is in the instances' curve_authorized_keys) and the instances' publisher
    # certificate (its public key file). Both or neither.
    kv_events_client_key_file: Optional[str] = None
    kv_events_server_key_file: Optional[str] = None
    kv_load_weight: float = 256.0
    kv_match_threshold: float = 0.5
    host: str = "127.0.0.1"
    port: int = 8080
    health_interval_s: float = 2.0
    request_timeout_s: float = 600.0


@dataclass
class ApplianceConfig:
    profile: str = "none"
    model: ModelConfig = field(default_factory=ModelConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)


def register() -> None:
    ConfigStore.instance().store(name="appliance_schema", node=ApplianceConfig)
