"""MXFP4 weights (the OCP microscaling format gpt-oss's checkpoints store
their experts in): 4-bit e2m1 codes, two a byte, and an e8m0 scale per 32
values. The reference dequantization, and ``mxfp4_linear``, which gpt-oss's
experts multiply their kept 4-bit projections with: the Triton GEMM on a
GPU (``kernels/triton_mxfp4.py``), the native one on CPUs that load the
cpu_native library (``kernels/cpu_mxfp4.py``, AVX2/FMA; many bf16 rows on a
CPU with bf16 dot products take the weight widened to bf16 natively and
torch's GEMM), else the reference dequantization per call."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
# e2m1: the 16 values of a 4-bit MXFP4 code (sign, two exponent bits, one mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless ``blocks`` are bytes [..., groups, 16] and ``scales`` integers [..., groups]."""
    if blocks.dtype != torch.uint8:  # a signed byte would index the table backwards
        raise ValueError(f"MXFP4 blocks are bytes (uint8); these are {blocks.dtype}")
    if scales.is_floating_point():
        raise ValueError(f"MXFP4 scales are e8m0 exponents (integers); these are {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         f"(blocks [..., groups, 16], scales [..., groups])")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 weights as fp32: ``blocks`` uint8 [..., groups, 16] (two e2m1 codes a byte, the low nibble first,
    32 values a group), ``scales`` uint8 [..., groups] (e8m0: 2 ** (scale - 127) per group) -> [..., groups x 32].
    Exact: each value is a code's times a power of two."""
    check_mxfp4(blocks, scales)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.int64)
    values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [..., groups, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return values.flatten(-2)


def rank_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, shard: Optional[tuple[int, int, int]]
               ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """A rank's part of an expert projection's blocks and scales ([experts, out, in / 32, ...]), ``shard`` (dim,
    start, stop) naming it in the parameter's [experts, in, out] layout: whole experts (expert parallelism), or a
    tensor-parallel rank's channels; None where the rank's inputs are not whole groups of 32 (the caller
    dequantizes then)."""
    if shard is None:
        return blocks, scales
    dim, start, stop = shard
    if dim == 0:  # whole experts
        return blocks.narrow(0, start, stop - start), scales.narrow(0, start, stop - start)
    if dim == 2:  # output rows
        return blocks.narrow(1, start, stop - start), scales.narrow(1, start, stop - start)
    if dim == 1 and start % 32 == 0 and stop % 32 == 0:  # whole groups of inputs
        return blocks.narrow(2, start // 32, (stop - start) // 32), scales.narrow(2, start // 32, (stop - start) // 32)
    return None


def expert_weight_from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A gpt-oss expert projection's parameter ([experts, in, out]) from its checkpoint's MXFP4 blocks and scales,
    stored by output row ([experts, out, in / 32, 16])."""
    return dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()


# bf16 rows past this many (on CPUs with bf16 dot products) multiply the weight widened to bf16 with torch's GEMM:
# the native kernel's fp32 FMAs fall behind it from about 16 rows (``appliance bench mxfp4``)
WIDEN_ROWS = 8


@functools.lru_cache(maxsize=1)
def _native() -> Optional[tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], bool]]:
    """The native GEMM, the native widening to bf16, and whether this CPU has bf16 dot products."""
    try:
        from appliance.kernels.cpu_mxfp4 import mxfp4_linear as gemm
        from appliance.kernels.cpu_mxfp4 import mxfp4_to_bf16
        from appliance.kernels.cpu_native_ops import bf16_dot
    except ImportError:  # no AVX2/FMA, or no compiler to build the library
        return None
    return gemm, mxfp4_to_bf16, bf16_dot()


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T -> [M, N] in x's dtype, w kept as MXFP4 (``blocks`` uint8 [N, K / 32, 16], ``scales``
    uint8 [N, K / 32]), fp32 sums."""
    if x.is_cuda:
        from appliance.kernels.triton_mxfp4 import mxfp4_gemm

        return mxfp4_gemm(x, blocks, scales)
    native: Any = _native()
    if native is None:
        return F.linear(x.float(), dequantize_mxfp4(blocks, scales)).to(x.dtype)
    gemm, to_bf16, bf16_fast = native
    if x.dtype == torch.bfloat16 and x.shape[0] > WIDEN_ROWS and bf16_fast:
        return F.linear(x, to_bf16(blocks, scales))
    return gemm(x.float(), blocks, scales).to(x.dtype)

