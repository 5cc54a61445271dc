"""The native MXFP4 GEMM (``appl_mxfp4_linear`` in ``csrc/cpu_ops.c``):
gpt-oss's experts multiplied as stored, 4-bit e2m1 codes with an e8m0
scale per 32 inputs, decoded in registers into fp32 sums; and
``mxfp4_to_bf16``, the weights widened to bf16 (exactly) for a bf16 GEMM
of many rows. Importing it
loads the cpu_native library (built at first use; ImportError where the CPU
lacks AVX2/FMA or no compiler is found)."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from appliance.kernels.cpu_native_ops import _LIB, _f32_contig, _ptr, _small_f32

_p, _i64 = ctypes.c_void_p, ctypes.c_int64
_LIB.appl_mxfp4_linear.argtypes = [_p, _i64, _p, _p, _p, _p, _i64, _i64, _i64, _i64]
_LIB.appl_mxfp4_linear.restype = None
_LIB.appl_mxfp4_to_bf16.argtypes = [_p, _p, _i64, _i64, _p]
_LIB.appl_mxfp4_to_bf16.restype = None


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] fp32 @ w.T (+ bias) -> [M, N] fp32, w MXFP4 as gpt-oss stores it: ``blocks`` uint8
    [N, K / 32, 16] (byte j of a group: input 2j in its low nibble, 2j + 1 in its high), ``scales`` uint8
    [N, K / 32]."""
    n, groups = scales.shape
    m, k = x.shape
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape) != (n, groups, 16) \
            or k != 32 * groups:
        raise ValueError(f"MXFP4 GEMM: x {tuple(x.shape)}, blocks {tuple(blocks.shape)} {blocks.dtype}, scales "
                         f"{tuple(scales.shape)} {scales.dtype}: uint8 blocks [N, K / 32, 16] and scales [N, K / 32]")
    x = _f32_contig(x, "x")
    blocks, scales = blocks.contiguous(), scales.contiguous()
    b = None if bias is None else _small_f32(bias, "bias")
    out = torch.empty(m, n, dtype=torch.float32)
    _LIB.appl_mxfp4_linear(x.data_ptr(), k, blocks.data_ptr(), scales.data_ptr(), _ptr(b), out.data_ptr(), n, m, n, k)
    return out


def mxfp4_to_bf16(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in bf16 (exactly the MXFP4 values) of ``blocks`` uint8 [N, K / 32, 16] and ``scales``
    uint8 [N, K / 32] (``appl_mxfp4_to_bf16``)."""
    n, groups = scales.shape
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or tuple(blocks.shape) != (n, groups, 16):
        raise ValueError(f"MXFP4 weights: blocks {tuple(blocks.shape)} {blocks.dtype}, scales {tuple(scales.shape)} "
                         f"{scales.dtype}: uint8 blocks [N, K / 32, 16] and scales [N, K / 32]")
    blocks, scales = blocks.contiguous(), scales.contiguous()
    out = torch.empty(n, 32 * groups, dtype=torch.bfloat16)
    _LIB.appl_mxfp4_to_bf16(blocks.data_ptr(), scales.data_ptr(), n, groups, out.data_ptr())
    return out

