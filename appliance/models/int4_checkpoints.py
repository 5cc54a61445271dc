"""AWQ and GPTQ 4-bit checkpoints as int4 blocks (q, d, m).

Both store a projection as int32 words of eight 4-bit values with an fp16
scale s and a 4-bit zero point z per output channel per group of inputs;
the weight is s * (q - z). As int4 blocks that is d = s and m = -s * z in
fp32, where both products are exact, so d * q + m is s * (q - z) bit for
bit (``quant.dequantize_int4``).

AWQ (AutoAWQ's GEMM layout): ``qweight`` int32 [in, out / 8] packs eight
output channels per word in the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i of
a word holds channel AWQ_ORDER[i]); ``qzeros`` int32 [in / group, out / 8]
the same way; ``scales`` fp16 [in / group, out].

GPTQ (AutoGPTQ's layout): ``qweight`` int32 [in / 8, out] packs eight
inputs per word in order (nibble i holds input 8 w + i); ``qzeros`` int32
[in / group, out / 8] packs output channels in order and stores z - 1;
``scales`` fp16 [in / group, out]; ``g_idx`` int32 [in], each input's group
(i // group without act-order, the only layout built).

``pack_awq`` / ``pack_gptq`` write those layouts from (q, z, s), so tests and
tools can make such checkpoints.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds channel AWQ_ORDER[i] of its eight
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., w] -> [..., w, 8] values 0..15, nibble i at index i."""
    return ((words.to(torch.int32)[..., None] >> SHIFTS) & 0xF).to(torch.uint8)


def _words(values: torch.Tensor) -> torch.Tensor:
    """[..., w, 8] values 0..15 -> int32 [..., w], value i in nibble i."""
    v = values.to(torch.int64) << SHIFTS.to(torch.int64)
    packed = v.sum(dim=-1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def _blocks(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [out, in], z and s [out, groups] -> (q, d, m) int4 blocks, d = s, m = -s * z in fp32."""
    d = s.float()
    return q.to(torch.uint8).contiguous(), d.contiguous(), (-(d * z.float())).contiguous()


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor):
    """An AWQ GEMM projection as int4 blocks (q [out, in], d, m [out, in / group])."""
    inv = [AWQ_ORDER.index(c) for c in range(8)]  # channel c sits in nibble inv[c]
    q = _nibbles(qweight)[..., inv].reshape(qweight.shape[0], -1)  # [in, out]
    z = _nibbles(qzeros)[..., inv].reshape(qzeros.shape[0], -1)  # [groups, out]
    if q.shape[1] != scales.shape[1] or z.shape != scales.shape or q.shape[0] % scales.shape[0]:
        raise ValueError(f"AWQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}")
    return _blocks(q.T, z.T, scales.T)


def pack_awq(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """q [out, in] and z, s [out, groups] -> AWQ's qweight, qzeros, scales."""
    order = list(AWQ_ORDER)
    qt, zt = q.T.contiguous(), z.T.contiguous()
    return {"qweight": _words(qt.reshape(qt.shape[0], -1, 8)[..., order]),
            "qzeros": _words(zt.reshape(zt.shape[0], -1, 8)[..., order]),
            "scales": s.T.contiguous().to(torch.float16)}


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None):
    """A GPTQ projection (no act-order) as int4 blocks (q [out, in], d, m [out, in / group])."""
    q = _nibbles(qweight.T).reshape(qweight.shape[1], -1)  # [out, in]: input 8 w + i from nibble i of word w
    # [groups, out], stored z - 1; a true zero of 0 (stored 15) comes back as 0, as AutoGPTQ's torch path reads it
    # (its packer cannot write that case cleanly anyway)
    z = (_nibbles(qzeros).reshape(qzeros.shape[0], -1).to(torch.int32) + 1) & 0xF
    groups, k = scales.shape[0], q.shape[1]
    if k % groups or z.shape != scales.shape or q.shape[0] != scales.shape[1]:
        raise ValueError(f"GPTQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // (k // groups)):
        raise ValueError("GPTQ g_idx is not in group order (act-order): not built yet")
    return _blocks(q, z.T, scales.T)


def pack_gptq(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """q [out, in] and z, s [out, groups] -> GPTQ's qweight, qzeros, scales, g_idx."""
    out, k = q.shape
    groups = s.shape[1]
    zt = ((z.to(torch.int32) - 1) & 0xF).T.contiguous()  # stored z - 1, as AutoGPTQ writes it
    return {"qweight": _words(q.reshape(out, k // 8, 8)).T.contiguous(),
            "qzeros": _words(zt.reshape(groups, -1, 8)),
            "scales": s.T.contiguous().to(torch.float16),
            "g_idx": (torch.arange(k) // (k // groups)).to(torch.int32)}


def quantize_zero_point(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q uint8, z uint8, s fp16), w ~= s * (q - z) per group
    of ``group`` inputs (asymmetric min/max with an integer zero point, as
    AWQ and GPTQ checkpoints store it)."""
    out, k = w.shape
    g = w.float().reshape(out, k // group, group)
    lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=1e-8).to(torch.float16)
    z = torch.round(-lo / s.float()).clamp(0, 15)
    q = (torch.round(g / s.float()[..., None]) + z[..., None]).clamp(0, 15)
    return q.reshape(out, k).to(torch.uint8), z.to(torch.uint8), s


UNPACK = {"awq": (unpack_awq, ("qweight", "qzeros", "scales")),
          "gptq": (unpack_gptq, ("qweight", "qzeros", "scales", "g_idx"))}


def checkpoint_blocks(method: str, parts: dict[str, torch.Tensor]):
    """One projection's checkpoint tensors (by suffix) as int4 blocks."""
    fn, names = UNPACK[method]
    missing = [n for n in names[:3] if n not in parts]
    if missing:
        raise ValueError(f"{method} projection lacks {', '.join(missing)}")
    return fn(*(parts.get(n) for n in names))
