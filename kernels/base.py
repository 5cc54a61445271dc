"""The attention backend interface (three parts, after vLLM's v1 backends).

1. Capabilities live in ``registry.BACKENDS`` (data, no kernel import).
2. A metadata builder turns the step's common metadata into what the
   kernel wants (``build_metadata``), once per step for all layers.
3. An impl runs ``forward(q, k, v, kv_cache, metadata)`` per layer: it
   writes the step's K/V into the paged cache at ``slot_mapping`` and then
   attends over each request's whole context.

KV cache layout, one tensor per layer:

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
             K/V

so ``kv_cache[0]`` and ``kv_cache[1]`` are contiguous key and value pools
(the separate-K/V form FlashAttention and FlashInfer accept) and a token's
slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


class AttentionBackend:
    name = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, kv_cache_dtype: str = "auto"):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache_dtype = kv_cache_dtype

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        return common

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> out [T, H, D]."""
        raise NotImplementedError


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter the step's K/V into the paged cache (the reference path)."""
    _, nb, bs, kvh, hd = kv_cache.shape
    kv_cache[0].view(nb * bs, kvh, hd)[slot_mapping] = k.to(kv_cache.dtype)
    kv_cache[1].view(nb * bs, kvh, hd)[slot_mapping] = v.to(kv_cache.dtype)
