"""MXFP4 weights (the OCP microscaling format gpt-oss's checkpoints store
their experts in): 4-bit e2m1 codes, two a byte, and an e8m0 scale per 32
values. The reference dequantization, which the loader applies to a gpt-oss
MXFP4 checkpoint's expert projections (4-bit expert kernels are not built
yet)."""

from __future__ import annotations

import torch
# e2m1: the 16 values of a 4-bit MXFP4 code (sign, two exponent bits, one mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 weights as fp32: ``blocks`` uint8 [..., groups, 16] (two e2m1 codes a byte, the low nibble first,
    32 values a group), ``scales`` uint8 [..., groups] (e8m0: 2 ** (scale - 127) per group) -> [..., groups x 32].
    Exact: each value is a code's times a power of two."""
    if blocks.dtype != torch.uint8:  # a signed byte would index the table backwards
        raise ValueError(f"MXFP4 blocks are bytes (uint8); these are {blocks.dtype}")
    if scales.is_floating_point():
        raise ValueError(f"MXFP4 scales are e8m0 exponents (integers); these are {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         f"(blocks [..., groups, 16], scales [..., groups])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.int64)
    values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [..., groups, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return values.flatten(-2)


def expert_weight_from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A gpt-oss expert projection's parameter ([experts, in, out]) from its checkpoint's MXFP4 blocks and scales,
    stored by output row ([experts, out, in / 32, 16])."""
    return dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
