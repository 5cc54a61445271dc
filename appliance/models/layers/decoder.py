"""The decoder layer every architecture is built from, parametrized by a
``LayerSpec``: which norm, where the norms sit around attention and the MLP,
which attention and which MLP (dense, the Llama family's sparse experts, or
a model's own), a residual multiplier, and which of the model's rope rows
each layer takes where its kinds of layers take different ones. An architecture declares its spec; the layer's
parameter names are Hugging Face's for each placement, so checkpoints load
by name:

================  ==============================================================================
``norms``         parameters (forward)
================  ==============================================================================
``"pre"``         input_layernorm, post_attention_layernorm (the MLP's input): Llama, Qwen,
                  Granite, gpt-oss. x += attn(n1(x)); x += mlp(n2(x))
``"post"``        post_attention_layernorm, post_feedforward_layernorm (each branch's output):
                  OLMo 2. x += n1(attn(x)); x += n2(mlp(x))
``"sandwich"``    input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
                  post_feedforward_layernorm: Gemma 2/3. x += n2(attn(n1(x))); x += n4(mlp(n3(x)))
================  ==============================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from appliance.models.arch import ModelArch
from appliance.models.layers.attention import Attention
from appliance.models.layers.mlp import MLP
from appliance.models.layers.moe import ExpertParallel, SparseMoe
from appliance.models.layers.norm import RMSNorm
from appliance.models.layers.parallel import TensorParallel

if TYPE_CHECKING:  # the backend is handed in; the layer never picks one
    from appliance.kernels.base import AttentionBackend

# (arch, backend, tp, the layer's index in the whole model) -> the layer's attention
AttentionFactory = Callable[[ModelArch, "AttentionBackend", Optional[TensorParallel], int], Attention]
# (arch, tp, the layer's index in the whole model, ep) -> the layer's MLP
MlpFactory = Callable[[ModelArch, Optional[TensorParallel], int, Optional[ExpertParallel]], nn.Module]


def dense(arch: ModelArch, tp: Optional[TensorParallel], index: int, ep: Optional[ExpertParallel]) -> nn.Module:
    """The dense gated MLP in every layer."""
    return MLP(arch, tp)


def dense_or_sparse(arch: ModelArch, tp: Optional[TensorParallel], index: int,
                    ep: Optional[ExpertParallel]) -> nn.Module:
    """The Llama family's MLP: the router and experts (``SparseMoe``) in a
    sparse layer (``arch.sparse_layers``), the dense gated MLP elsewhere."""
    if index in arch.sparse_layers:
        return SparseMoe(arch, ep.comm if ep is not None else (tp.comm if tp is not None else None), ep, tp)
    return MLP(arch, tp)


_NORMS = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
}


@dataclass(frozen=True)
class LayerSpec:
    """How an architecture's decoder layer is put together."""

    norm: type[RMSNorm] = RMSNorm
    norms: str = "pre"  # where the norms sit: "pre", "post" or "sandwich" (the module's table)
    attention: AttentionFactory = Attention
    mlp: MlpFactory = dense_or_sparse
    residual_multiplier: bool = False  # each branch's output times ``arch.residual_multiplier`` (Granite)
    # the entry of the model's rope rows a layer takes, by its index (None: the rows are every layer's): the
    # rows then come as tuples, one entry per kind (Gemma 3's local layers' own rope base; Llama 4's NoPE
    # layers' query temperature)
    rope_kind: Optional[Callable[[ModelArch, int], int]] = None

    def __post_init__(self) -> None:
        if self.norms not in _NORMS:
            raise ValueError(f"LayerSpec.norms={self.norms!r}: one of {', '.join(_NORMS)}")


DEFAULT_SPEC = LayerSpec()  # the Llama family's


class DecoderLayer(nn.Module):
    """Layer ``index`` of the whole model as ``spec`` declares it. ``sparse``:
    its MLP is the Llama family's router and experts (``SparseMoe``), which
    expert parallelism, EPLB and the experts' loaders act on."""

    def __init__(self, spec: LayerSpec, arch: ModelArch, backend: AttentionBackend,
                 tp: Optional[TensorParallel] = None, index: int = 0, ep: Optional[ExpertParallel] = None):
        super().__init__()
        self.norm_names = _NORMS[spec.norms]
        for name in self.norm_names:
            if name is not None:
                setattr(self, name, spec.norm(arch.hidden_size, arch.rms_norm_eps))
        self.self_attn: Attention = spec.attention(arch, backend, tp, index)
        self.mlp = spec.mlp(arch, tp, index, ep)
        self.sparse = isinstance(self.mlp, SparseMoe)
        self.multiplier = arch.residual_multiplier if spec.residual_multiplier else None
        self.rope_kind = spec.rope_kind(arch, index) if spec.rope_kind is not None else None

    def _norm(self, i: int, x: torch.Tensor) -> torch.Tensor:
        name = self.norm_names[i]
        return x if name is None else getattr(self, name)(x)

    def _branch(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.multiplier is None else x * self.multiplier

    def forward(self, x: torch.Tensor, cos: Any, sin: Any, kv_cache: Any, attn_metadata: Any) -> torch.Tensor:
        if self.rope_kind is not None:
            cos, sin = cos[self.rope_kind], sin[self.rope_kind]
        attn = self.self_attn(self._norm(0, x), cos, sin, kv_cache, attn_metadata)
        x = x + self._branch(self._norm(1, attn))
        return x + self._branch(self._norm(3, self.mlp(self._norm(2, x))))
