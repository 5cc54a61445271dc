"""The Triton MXFP4 GEMM, for gpt-oss's experts on the GPU profiles:
x @ w.T with w as gpt-oss stores it, ``blocks`` uint8 [N, K / 32, 16] (byte
j of a group holding input 2j in its low nibble and 2j + 1 in its high one:
the int4 GEMM's layout, ``triton_int4``) and ``scales`` uint8 [N, K / 32]
(e8m0, 2 ** (s - 127)). Each program computes a BLOCK_M x BLOCK_N tile,
stepping K a group at a time: it unpacks the group's codes, decodes e2m1
(sign, two exponent bits, one mantissa bit) times the group's scale, and
accumulates ``tl.dot`` in fp32. Under TRITON_INTERPRET=1 it runs on CPU
tensors (how the tests run it); fp32 inputs take IEEE products (no TF32),
so the result is the dequantized GEMM up to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.triton_int4 import dot_tile

GROUP = 32  # inputs per e8m0 scale


@triton.jit
def _mxfp4_gemm_kernel(x_ptr, b_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 32)
    rb = tl.arange(0, 16)
    m_ok = rm < M
    n_ok = rn < N
    groups = K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, groups):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (g * 32 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptr + (rn[:, None] * groups + g) * 16 + rb[None, :], mask=n_ok[:, None], other=0)
        codes = tl.reshape(tl.join(b & 0xF, b >> 4), (BLOCK_N, 32))  # byte j -> inputs 2j, 2j + 1
        e = ((codes >> 1) & 3).to(tl.float32)
        mant = (codes & 1).to(tl.float32)
        mag = tl.where(e == 0.0, 0.5 * mant, (1.0 + 0.5 * mant) * tl.exp2(e - 1.0))
        w = tl.where((codes & 8) != 0, -mag, mag)
        s = tl.load(s_ptr + rn * groups + g, mask=n_ok, other=127).to(tl.float32)
        acc = dot_tile(acc, x, w * tl.exp2(s - 127.0)[:, None], IEEE)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def mxfp4_gemm(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias) -> [M, N] in x's dtype, w MXFP4 (``blocks`` [N, K / 32, 16], ``scales``
    [N, K / 32], uint8)."""
    M, K = x.shape
    N, G = scales.shape
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape) != (N, G, 16) \
            or K != GROUP * G:
        raise ValueError(f"MXFP4 GEMM: x {tuple(x.shape)}, blocks {tuple(blocks.shape)} {blocks.dtype}, scales "
                         f"{tuple(scales.shape)} {scales.dtype}: uint8 blocks [N, K / 32, 16] and scales [N, K / 32]")
    x = x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n = 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _mxfp4_gemm_kernel[grid](x, blocks.contiguous(), scales.contiguous(), out, M, N, K, x.stride(0), out.stride(0),
                             BLOCK_M=block_m, BLOCK_N=block_n, IEEE=x.dtype == torch.float32)
    return out if bias is None else out + bias.to(out.dtype)
