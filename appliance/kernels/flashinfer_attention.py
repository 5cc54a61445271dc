"""FlashInfer over our paged KV cache (the Blackwell profiles' backend).

One ``BatchPrefillWithPagedKVCacheWrapper`` serves the whole mixed batch
(a decode is a query of length 1), planned once per step on the host from
the CSR form of our block table and run per layer:

    qo_indptr              = query_start_loc                     [num_reqs + 1]
    paged_kv_indptr        = prefix sums of pages per request    [num_reqs + 1]
    paged_kv_indices       = the requests' block ids, concatenated
    paged_kv_last_page_len = seq_len - (pages - 1) * page_size   [num_reqs], in 1..page_size

The K and V pools are passed as a tuple in NHD layout
([num_blocks, block_size, num_kv_heads, head_dim] each); causal masking in
FlashInfer aligns the query's end with the KV end, which is our
"prefix visible, causal inside the chunk" rule. fp8 KV is written scaled by
1/k_scale and passed with ``k_scale``/``v_scale``; a layer's attention sinks
(gpt-oss's) as ``run(sinks=...)``, fp32 per head, which flashinfer-python
takes from the versions that have them (the provider probe checks). Chunked
local attention (``attention_chunk``), which the wrapper does not take, is
planned as causal attention over the step's virtual batch
(``local_attention``). The kernel runs only on CUDA; the metadata builder is
plain torch and is tested on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from appliance.kernels.base import AttentionBackend, CommonAttentionMetadata
from appliance.kernels.local_attention import virtual_batches

WORKSPACE_BYTES = 128 * 1024 * 1024
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass
class FlashInferMetadata:
    common: CommonAttentionMetadata
    qo_indptr: torch.Tensor
    paged_kv_indptr: torch.Tensor
    paged_kv_indices: torch.Tensor
    paged_kv_last_page_len: torch.Tensor


def build_csr(common: CommonAttentionMetadata) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len) as int32 arrays."""
    bs = common.block_size
    seq_lens = np.asarray(common.seq_lens_cpu, dtype=np.int64)
    pages = -(-seq_lens // bs)
    kv_indptr = np.zeros(common.num_reqs + 1, dtype=np.int32)
    np.cumsum(pages, out=kv_indptr[1:])
    table = common.block_table.cpu().numpy()
    mask = np.arange(table.shape[1])[None, :] < pages[:, None]
    indices = table[mask].astype(np.int32)  # row-major: request by request, in block order
    last = (seq_lens - (pages - 1) * bs).astype(np.int32)
    return np.asarray(common.query_start_loc_cpu, dtype=np.int32), kv_indptr, indices, last


@dataclass
class _WrapperState:
    workspace: Optional[torch.Tensor] = None
    wrapper: Optional[Any] = None
    planned_for: Optional[int] = None  # id of the metadata the wrapper is planned for


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    kv_dtypes = FP8_DTYPES

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the wrapper and its plan, shared with the copies layers with their own KV scales hold
        self._shared = _WrapperState()

    def _get_wrapper(self, device: torch.device) -> Any:
        st = self._shared
        if st.wrapper is None:
            import flashinfer

            st.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            st.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(st.workspace, "NHD")
        return st.wrapper

    def build_metadata(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        common = virtual_batches(common)  # chunked local attention: causal over the virtual batch
        qo, kv_indptr, indices, last = build_csr(common)
        dev = common.block_table.device
        md = FlashInferMetadata(
            common,
            torch.from_numpy(qo).to(dev),
            torch.from_numpy(kv_indptr).to(dev),
            torch.from_numpy(indices).to(dev),
            torch.from_numpy(last).to(dev),
        )
        self._shared.planned_for = None  # plan lazily on the first layer, with the real dtypes
        return md

    def _plan(self, md: FlashInferMetadata, q_dtype: torch.dtype, kv_dtype: torch.dtype, sinks: bool) -> None:
        w = self._get_wrapper(md.qo_indptr.device)
        if sinks:  # stashed as vLLM does, so "auto" plans a kernel that takes them (not cuDNN's paged prefill)
            w._sinks = True
        w.plan(
            md.qo_indptr, md.paged_kv_indptr, md.paged_kv_indices, md.paged_kv_last_page_len,
            self.num_heads, self.num_kv_heads, self.head_dim, md.common.block_size,
            causal=True, sm_scale=self.scale, q_data_type=q_dtype, kv_data_type=kv_dtype,
            window_left=(md.common.sliding_window or 0) - 1,  # -1: no window; else the keys before a token
            logits_soft_cap=self.soft_cap,
        )
        self._shared.planned_for = id(md)

    def forward(self, q, k, v, kv_cache, md: FlashInferMetadata, sinks=None):
        fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        self.write_kv(k, v, kv_cache, md.common.slot_mapping)
        if self._shared.planned_for != id(md):
            self._plan(md, q.dtype, kv_cache.dtype, sinks is not None)
        kw: dict[str, Any] = {"k_scale": self.k_scale, "v_scale": self.v_scale} if fp8 else {}
        if sinks is not None:  # a logit per head beside the scaled scores in each softmax (fp32 [num_heads])
            kw["sinks"] = sinks.to(torch.float32).contiguous()
        return self._shared.wrapper.run(q.contiguous(), (kv_cache[0], kv_cache[1]), **kw)
