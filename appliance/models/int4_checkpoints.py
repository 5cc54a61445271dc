"""AWQ and GPTQ checkpoints as grouped blocks (q, d, m) or (q, d, m, perm).

Both store a projection as int32 words of 4-bit values (GPTQ also 8-bit)
with an fp16 scale s and an integer zero point z per output channel per
group of inputs; the weight is s * (q - z). As blocks that is d = s and
m = -s * z in fp32, where both products are exact, so d * q + m is
s * (q - z) bit for bit (``quant.dequantize_int4``). 8-bit values become
int8 q - 128 with m = -s * (z - 128) (still exact).

AWQ (AutoAWQ's GEMM layout): ``qweight`` int32 [in, out / 8] packs eight
output channels per word in the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i of
a word holds channel AWQ_ORDER[i]); ``qzeros`` int32 [in / group, out / 8]
the same way; ``scales`` fp16 [in / group, out].

GPTQ (AutoGPTQ's layout, 4 or 8 bits): ``qweight`` int32 [in / p, out]
packs p = 32 / bits inputs per word in order (field i holds input p w + i);
``qzeros`` int32 [in / group, out / p] packs output channels in order and
stores z - 1; ``scales`` fp16 [in / group, out]; ``g_idx`` int32 [in],
each input's group: i // group, or under act-order (``desc_act``) any
assignment of group-sized sets. Act-order blocks hold their inputs sorted
by group, so groups are runs again, and carry ``perm``: stored input j is
the projection's input perm[j] (the linear reads x[perm]).

``pack_awq`` / ``pack_gptq`` write those layouts from (q, z, s), so tests and
tools can make such checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds channel AWQ_ORDER[i] of its eight
GPTQ_BITS = (4, 8)


def _shifts(bits: int) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32)


def _fields(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [..., w] -> [..., w, 32 / bits] values below 2^bits, field i at index i."""
    return ((words.to(torch.int32)[..., None] >> _shifts(bits)) & ((1 << bits) - 1)).to(torch.uint8)


def _words(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[..., w, 32 / bits] values below 2^bits -> int32 [..., w], value i in field i."""
    v = values.to(torch.int64) << _shifts(bits).to(torch.int64)
    packed = v.sum(dim=-1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def _blocks(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [out, in] (uint8 0..15, or int8), z and s [out, groups] -> (q, d, m), d = s, m = -s * z in fp32."""
    d = s.float()
    return q.contiguous(), d.contiguous(), (-(d * z.float())).contiguous()


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor):
    """An AWQ GEMM projection as int4 blocks (q [out, in], d, m [out, in / group])."""
    inv = [AWQ_ORDER.index(c) for c in range(8)]  # channel c sits in nibble inv[c]
    q = _fields(qweight)[..., inv].reshape(qweight.shape[0], -1)  # [in, out]
    z = _fields(qzeros)[..., inv].reshape(qzeros.shape[0], -1)  # [groups, out]
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


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                bits: int = 4):
    """A GPTQ projection as blocks: (q [out, in], d, m [out, in / group]),
    plus ``perm`` when g_idx is in act-order (see the module docstring)."""
    if bits not in GPTQ_BITS:
        raise ValueError(f"GPTQ with {bits}-bit weights is not supported; supported: {list(GPTQ_BITS)}")
    mask = (1 << bits) - 1
    q = _fields(qweight.T, bits).reshape(qweight.shape[1], -1)  # [out, in]: input p w + i from field i of word w
    # [groups, out], stored z - 1; a true zero of 0 (stored 2^bits - 1) comes back as 0, as AutoGPTQ's torch path
    # reads it (its packer cannot write that case cleanly anyway)
    z = (_fields(qzeros, bits).reshape(qzeros.shape[0], -1).to(torch.int32) + 1) & mask
    groups, k = scales.shape[0], q.shape[1]
    if k % groups or z.shape != scales.shape or q.shape[0] != scales.shape[1]:
        raise ValueError(f"GPTQ tensors disagree ({bits}-bit): qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}")
    perm = _act_order(g_idx, k, groups)
    if perm is not None:
        q = q[:, perm]
    if bits == 8:  # int8 q - 128 and m = -s * (z - 128)
        blocks = _blocks((q.to(torch.int16) - 128).to(torch.int8), z.T - 128, scales.T)
    else:
        blocks = _blocks(q, z.T, scales.T)
    return blocks if perm is None else blocks + (perm,)


def _act_order(g_idx: torch.Tensor | None, k: int, groups: int) -> torch.Tensor | None:
    """None when g_idx is i // group (or absent); else the input order that
    makes each group a run (stable, so inputs keep their order within one)."""
    natural = torch.arange(k) // (k // groups)
    if g_idx is None:
        return None
    g = g_idx.to(torch.int64)
    if g.shape != (k,):
        raise ValueError(f"GPTQ g_idx has shape {tuple(g.shape)}; the projection has {k} inputs")
    if torch.equal(g, natural):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], natural):
        raise ValueError(f"GPTQ g_idx does not give each of the {groups} groups {k // groups} inputs")
    return perm


