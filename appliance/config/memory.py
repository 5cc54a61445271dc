"""One device's memory, computed without a GPU: the one account that
validation, the plan and the engine's KV pool read.

All figures are per device (one tensor/pipeline shard; a CPU host's rank)
unless named otherwise. Memory model, in the order vLLM's worker sizes the
KV pool:

    usable      = memory_gib * memory_utilization      (or cache.kv_cache_memory_gib)
                  (a CPU host's ranks share it: divided by tp x pp x dp)
    kv_bytes    = usable - weight_bytes - activation_bytes
    num_blocks  = kv_bytes // (block_size * kv_bytes_per_token)
                  (kv_bytes_per_token: a block slot's bytes, over the cache tensors
                  its KV-cache groups share, see kv_groups.py)

``activation_bytes`` is an estimate of the forward pass's peak for one
``max_num_batched_tokens`` step; vLLM measures it with a profiling run and
the model runner does the same at start-up where it can.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any, Optional

from appliance.config.checkpoint import gguf_file
from appliance.config.execution import kv_dtype
from appliance.config.gguf_header import gguf_embedding_in_head, gguf_head_bits, gguf_header
from appliance.config.kv_groups import kv_layout
from appliance.config.quantization import method_of, mxfp4_dequantized_share
from appliance.config.schema import ApplianceConfig, ModelConfig
from appliance.config.sizes import parameter_counts, pipeline_partition, sparse_layers
from appliance.kernels.registry import BACKENDS

GIB = 1024**3

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_DTYPE_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1}


def weight_bytes(cfg: ApplianceConfig, dtype: str) -> int:
    """Bytes of all weights (before sharding).

    Quantized methods store the decoder's linear layers at
    ``quantization.weight_bits`` plus their group parameters (gguf's
    weight_bits already counts them: the file's own widths as loaded, see
    ``gguf_header.gguf_projection_bits``); embeddings, the LM head and norms
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
    if row.expert_bits:  # experts kept in the checkpoint's format (but a share dequantized), the rest float
        kept = int(counts["experts"] * (1 - mxfp4_dequantized_share(cfg)))
        return int(kept * row.expert_bits / 8) + (counts["total"] - kept) * full
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
    width (gguf; ``gguf_header.gguf_head_bits``). None: the head is in the
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
    (``gguf_header.gguf_embedding_in_head``)."""
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
    the cache tensors of its stage's layers (config/kv_groups.py), or
    (``whole``: a draft model each rank holds) a tensor for each of its layers."""
    if whole:
        return m.num_layers * kv_layer_bytes(cfg, m, dtype, whole=True)
    layout = kv_layout(m, max_model_len(cfg))
    sizes = pipeline_partition(m.num_layers, cfg.parallel.pipeline_parallel_size, cfg.parallel.pp_layer_partition)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    tensors = max(layout.tensors_of(range(a, a + n)) for a, n in zip(starts, sizes))  # the stage holding the most
    return tensors * kv_layer_bytes(cfg, m, dtype)


def kv_layer_bytes(cfg: ApplianceConfig, m: ModelConfig, dtype: str, whole: bool = False) -> int:
    """K and V of one layer for one token on one device: its share of the KV heads (all of them: ``whole``)."""
    tp = 1 if whole else cfg.parallel.tensor_parallel_size
    kv_heads = max(1, m.num_kv_heads // tp)  # kv heads replicate when tp > num_kv_heads
    elem = KV_DTYPE_BYTES.get(kv_dtype(cfg, dtype), DTYPE_BYTES.get(kv_dtype(cfg, dtype), 2))
    return 2 * kv_heads * m.head_dim * elem


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


def max_model_len(cfg: ApplianceConfig) -> int:
    """``model.max_model_len``, else the model's positions."""
    return cfg.model.max_model_len or cfg.model.max_position_embeddings


def blocks_per_request(cfg: ApplianceConfig) -> int:
    """Blocks of the pool one request of ``max_model_len`` tokens holds at
    most, over every KV-cache group (a sliding window's group holds its
    window and a step's chunk)."""
    layout = kv_layout(cfg.model, max_model_len(cfg))
    return sum(layout.blocks_per_request(max_model_len(cfg), cfg.cache.block_size,
                                         cfg.scheduler.max_num_batched_tokens))


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
