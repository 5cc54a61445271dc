"""Llama 4's text model (``Llama4ForCausalLM``), declared from the layer
library: the Llama family's projections and norms, with

- rope over interleaved channel pairs (each head's channels 2i and 2i + 1
  turn together, as Meta's checkpoints store q and k), in every layer but
  the NoPE ones (``arch.nope_layers``);
- in the rope layers, chunked local attention (their KV-cache group's
  ``attention_chunk``: the backends attend within each token's chunk) and
  q and k L2-normed per head after rope (no weight; ``qk_norm``);
- in the NoPE layers, full attention, the queries tempered by position:
  q x (1 + scale x log(1 + floor((p + 1) / floor_scale)));
- sparse layers (``arch.sparse_layers``; dense MLPs of intermediate_size
  elsewhere) whose router takes each token's top-k logits through a
  sigmoid, the token scaled by its score before the expert, beside a shared
  expert every token goes through; experts stacked as the checkpoint
  stores them (``gate_up_proj`` [experts, hidden, 2 x inter], gate then
  up; ``down_proj`` [experts, inter, hidden]).

The checkpoint's ``feed_forward`` modules are this model's ``mlp``
(``llama.canonical_name``). Layer by layer on every backend (no whole-step
native forward); one device or pipeline stages (no tensor or expert
parallelism yet)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from appliance.models.arch import ModelArch
from appliance.models.layers.attention import Attention
from appliance.models.layers.decoder import LayerSpec
from appliance.models.layers.mlp import MLP
from appliance.models.layers.moe import grouped_experts
from appliance.models.layers.parallel import TensorParallel, row_parallel_output
from appliance.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from appliance.kernels.base import AttentionBackend
    from appliance.models.layers.moe import ExpertParallel


def interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope over each head's channel pairs (2i, 2i + 1) in fp32, from the half-split tables' first half
    (``cos``/``sin`` [T, 1, head_dim], frequency i at i and i + head_dim / 2)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half].float(), sin[..., :half].float()
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row over its last dimension divided by its root mean square (fp32, no weight)."""
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(Attention):
    """A rope layer turns q and k (interleaved pairs) and L2-norms them where the model does; a NoPE layer
    takes, in place of rope rows, its rows' query temperatures [T, 1, 1] (fp32; None: none)."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, tp: Optional[TensorParallel] = None,
                 index: int = 0):
        super().__init__(replace(arch, qk_norm=False), backend, tp, index)
        self.rope = index not in arch.nope_layers
        self.l2 = arch.qk_norm and self.rope
        self.eps = arch.rms_norm_eps

    def forward(self, x, cos, sin, kv_cache, attn_metadata):
        t = x.shape[0]
        q, k, v = self.heads(x)
        if self.rope:
            q, k = interleaved_rope(q, cos, sin), interleaved_rope(k, cos, sin)
            if self.l2:
                q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        elif cos is not None:
            q = (q * cos).to(q.dtype)
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata)
        return row_parallel_output(self.o_proj, out.reshape(t, self.num_heads * self.head_dim), self.tp)


class Llama4Experts(nn.Module):
    """A layer's experts as the checkpoint stacks them, run grouped by expert (``grouped_experts``) on each
    token already scaled by its router score: x @ gate_up_proj[e] -> gate | up, silu(gate) * up @ down_proj[e]."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        e, h, i = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
        self.num_experts, self.inter = e, i
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, i, h), requires_grad=False)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.gate_up_proj[e]).split(self.inter, dim=-1)
        return (F.silu(gate) * up) @ self.down_proj[e]

    def forward(self, x: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return grouped_experts(x, scores, ids, 0, self.num_experts, self.expert, weigh_input=True)


class Llama4Moe(nn.Module):
    """The router (no bias, in the model's dtype: each token's top-k logits through a sigmoid, as transformers
    and vLLM score them), the experts on the scaled tokens, and the shared expert on every token."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.router = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = Llama4Experts(arch)
        self.shared_expert = MLP(arch, span="shared")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(F.linear(x, self.router.weight), self.top_k, dim=-1)
        scores = torch.sigmoid(top.float()).to(x.dtype)
        return self.shared_expert(x) + self.experts(x, scores, ids)


def _mlp(arch: ModelArch, tp: Optional[TensorParallel], index: int, ep: Optional[ExpertParallel]) -> nn.Module:
    """The router, experts and shared expert in a sparse layer, the dense gated MLP elsewhere."""
    return Llama4Moe(arch) if index in arch.sparse_layers else MLP(arch, tp)


def _rows_of(arch: ModelArch, index: int) -> int:
    """A NoPE layer takes the query temperatures, the others the rope rows (``Llama4ForCausalLM.rope_rows``)."""
    return int(index in arch.nope_layers)


class Llama4ForCausalLM(LlamaForCausalLM):
    family = "llama4"
    layer_spec = LayerSpec(attention=Llama4Attention, mlp=_mlp, rope_kind=_rows_of)
    llama_layers = False  # weights_view cannot describe them
    stacked_experts = True  # the checkpoint's expert tensors are the parameters, as stored

    def rope_rows(self, positions: torch.Tensor) -> tuple[Any, Any]:
        """(rope rows, the NoPE layers' query temperatures) for cos and (rope rows, None) for sin: a layer takes
        its kind's (``DecoderLayer.rope_kind``)."""
        cos, sin = super().rope_rows(positions)
        tuning = self.arch.attn_temperature
        temperature = None
        if tuning is not None:
            floor, scale = tuning
            p = positions.to(torch.float32)
            temperature = (torch.log1p(torch.floor((p + 1.0) / floor)) * scale + 1.0).view(-1, 1, 1)
        return (cos, temperature), (sin, None)
