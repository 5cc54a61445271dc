"""The attention backend interface (three parts, after vLLM's v1 backends).

1. Capabilities live in ``registry.BACKENDS`` (data, no kernel import).
2. A metadata builder turns the step's common metadata into what the
   kernel wants (``build_metadata``), once per step for all layers.
3. An impl runs ``forward(q, k, v, kv_cache, metadata)`` per layer: it
   writes the step's K/V into the paged cache at ``slot_mapping`` and then
   attends over each request's whole context, or the last
   ``metadata.sliding_window`` positions of it (a sliding-window KV-cache
   group's), or only each token's own chunk of ``metadata.attention_chunk``
   positions (a chunked-local-attention group's, Llama 4's), its scores
   soft-capped where the backend has a ``soft_cap``,
   its softmax over each head's attention sink too where the layer has them.

KV cache layout, one tensor per layer (layers of different KV-cache groups
may share one, each at its own group's blocks):

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
             K/V

so ``kv_cache[0]`` and ``kv_cache[1]`` are contiguous key and value pools
(the separate-K/V form FlashAttention and FlashInfer accept) and a token's
slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


@dataclass
class CommonAttentionMetadata:
    """Per-step batch description shared by every backend.

    Tokens of all scheduled requests are flattened in request order;
    request i owns tokens ``query_start_loc[i]:query_start_loc[i+1]``,
    which sit at positions ``num_computed_tokens[i] ...`` of its sequence;
    ``seq_lens[i] = num_computed_tokens[i] + query_len[i]``.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    num_computed_tokens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_size: int
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends that loop or plan on the CPU.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # The layers of this metadata's KV-cache group attend to the last sliding_window positions only (a token
    # at position p to keys p - sliding_window + 1 .. p); their blocks before that may be another's or the
    # null block, never to be read. None: full attention.
    sliding_window: Optional[int] = None
    # The layers of this metadata's KV-cache group attend within their chunk only (chunked local attention,
    # Llama 4's): a token at position p to keys p - p % attention_chunk .. p; their blocks before that chunk may
    # be another's or the null block, never to be read. None: no chunks. A group has a window or chunks, not both.
    attention_chunk: Optional[int] = None


class AttentionBackend:
    name = "base"
    # kv_cache_dtype names this backend stores besides "auto" (the model dtype).
    kv_dtypes: dict[str, torch.dtype] = {}
    # A backend that runs a whole step in one native call sets this and
    # implements build_native_forward; the ModelRunner then calls that
    # instead of the model's forward.
    native_forward = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, kv_cache_dtype: str = "auto",
                 k_scale: float = 1.0, v_scale: float = 1.0, soft_cap: Optional[float] = None):
        self.num_heads = num_heads
        # soft-capped scores (Gemma 2's attn_logit_softcapping): soft_cap * tanh(score / soft_cap); None: plain
        self.soft_cap = soft_cap
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache_dtype = kv_cache_dtype
        # Per-tensor fp8 scales: the cache holds k / k_scale (vLLM's default scale is 1.0). A layer with
        # its own (a checkpoint's) holds a shallow copy of the backend (Attention.set_kv_scales), so
        # state a backend builds per step must live in an object the copies share.
        self.k_scale, self.v_scale = k_scale, v_scale

    @classmethod
    def cache_dtype(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
        """Element type of the KV cache ("auto" keeps the model's dtype)."""
        if kv_cache_dtype == "auto" or getattr(torch, kv_cache_dtype, None) == model_dtype:
            return model_dtype
        if kv_cache_dtype not in cls.kv_dtypes:
            raise ValueError(f"the {cls.name} backend has no {kv_cache_dtype} KV cache")
        return cls.kv_dtypes[kv_cache_dtype]

    def build_native_forward(self, model: torch.nn.Module) -> Callable[..., Optional[torch.Tensor]]:
        """The whole-step forward of ``model`` (backends with ``native_forward``)."""
        raise NotImplementedError(f"the {self.name} backend has no native forward")

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        return common

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the step's K/V, scaled into an fp8 cache when it is one."""
        if kv_cache.dtype in FP8_DTYPES:
            write_kv(kv_cache, to_fp8(k.float() / self.k_scale, kv_cache.dtype),
                     to_fp8(v.float() / self.v_scale, kv_cache.dtype), slot_mapping)
        else:
            write_kv(kv_cache, k, v, slot_mapping)

    def read_kv(self, x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
        """Cached K or V (``scale``: k_scale or v_scale) as ``dtype``."""
        return x.to(dtype) * scale if x.dtype in FP8_DTYPES else x.to(dtype)

    def as_cached(self, x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
        """``x`` as the cache would return it: rounded to the cache's dtype (and fp8 scale)."""
        if cache_dtype in FP8_DTYPES:
            return to_fp8(x.float() / scale, cache_dtype).to(x.dtype) * scale
        return x.to(cache_dtype).to(x.dtype) if cache_dtype != x.dtype else x

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> out [T, H, D]. ``sinks`` [H] (a layer's attention sinks, gpt-oss's):
        each head's learned logit joins the softmax's denominator, with no value."""
        raise NotImplementedError


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 to an fp8 dtype, round to nearest even, saturating at the largest
    finite value (torch's e5m2 cast would overflow to infinity)."""
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter the step's K/V into the paged cache (the reference path)."""
    _, nb, bs, kvh, hd = kv_cache.shape
    kv_cache[0].view(nb * bs, kvh, hd)[slot_mapping] = k.to(kv_cache.dtype)
    kv_cache[1].view(nb * bs, kvh, hd)[slot_mapping] = v.to(kv_cache.dtype)
