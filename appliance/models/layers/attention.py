"""The attention layer: one packed q/k/v projection, an optional RMSNorm
over each head of q and k, rope, the attention backend over the paged KV
cache (with each head's learned attention sink where the model has them:
gpt-oss), the output projection (all-reduced across tensor-parallel ranks;
biased where the model's is)."""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from appliance.models.arch import ModelArch
from appliance.models.layers.linear import QKVParallelLinear, RowParallelLinear
from appliance.models.layers.norm import RMSNorm
from appliance.models.layers.parallel import TensorParallel, row_parallel_output
from appliance.models.layers.rotary import apply_rope

if TYPE_CHECKING:  # the backend is handed in; the layer never picks one
    from appliance.kernels.base import AttentionBackend


class Attention(nn.Module):
    """``index``: its layer's in the whole model (for architectures whose layers' attention differ)."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, tp: Optional[TensorParallel] = None,
                 index: int = 0):
        super().__init__()
        self.tp = tp
        h, kv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        # q, k and v projections packed into one GEMM (rows q | k | v).
        self.qkv_proj = QKVParallelLinear(arch, bias=arch.qkv_bias)
        self.q_size, self.kv_size = h * d, kv * d
        self.o_proj = RowParallelLinear(h * d, arch.hidden_size, "o_proj", "q", bias=arch.o_bias)
        # a logit per head beside its scores in the softmax, its probability dropped (the checkpoint's)
        self.sinks = nn.Parameter(torch.empty(h), requires_grad=False) if arch.attention_sinks else None
        if arch.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self.backend = backend

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """This layer's fp8 KV scales (a checkpoint's): the layer gets its own
        copy of the backend holding them (the copy shares the backend's
        state), as layers of one model may differ."""
        if not (k_scale > 0 and v_scale > 0 and math.isfinite(k_scale) and math.isfinite(v_scale)):
            raise ValueError(f"KV cache scales must be positive and finite; got k_scale={k_scale}, v_scale={v_scale}")
        self.backend = copy.copy(self.backend)
        self.backend.k_scale, self.backend.v_scale = float(k_scale), float(v_scale)

    def heads(self, x):
        """q, k and v of rows ``x``, a row per head, q and k normalized where the model norms them."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x, cos, sin, kv_cache, attn_metadata):
        t = x.shape[0]
        q, k, v = self.heads(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.sinks is None:
            out = self.backend.forward(q, k, v, kv_cache, attn_metadata)
        else:
            out = self.backend.forward(q, k, v, kv_cache, attn_metadata, sinks=self.sinks)
        return row_parallel_output(self.o_proj, out.reshape(t, self.num_heads * self.head_dim), self.tp)
