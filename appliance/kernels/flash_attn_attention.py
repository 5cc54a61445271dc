"""FlashAttention-3 over our paged KV cache (the Hopper profiles' backend).

The first FA3 build that serves the deployment is used (``providers.probe``:
it imports, has the kernel, and was built with paged KV and the dtypes
needed), probed in this order and reported by ``appliance plan``: the FA3
``flash_attn_interface`` (hopper/ build of flash-attention), the PyPI
``fa3-fwd`` package, ``sgl-kernel``'s FA3. All
expose ``flash_attn_with_kvcache`` taking a varlen query:

    q             [num_tokens, num_heads, head_dim]   flattened batch
    k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]
    cache_seqlens = seq_lens                           [num_reqs] int32
    page_table    = block_table                        [num_reqs, max_blocks] int32
    cu_seqlens_q  = query_start_loc, max_seqlen_q = max query length
    causal=True   (aligned to the end of the KV: prefix visible)

fp8 KV passes per-(request, kv head) descale factors. Chunked local
attention (``attention_chunk``), which the kernel does not take, runs as
causal attention over the step's virtual batch (``local_attention``): the
metadata describes that batch. The kernel runs only on SM90; the metadata
is plain torch and is tested on CPU.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from appliance.kernels.base import AttentionBackend, CommonAttentionMetadata
from appliance.kernels.local_attention import virtual_batches
from appliance.kernels.providers import attention_needs, first_usable
from appliance.kernels.registry import BACKENDS

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}


def load_fa3(dtype: torch.dtype, kv_cache_dtype: str) -> tuple[str, Callable]:
    """(module name, flash_attn_with_kvcache) of the first FA3 build that serves ``dtype`` queries over a
    paged ``kv_cache_dtype`` cache."""
    needs = attention_needs("flash_attn3", str(dtype).removeprefix("torch."), kv_cache_dtype)
    module, rejected = first_usable(BACKENDS["flash_attn3"].probe_modules, needs)
    if module is None:
        raise ImportError("no usable FlashAttention-3 build: " + " | ".join(rejected))
    return module, importlib.import_module(module).flash_attn_with_kvcache


@dataclass
class FA3Metadata:
    common: CommonAttentionMetadata
    cu_seqlens_q: torch.Tensor  # int32 [num_reqs + 1]
    cache_seqlens: torch.Tensor  # int32 [num_reqs]
    page_table: torch.Tensor  # int32 [num_reqs, max_blocks_needed]
    max_seqlen_q: int


def build_fa3_metadata(common: CommonAttentionMetadata) -> FA3Metadata:
    """The kernel's arguments for ``common`` (its virtual batch where it has chunks, which ``common`` of the
    result then is)."""
    common = virtual_batches(common)
    max_blocks = -(-common.max_seq_len // common.block_size)
    return FA3Metadata(
        common,
        common.query_start_loc.to(torch.int32),
        common.seq_lens.to(torch.int32),
        common.block_table[:, :max_blocks].to(torch.int32).contiguous(),
        common.max_query_len,
    )


class FlashAttn3Backend(AttentionBackend):
    name = "flash_attn3"

    kv_dtypes = FP8_DTYPES

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fn: Optional[Any] = None
        self.provider: Optional[str] = None

    def build_metadata(self, common: CommonAttentionMetadata) -> FA3Metadata:
        return build_fa3_metadata(common)

    def forward(self, q, k, v, kv_cache, md: FA3Metadata, sinks=None):
        if sinks is not None:
            raise ValueError(f"the {self.name} backend does not take attention sinks; torch_sdpa, cpu_native and "
                             f"triton do")
        if self._fn is None:
            self.provider, self._fn = load_fa3(q.dtype, self.kv_cache_dtype)
        fp8 = kv_cache.dtype == torch.float8_e4m3fn
        self.write_kv(k, v, kv_cache, md.common.slot_mapping)
        kw: dict[str, Any] = {}
        if fp8:
            shape = (md.common.num_reqs, self.num_kv_heads)
            kw = {
                "q_descale": torch.ones(shape, dtype=torch.float32, device=q.device),
                "k_descale": torch.full(shape, self.k_scale, dtype=torch.float32, device=q.device),
                "v_descale": torch.full(shape, self.v_scale, dtype=torch.float32, device=q.device),
            }
            q = q.to(torch.float8_e4m3fn)
        if md.common.sliding_window:  # a token attends to itself and the window - 1 before it
            kw["window_size"] = (md.common.sliding_window - 1, 0)
        if self.soft_cap:
            kw["softcap"] = self.soft_cap
        out = self._fn(
            q, kv_cache[0], kv_cache[1],
            cache_seqlens=md.cache_seqlens, page_table=md.page_table,
            cu_seqlens_q=md.cu_seqlens_q, max_seqlen_q=md.max_seqlen_q,
            softmax_scale=self.scale, causal=True, **kw,
        )
        out = out[0] if isinstance(out, tuple) else out
        return out.to(k.dtype) if fp8 else out
