"""Triton unified paged attention: one varlen kernel for a mixed batch of
prefill chunks and decodes, plus the kernel that writes K/V into the cache.

Work decomposition (grid = (num_q_tiles, num_kv_heads)):
    a tile is up to BLOCK_Q consecutive query tokens of one request; the
    program processes them for all NUM_QPKV query heads that share one KV
    head (GQA grouping), as BLOCK_M = BLOCK_Q * QPKV_PAD rows, and walks the
    request's KV blocks with an online softmax. Row m is query token
    m // QPKV_PAD of the tile, head kv_head * NUM_QPKV + m % QPKV_PAD.
Masking: key position k is visible to query position p iff k <= p, with
    p = (seq_len - query_len) + query index: the computed prefix is fully
    visible, causal inside the chunk; with a sliding window (window > 0) also
    k > p - window, with chunked local attention (chunk > 0) k >= p - p % chunk.
    A tile walks the KV from the tile holding the first key its first query
    sees, so blocks wholly before a window or chunk are never read.
HEAD_DIM is padded to a power of two (HEAD_DIM_PAD) and masked, so any head
size in the registry's range works (16 ... 256 in steps of 8).
KV is read in tiles of TILE_N keys, a power of two dividing the block size: the
whole block where its K and V tiles fit in the device's shared memory, else
smaller tiles (``registry.triton_kv_tile``; a 256-token block of head dim 256
would need more than an H100 has).
fp8 (e4m3) KV is stored scaled by 1/k_scale (1/v_scale) and dequantized in
the kernel. Under TRITON_INTERPRET=1 the kernels run on the CPU (the cpu
profile with attention.backend=triton); loads are upcast to fp32, because the
interpreter's bf16 arithmetic is wrong. INTERPRET is read at import, when
Triton also decides whether the kernels are wrapped for the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from appliance.kernels.base import AttentionBackend, CommonAttentionMetadata
from appliance.kernels.registry import (TRITON_MAX_BLOCK_M, pow2, triton_block_m, triton_interpreter_on,
                                        triton_kv_tile)

INTERPRET = triton_interpreter_on()


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    k_scale, v_scale,
    NUM_KV_HEADS: tl.constexpr, KVH_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, KVH_PAD)[:, None]
        d = tl.arange(0, HEAD_DIM_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
        dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
        if FP8:
            k = (k.to(tl.float32) / k_scale).to(k_cache_ptr.dtype.element_ty)
            v = (v.to(tl.float32) / v_scale).to(v_cache_ptr.dtype.element_ty)
        else:
            k = k.to(k_cache_ptr.dtype.element_ty)
            v = v.to(v_cache_ptr.dtype.element_ty)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _first_key(q_pos, window, chunk):
    """The first key position a query at ``q_pos`` sees: the start of its sliding window (window > 0), of its
    chunk (chunk > 0: chunked local attention), else 0."""
    first = tl.where(chunk > 0, q_pos - q_pos % tl.maximum(chunk, 1), 0)
    return tl.maximum(first, tl.where(window > 0, q_pos - window + 1, 0))


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr,
    block_table_ptr, seq_lens_ptr, qsl_ptr, tile_req_ptr, tile_q_ptr,
    scale, k_scale, v_scale, window, chunk, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_QPKV: tl.constexpr, QPKV_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    FP8: tl.constexpr, UPCAST: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    q_tile_start = tl.load(tile_q_ptr + tile)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    prefix = seq_len - q_len

    m = tl.arange(0, BLOCK_M)
    q_idx = q_tile_start + m // QPKV_PAD
    head_in_group = m % QPKV_PAD
    row_ok = (q_idx < q_len) & (head_in_group < NUM_QPKV)
    head = kvh * NUM_QPKV + head_in_group
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q_off = (q_start + q_idx)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + q_idx

    if HAS_SINKS:  # each head's sink logit starts the running softmax: its max, and e^0 in the sum, no value
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        l_i = tl.where(row_ok, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    last_q = tl.minimum(q_tile_start + BLOCK_Q, q_len) - 1
    num_tiles = (prefix + last_q) // TILE_N + 1
    q_first = _first_key(q_pos, window, chunk)  # each row's first visible key: its window's or chunk's start
    first_tile = _first_key(prefix + q_tile_start, window, chunk) // TILE_N  # that of the tile's first query
    n = tl.arange(0, TILE_N)
    for j in range(first_tile, num_tiles):
        first = j * TILE_N
        phys = tl.load(block_table_ptr + req * stride_bt + first // BLOCK_SIZE).to(tl.int64)
        slot = first % BLOCK_SIZE + n
        k_pos = first + n
        k_ok = k_pos < seq_len
        kv_off = phys * stride_cb + slot[None, :] * stride_cs + kvh * stride_ch + d[:, None]
        k = tl.load(k_cache_ptr + kv_off, mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [D, TILE_N]
        v_off = phys * stride_cb + slot[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        v = tl.load(v_cache_ptr + v_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, D]
        if FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k) * scale
        if softcap > 0:  # soft-capped scores: softcap * tanh(s / softcap), tanh from one exp
            t = tl.exp(-2.0 * tl.abs(s / softcap))
            s = tl.where(s < 0, -softcap, softcap) * (1.0 - t) / (1.0 + t)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        visible = visible & (k_pos[None, :] >= q_first[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_off = (q_start + q_idx)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def shared_memory_target(device: torch.device) -> Optional[str]:
    """The registry's name of ``device``'s target ("9.0", "gfx942"); None under the interpreter."""
    if INTERPRET or device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        return getattr(props, "gcnArchName", "").split(":")[0]
    return f"{props.major}.{props.minor}"


def kv_tile_for(device: torch.device, block_size: int, head_dim: int, dtype: torch.dtype, block_m: int) -> int:
    tile = triton_kv_tile(block_size, head_dim, dtype.itemsize, block_m, shared_memory_target(device))
    if not tile:
        raise RuntimeError(f"the Triton attention kernel does not fit head_dim {head_dim} in {dtype} in the shared "
                           f"memory of {device} (the registry refuses this configuration)")
    return tile


@dataclass
class TritonMetadata:
    common: CommonAttentionMetadata
    tile_req: torch.Tensor  # [num_tiles] int32: request of each query tile
    tile_q: torch.Tensor  # [num_tiles] int32: first query index of the tile within its request
    block_q: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    kv_dtypes = {"fp8_e4m3": torch.float8_e4m3fn}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.qpkv = self.num_heads // self.num_kv_heads
        self.qpkv_pad = pow2(self.qpkv)
        self.fp8 = self.kv_cache_dtype in self.kv_dtypes
        self._tiles: dict[tuple, int] = {}  # (device, block size, dtype) -> keys per KV tile

    def block_q_for(self, max_query_len: int) -> int:
        # BLOCK_M = BLOCK_Q * QPKV_PAD rows: at least 16 for tl.dot on GPUs, at most 64.
        want = max(1, 16 // self.qpkv_pad)
        cap = max(1, TRITON_MAX_BLOCK_M // self.qpkv_pad)
        return min(max(want, pow2(max_query_len)), cap) if not INTERPRET else max(1, min(pow2(max_query_len), 4))

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonMetadata:
        qsl = np.asarray(common.query_start_loc_cpu, dtype=np.int64)
        q_lens = qsl[1:] - qsl[:-1]
        block_q = self.block_q_for(int(q_lens.max()))
        tiles_per_req = -(-q_lens // block_q)
        tile_req = np.repeat(np.arange(common.num_reqs), tiles_per_req)
        first_tile = np.concatenate([[0], np.cumsum(tiles_per_req)[:-1]])
        tile_q = (np.arange(len(tile_req)) - first_tile[tile_req]) * block_q
        dev = common.block_table.device
        return TritonMetadata(common, torch.from_numpy(tile_req.astype(np.int32)).to(dev),
                              torch.from_numpy(tile_q.astype(np.int32)).to(dev), block_q)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if self.fp8 and INTERPRET:
            # The interpreter's float -> fp8 conversion does not round to nearest; torch's cast does.
            return super().write_kv(k, v, kv_cache, slot_mapping)
        _reshape_and_cache_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            self.k_scale, self.v_scale,
            NUM_KV_HEADS=self.num_kv_heads, KVH_PAD=pow2(self.num_kv_heads),
            HEAD_DIM=self.head_dim, HEAD_DIM_PAD=pow2(self.head_dim),
            BLOCK_SIZE=k_cache.shape[1], FP8=self.fp8,
        )

    def forward(self, q, k, v, kv_cache, md: TritonMetadata, sinks=None):
        c = md.common
        self.write_kv(k, v, kv_cache, c.slot_mapping)
        out = torch.empty_like(q)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        bt = c.block_table
        grid = (md.tile_req.shape[0], self.num_kv_heads)
        key = (q.device, k_cache.shape[1], q.dtype)
        if key not in self._tiles:
            self._tiles[key] = kv_tile_for(q.device, k_cache.shape[1], self.head_dim, q.dtype,
                                           triton_block_m(self.num_heads, self.num_kv_heads))
        _unified_attention_kernel[grid](
            q, k_cache, v_cache, out, sinks.float().contiguous() if sinks is not None else out,
            bt, c.seq_lens, c.query_start_loc, md.tile_req, md.tile_q,
            self.scale, self.k_scale, self.v_scale, c.sliding_window or 0, c.attention_chunk or 0,
            self.soft_cap or 0.0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bt.stride(0),
            NUM_QPKV=self.qpkv, QPKV_PAD=self.qpkv_pad, BLOCK_Q=md.block_q, BLOCK_M=md.block_q * self.qpkv_pad,
            HEAD_DIM=self.head_dim, HEAD_DIM_PAD=pow2(self.head_dim), BLOCK_SIZE=k_cache.shape[1],
            TILE_N=self._tiles[key], FP8=self.fp8, UPCAST=INTERPRET or q.dtype == torch.float32,
            HAS_SINKS=sinks is not None,
        )
        return out
