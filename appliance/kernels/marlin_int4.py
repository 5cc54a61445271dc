"""The Marlin int4 GEMM (sgl-kernel's ``gptq_marlin_gemm``) for AWQ and
GPTQ 4-bit weights on NVIDIA GPUs (SM80 on), where ``sgl_kernel`` imports;
``models.quant.Int4WeightOnlyLinear`` prefers it to the Triton int4 GEMM
(``appliance/kernels/triton_int4.py``) for weights it takes.

It takes 4-bit weights whose zero points are integers, w = s x (q - z):
an AWQ or GPTQ checkpoint's blocks (d = s, m = -s x z, ``integer_zeros``
reads z back exactly); GGUF's Q4_1 / Q4_K mins and our own int4
quantizer's are not of that form and stay on the Triton GEMM. Shapes: N a
multiple of 64, K of 128, groups of 32, 64 or 128; fp16 or bf16
activations (the scales are cast to them).

Layouts (Marlin's, as vLLM and sgl-kernel define them):

- weights: GPTQ's int32 words [K / 8, N], input 8w + i in bits 4i
  (``gptq_words``), repacked on the device by ``gptq_marlin_repack``;
- scales [G, N]: each row's 64-column chunks permuted by ``SCALE_PERM``
  (``SCALE_PERM_SINGLE`` over 32 when one group spans K);
- zero points [G, N]: permuted the same way, then each 8 columns
  interleaved 0, 2, 4, 6, 1, 3, 5, 7 and packed eight to an int32
  (``pack_zero_points``); symmetric weights (every z = 8) take Marlin's
  ``uint4b8`` type instead and no zero points.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, cast

import torch

from appliance.kernels import providers

GROUPS = (32, 64, 128)
SCALE_PERM = [i + 8 * j for i in range(8) for j in range(8)]
SCALE_PERM_SINGLE = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
ZERO_INTERLEAVE = [0, 2, 4, 6, 1, 3, 5, 7]


@functools.cache
def _sgl() -> Any:
    try:
        import sgl_kernel
        from sgl_kernel.scalar_type import scalar_types
    except (ImportError, OSError):
        return None
    return sgl_kernel, scalar_types


def shape_ok(n: int, k: int, group: int) -> bool:
    """Whether Marlin tiles an [n, k] weight in groups of ``group``."""
    return n % 64 == 0 and k % 128 == 0 and group in GROUPS and k % group == 0


def unusable_reason(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Optional[str]:
    """None when the Marlin GEMM runs on ``device`` with ``dtype`` activations, else why not."""
    if device.type != "cuda" or torch.version.hip is not None:
        return f"it runs on NVIDIA GPUs, not {device.type}{' (ROCm)' if torch.version.hip else ''}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it takes fp16 or bf16 activations, not {dtype}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "it needs SM80 or later"
    why = providers.probe("sgl_kernel")
    return f"sgl_kernel {why}" if why else None


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Marlin GEMM runs on ``device`` with ``dtype`` activations."""
    return unusable_reason(device, dtype) is None


def integer_zeros(d: torch.Tensor, m: torch.Tensor) -> Optional[torch.Tensor]:
    """The zero points z (uint8 [N, G], 0..15) with m = -d x z exactly, or
    None when the mins are not of that form."""
    if not bool((d != 0).all()):
        return None
    z = -(m.float() / d.float())
    zr = z.round()
    if not torch.equal(z, zr) or not bool(((zr >= 0) & (zr <= 15)).all()) \
            or not torch.equal(-(d.float() * zr), m.float()):
        return None
    return zr.to(torch.uint8)


def gptq_words(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (0..15) as GPTQ's int32 words [K / 8, N]: input 8w + i in bits 4i of word w."""
    n, k = q.shape
    fields = q.T.reshape(k // 8, 8, n).to(torch.int64) << (4 * torch.arange(8, dtype=torch.int64)).view(1, 8, 1)
    words = fields.sum(dim=1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def permute_scales(s: torch.Tensor, k: int, group: int) -> torch.Tensor:
    """Scales [G, N] in Marlin's order."""
    n = s.shape[1]
    perm = SCALE_PERM if group < k else SCALE_PERM_SINGLE
    return s.reshape(-1, len(perm))[:, perm].reshape(-1, n).contiguous()


def pack_zero_points(z: torch.Tensor) -> torch.Tensor:
    """Zero points [G, N] (0..15) in Marlin's order, eight to an int32: [G, N / 8]."""
    g, n = z.shape
    zp = z.to(torch.int64).reshape(-1, len(SCALE_PERM))[:, SCALE_PERM]
    zp = zp.reshape(-1, 8)[:, ZERO_INTERLEAVE].reshape(g, n)
    words = cast(torch.Tensor, sum(zp[:, i::8] << (4 * i) for i in range(8)))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def prepare(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
            dtype: torch.dtype) -> Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """Marlin's host-side layouts of blocks (q [N, K], d, m [N, G]) for
    ``dtype`` activations: (GPTQ words, permuted scales, packed zero points
    or None for symmetric weights); None when Marlin does not take them."""
    n, k = q.shape
    group = k // d.shape[1]
    z = integer_zeros(d, m)
    if z is None or not shape_ok(n, k, group):
        return None
    zeros = None if bool((z == 8).all()) else pack_zero_points(z.T.contiguous())
    return gptq_words(q), permute_scales(d.T.contiguous().to(dtype), k, group), zeros


def repack(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """GPTQ words [K / 8, N] (on the device) in Marlin's tiles."""
    return _sgl()[0].gptq_marlin_repack(words, torch.empty(0, dtype=torch.int32, device=words.device), k, n, 4)


@functools.cache
def _workspace(device: torch.device) -> torch.Tensor:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(sms, dtype=torch.int32, device=device)


def gemm(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], n: int,
         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias): ``tiles`` from ``repack``, ``scales`` and
    ``zeros`` from ``prepare`` (zeros None: symmetric, Marlin's uint4b8)."""
    sgl, types = _sgl()
    empty = torch.empty(0, dtype=torch.int32, device=x.device)
    out = sgl.gptq_marlin_gemm(x.contiguous(), None, tiles, scales, None, zeros, empty, empty, _workspace(x.device),
                               types.uint4b8 if zeros is None else types.uint4, x.shape[0], n, x.shape[1],
                               is_k_full=True, use_atomic_add=False, use_fp32_reduce=True)
    return out if bias is None else out + bias.to(out.dtype)
