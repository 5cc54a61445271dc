"""Triton GEMMs over grouped weights with a scale and a min per output
channel per group of inputs (weight = d * q + m), for the GPU profiles:
int4 (AWQ, GPTQ 4-bit, kept 4-bit GGUF) and int8 (GPTQ 8-bit, GGUF's
Q8_0, Q5_K and Q6_K kept as grouped int8). ``models.quant`` calls them on
CUDA/ROCm tensors.

int4 weights: ``qpacked`` uint8 [N, K / 2], byte j of row n holding
k = 2j in its low nibble and k = 2j + 1 in its high nibble
(``pack_int4_rows``); int8 weights: int8 [N, K] as they are. ``d`` and ``m``
[N, K / group] (fp16 or fp32). Each program computes a BLOCK_M x BLOCK_N
tile of x @ w.T: it loads BLOCK_K weights per row (unpacking BLOCK_K / 2
bytes for int4), applies the group's d and m (BLOCK_K divides the group,
so one pair per row per step), and accumulates ``tl.dot`` in fp32. Under
TRITON_INTERPRET=1 it runs on CPU tensors (how the tests run it); fp32
inputs take IEEE products (no TF32), so the result is the dequantized GEMM
up to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 32  # int4: divides every supported group size (even, >= 32)
INT8_BLOCK_K = (32, 16)  # int8: the larger that divides the group (GGUF's Q6_K has groups of 16)


@triton.jit
def dot_tile(acc, x, w, IEEE: tl.constexpr):
    """acc + x @ w.T for a tile of dequantized weights: fp32 rows in IEEE products (no TF32), else w in x's
    dtype."""
    if IEEE:
        return acc + tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w.to(x.dtype)))


@triton.jit
def _grouped_gemm_kernel(x_ptr, q_ptr, d_ptr, m_ptr, out_ptr, M, N, K, G, stride_xm, stride_om,
                         GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr, BITS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rb = tl.arange(0, BLOCK_K // 2)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        if BITS == 4:
            b = tl.load(q_ptr + rn[:, None] * (K // 2) + (k0 // 2 + rb)[None, :], mask=n_ok[:, None], other=0)
            lo = (b & 0xF).to(tl.float32)
            hi = (b >> 4).to(tl.float32)
            w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # byte j -> k = 2j, 2j + 1
        else:
            w = tl.load(q_ptr + rn[:, None] * K + (k0 + rk)[None, :], mask=n_ok[:, None], other=0).to(tl.float32)
        g = k0 // GROUP
        d = tl.load(d_ptr + rn * G + g, mask=n_ok, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + rn * G + g, mask=n_ok, other=0.0).to(tl.float32)
        w = w * d[:, None] + mn[:, None]
        acc = dot_tile(acc, x, w, IEEE)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (0..15, K even) -> [N, K / 2], two k per byte, the even one low."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _launch(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None,
            bits: int, block_k: int) -> torch.Tensor:
    M, K = x.shape
    N, G = d.shape
    x = x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n = 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _grouped_gemm_kernel[grid](x, q.contiguous(), d.contiguous(), m.contiguous(), out, M, N, K, G, x.stride(0),
                               out.stride(0), GROUP=K // G, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                               IEEE=x.dtype == torch.float32, BITS=bits)
    return out if bias is None else out + bias.to(out.dtype)


def int4_gemm(x: torch.Tensor, qpacked: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (d * q + m).T (+ bias) -> [M, N] in x's dtype; q as ``pack_int4_rows`` packs it."""
    M, K = x.shape
    N, G = d.shape
    if qpacked.shape != (N, K // 2) or K % G or (K // G) % BLOCK_K:
        raise ValueError(f"int4 GEMM: x {tuple(x.shape)}, weights {tuple(qpacked.shape)}, groups {tuple(d.shape)}: "
                         f"groups must be multiples of {BLOCK_K} that tile K")
    return _launch(x, qpacked, d, m, bias, 4, BLOCK_K)


def int8_block_k(group: int) -> int | None:
    """The K step the int8 GEMM takes for ``group`` (None: it cannot step it)."""
    return next((b for b in INT8_BLOCK_K if group % b == 0), None)


def int8_gemm(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (d * q + m).T (+ bias) -> [M, N] in x's dtype; q int8 [N, K]."""
    M, K = x.shape
    N, G = d.shape
    block_k = int8_block_k(K // G) if G and K % G == 0 else None
    if q.shape != (N, K) or q.dtype != torch.int8 or block_k is None:
        raise ValueError(f"int8 GEMM: x {tuple(x.shape)}, weights {tuple(q.shape)} {q.dtype}, groups "
                         f"{tuple(d.shape)}: int8 weights in groups of a multiple of {INT8_BLOCK_K[-1]} that tile K")
    return _launch(x, q, d, m, bias, 8, block_k)
