"""OLMo 2 (``Olmo2ForCausalLM``), declared from the layer library: the
Llama family's projections, rope and MLP, with RMSNorms after attention and
after the MLP instead of before them, and q/k norms over all heads of the
projection (before the heads are split). The native whole-step forward does
not compute these layers: on ``cpu_native`` they run layer by layer over its
attention."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

from appliance.models.arch import ModelArch
from appliance.models.layers.attention import Attention
from appliance.models.layers.decoder import LayerSpec, dense
from appliance.models.layers.norm import WeightFirstRMSNorm
from appliance.models.layers.parallel import TensorParallel
from appliance.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from appliance.kernels.base import AttentionBackend


class Olmo2Attention(Attention):
    """Attention whose q and k are normalized over all their heads at once.
    A tensor-parallel rank holds its heads' part of each norm's weight; the
    mean of squares is over every rank's heads (an all-reduce of each row's
    sum of squares over the ranks' widths; KV heads that several ranks hold
    are each held by as many, so the mean is the same)."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, tp: Optional[TensorParallel] = None,
                 index: int = 0):
        super().__init__(dataclasses.replace(arch, qk_norm=False), backend, tp, index)
        self.q_norm = WeightFirstRMSNorm(self.q_size, arch.rms_norm_eps)
        self.k_norm = WeightFirstRMSNorm(self.kv_size, arch.rms_norm_eps)

    def _norm(self, x: torch.Tensor, norm: WeightFirstRMSNorm) -> torch.Tensor:
        if self.tp is None:
            return norm(x)
        dtype, x = x.dtype, x.float()
        squares = x.pow(2).sum(-1, keepdim=True)
        self.tp.comm.all_reduce(squares)
        return (norm.weight * (x * torch.rsqrt(squares / (x.shape[-1] * self.tp.size) + norm.eps))).to(dtype)

    def heads(self, x):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (self._norm(q, self.q_norm).reshape(t, self.num_heads, self.head_dim),
                self._norm(k, self.k_norm).reshape(t, self.num_kv_heads, self.head_dim),
                v.reshape(t, self.num_kv_heads, self.head_dim))


class Olmo2ForCausalLM(LlamaForCausalLM):
    family = "olmo2"
    # attention, then the MLP, each followed by its norm before the residual add
    layer_spec = LayerSpec(norm=WeightFirstRMSNorm, norms="post", attention=Olmo2Attention, mlp=dense)
    llama_layers = False  # weights_view cannot describe them
