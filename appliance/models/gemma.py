"""Gemma 2 and Gemma 3's text model (``Gemma2ForCausalLM``,
``Gemma3ForCausalLM``), declared from the layer library: local layers (a
sliding window; Gemma 3's with their own rope base) and global ones (full
attention, ``rope_theta`` and any rope scaling), each kind in its KV-cache
groups; RMSNorms that scale by ``1 + weight``, before and after both
attention and the MLP; Gemma 3's q/k norms; a GeGLU MLP (tanh-approximated
GELU); the embedding scaled by sqrt(hidden_size) (in the weights' dtype);
attention scores scaled by ``query_pre_attn_scalar ** -0.5`` (the backend's
scale, ``config.sizes.attention_scale``) and, Gemma 2's, soft-capped (the
backend's ``soft_cap``), as are its final logits. The native whole-step
forward does not compute these layers: on ``cpu_native`` they run layer by
layer over its attention."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F

from appliance.models.arch import ModelArch
from appliance.models.layers.attention import Attention
from appliance.models.layers.decoder import LayerSpec
from appliance.models.layers.mlp import MLP
from appliance.models.layers.norm import RMSNorm
from appliance.models.layers.parallel import TensorParallel
from appliance.models.layers.rotary import rope_tables
from appliance.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from appliance.kernels.base import AttentionBackend
    from appliance.models.layers.moe import ExpertParallel


class GemmaRMSNorm(RMSNorm):
    """Scales the fp32 normalized rows by ``1 + weight`` (fp32), then casts back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)


class Gemma3Attention(Attention):
    """Attention with Gemma's q/k norms over each head."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, tp: Optional[TensorParallel] = None,
                 index: int = 0):
        super().__init__(arch, backend, tp, index)
        self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)


class GeGLU(MLP):
    """The gated MLP with GELU (tanh approximation) on the gate."""

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")


def _gemma_attention(arch: ModelArch, backend: AttentionBackend, tp: Optional[TensorParallel] = None,
                     index: int = 0) -> Attention:
    return (Gemma3Attention if arch.qk_norm else Attention)(arch, backend, tp, index)


def _local_rows(arch: ModelArch, index: int) -> int:
    """A local layer takes the local rope rows (``GemmaForCausalLM.rope_rows``)."""
    return int(index in arch.sliding_layers)


def _geglu(arch: ModelArch, tp: Optional[TensorParallel], index: int, ep: Optional[ExpertParallel]) -> GeGLU:
    return GeGLU(arch, tp)


class GemmaForCausalLM(LlamaForCausalLM):
    # normed attention and MLP, each output normed again before its residual add; a local layer takes the
    # local rope rows (``rope_rows``)
    layer_spec = LayerSpec(norm=GemmaRMSNorm, norms="sandwich", attention=_gemma_attention, mlp=_geglu,
                           rope_kind=_local_rows)
    llama_layers = False  # weights_view cannot describe them
    rope_local: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # the local layers' (cos, sin), by rope_cache

    def rope_cache(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        """The global layers' tables (``rope``) and, where the local layers have their own base
        (``rope_local_theta``), theirs: that base, no scaling."""
        super().rope_cache(max_positions, dtype, device)
        theta = self.arch.rope_local_theta
        self.rope_local = self.rope
        if theta is not None:
            cos, sin = rope_tables(dataclasses.replace(self.arch, rope_theta=theta, rope_scaling=None),
                                   max_positions, device)
            self.rope_local = (cos.to(dtype), sin.to(dtype))

    def rope_rows(self, positions: torch.Tensor) -> tuple[Any, Any]:
        """(global, local) cos rows and sin rows: a layer takes its kind's (``DecoderLayer.rope_kind``)."""
        assert self.rope is not None and self.rope_local is not None
        (cos, sin), (cos_l, sin_l) = self.rope, self.rope_local
        return ((cos[positions].unsqueeze(1), cos_l[positions].unsqueeze(1)),
                (sin[positions].unsqueeze(1), sin_l[positions].unsqueeze(1)))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super()._embed(input_ids)
        return x * torch.tensor(self.arch.hidden_size ** 0.5, dtype=x.dtype)

    def _logits(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        logits = super()._logits(x, logits_indices)
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(GemmaForCausalLM):
    family = "gemma2"


class Gemma3ForCausalLM(GemmaForCausalLM):
    family = "gemma3"
