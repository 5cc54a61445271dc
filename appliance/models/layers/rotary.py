"""Rotary position embeddings: the inverse frequencies (with a checkpoint's
rope scaling: linear, llama3, YaRN or LongRoPE, as transformers computes
them), the cos/sin tables (YaRN's and LongRoPE's scaled by their attention
factor; LongRoPE's short rows, then its long rows: ``rope_long_rows``), and
the rotation."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from appliance.models.arch import ModelArch


def rope_inv_freq(arch: ModelArch, long: bool = False) -> torch.Tensor:
    """The inverse frequencies of the rotated channels; ``long``: LongRoPE's for sequences past its original
    context."""
    dim = arch.rope_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = arch.rope_scaling
    if rs is None:
        return inv_freq
    if rs["rope_type"] == "longrope":
        ext = torch.tensor(rs["long_factor"] if long else rs["short_factor"], dtype=torch.float32)
        return 1.0 / (ext * arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rs["rope_type"] == "linear":
        return inv_freq / rs["factor"]
    if rs["rope_type"] == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rs["rope_type"] == "yarn":
        return _yarn_inv_freq(arch)
    raise ValueError(f"unsupported rope scaling {rs['rope_type']!r}")


def _yarn_inv_freq(arch: ModelArch) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): the frequencies that turn fewer than
    ``beta_slow`` times over the original context are interpolated (divided by
    ``factor``), those that turn more than ``beta_fast`` times kept, and a
    linear ramp over the dimensions between."""
    rs, dim, base = arch.rope_scaling, arch.rope_dim, arch.rope_theta
    assert rs is not None

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rs["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rs["beta_fast"]), correction_dim(rs["beta_slow"])
    if rs["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # share extrapolated
    return 1.0 / (rs["factor"] * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(arch: ModelArch) -> float:
    """What the cos/sin tables are scaled by: YaRN's attention factor (given,
    else from ``factor``, with ``mscale`` / ``mscale_all_dim`` where both are
    set), LongRoPE's (given, else from ``factor`` and the original context), 1
    otherwise."""
    rs = arch.rope_scaling
    if rs is None or rs["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if rs["attention_factor"] is not None:
        return float(rs["attention_factor"])
    if rs["rope_type"] == "longrope":  # LongRoPE's paper: from factor and the original context
        factor, original = rs["factor"], rs["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    if rs["mscale"] and rs["mscale_all_dim"]:
        return _mscale(rs["factor"], rs["mscale"]) / _mscale(rs["factor"], rs["mscale_all_dim"])
    return _mscale(rs["factor"])


def rope_long_rows(arch: ModelArch, positions: int) -> Optional[tuple[int, int]]:
    """Where a LongRoPE model's rope tables (``rope_tables``) keep the long rows: (its original context, the row of
    position 0's); None for any other rope, whose row is the position. A token at position p of a sequence of
    more tokens than that context takes row p + offset, row p otherwise (transformers' Phi-3 computes every
    position again with the long frequencies once a sequence grows past it)."""
    rs = arch.rope_scaling
    if rs is None or rs["rope_type"] != "longrope":
        return None
    return int(rs["original_max_position_embeddings"]), positions


def rope_tables(arch: ModelArch, positions: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, rope_dim] in fp32 (the rotated channels of a head); LongRoPE's [2 positions,
    rope_dim], its short rows, then its long rows (``rope_long_rows``)."""
    pos = torch.arange(positions, device=device, dtype=torch.float32)
    kinds = (False, True) if rope_long_rows(arch, positions) else (False,)
    freqs = torch.cat([torch.outer(pos, rope_inv_freq(arch, long).to(device)) for long in kinds])
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = rope_attention_factor(arch)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] turned by its rows' cos and sin ([T, 1, rope_dim]): the first rope_dim channels of
    each head, the rest as they are (a partial rotary factor)."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned = x[..., :rd]
    return torch.cat((turned * cos + rotate_half(turned) * sin, x[..., rd:]), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
