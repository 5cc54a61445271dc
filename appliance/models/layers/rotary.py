"""Rotary position embeddings: the inverse frequencies (with a checkpoint's
rope scaling), the cos/sin tables, and the rotation."""

from __future__ import annotations

import math
from typing import Any

import torch

from appliance.models.arch import ModelArch


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = arch.rope_scaling
    if rs is None:
        return inv_freq
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
    raise ValueError(f"unsupported rope scaling {rs['rope_type']!r}")


def rope_tables(arch: ModelArch, positions: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, head_dim] in fp32."""
    pos = torch.arange(positions, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, rope_inv_freq(arch).to(device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