def pack_gptq(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, bits: int = 4,
              g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """q [out, in] and z, s [out, groups] -> GPTQ's qweight, qzeros, scales,
    g_idx at ``bits``: input i is in group g_idx[i], i // group by default
    (``g_idx`` given: act-order)."""
    out, k = q.shape
    groups = s.shape[1]
    per = 32 // bits
    zt = ((z.to(torch.int32) - 1) & ((1 << bits) - 1)).T.contiguous()  # stored z - 1, as AutoGPTQ writes it
    if g_idx is None:
        g_idx = torch.arange(k) // (k // groups)
    return {"qweight": _words(q.reshape(out, k // per, per), bits).T.contiguous(),
            "qzeros": _words(zt.reshape(groups, -1, per), bits),
            "scales": s.T.contiguous().to(torch.float16),
            "g_idx": g_idx.to(torch.int32)}


def quantize_zero_point(w: torch.Tensor, group: int, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q uint8, z uint8, s fp16), w ~= s * (q - z) per group
    of ``group`` inputs (asymmetric min/max with an integer zero point, as
    AWQ and GPTQ checkpoints store it)."""
    out, k = w.shape
    top = (1 << bits) - 1
    g = w.float().reshape(out, k // group, group)
    lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
    s = ((hi - lo) / top).clamp(min=1e-8).to(torch.float16)
    z = torch.round(-lo / s.float()).clamp(0, top)
    q = (torch.round(g / s.float()[..., None]) + z[..., None]).clamp(0, top)
    return q.reshape(out, k).to(torch.uint8), z.to(torch.uint8), s


# a checkpoint layout -> (its unpacker, the tensors it reads by suffix)
UNPACK: dict[str, tuple[Callable[..., tuple], tuple[str, ...]]] = {
    "awq": (unpack_awq, ("qweight", "qzeros", "scales")),
    "gptq": (unpack_gptq, ("qweight", "qzeros", "scales", "g_idx"))}


def checkpoint_blocks(method: str, parts: dict[str, torch.Tensor], bits: int = 4):
    """One projection's checkpoint tensors (by suffix) as blocks."""
    fn, names = UNPACK[method]
    missing = [n for n in names[:3] if n not in parts]
    if missing:
        raise ValueError(f"{method} projection lacks {', '.join(missing)}")
    if method == "awq":
        if bits != 4:
            raise ValueError(f"AWQ with {bits}-bit weights is not supported (4-bit only)")
        return fn(*(parts.get(n) for n in names))
    return fn(*(parts.get(n) for n in names), bits=bits)


CHECKPOINT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_checkpoint(source: str | os.PathLike, dest: str | os.PathLike, method: str, bits: int = 4,
                     group: int = 32) -> None:
    """A Hugging Face folder's dense projections quantized round-to-nearest
    (``quantize_zero_point``) and written in ``method``'s layout (AWQ at 4
    bits, GPTQ at 4 or 8 without act-order) with its quantization_config;
    the other tensors and files as they are. Not an activation-aware
    quantizer: the layout is the formats', the rounding is plain."""
    if method not in UNPACK or bits not in ((4,) if method == "awq" else GPTQ_BITS):
        raise ValueError(f"{method} at {bits} bits is not a layout this writes (awq: 4; gptq: 4 or 8)")
    src, dst = Path(source), Path(dest)
    if (src / "model.safetensors.index.json").exists():
        raise ValueError("sharded checkpoints with an index are not written by this tool; merge the shards first")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    try:
        _write_quantized(src, dst, method, bits, group)
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)  # nothing half-written is left
        raise


def _write_quantized(src: Path, dst: Path, method: str, bits: int, group: int) -> None:
    from safetensors.torch import load_file, save_file

    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(shard))
        out = {}
        for name, t in tensors.items():
            parts = name.rsplit(".", 2)
            if len(parts) == 3 and parts[1] in CHECKPOINT_PROJECTIONS and parts[2] == "weight" and t.dim() == 2:
                if t.shape[1] % group:
                    raise ValueError(f"{name}: {t.shape[1]} inputs do not split into groups of {group}")
                q, z, s = quantize_zero_point(t, group, bits)
                packed = pack_awq(q, z, s) if method == "awq" else pack_gptq(q, z, s, bits)
                out.update({f"{parts[0]}.{parts[1]}.{k}": v for k, v in packed.items()})
            else:
                out[name] = t
        save_file(out, str(dst / shard.name), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": bits, "group_size": group,
                                     **({"version": "gemm", "zero_point": True} if method == "awq" else
                                        {"desc_act": False, "sym": False})}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
