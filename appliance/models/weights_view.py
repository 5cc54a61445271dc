"""The model's tensors and projection modules as an executor that runs the
whole step itself reads them (``kernels/cpu_native_forward.py``):
``ModelWeights`` of ``LayerWeights``, made by ``weights_view``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, cast

import torch
from torch import nn

from appliance.models.arch import ModelArch
from appliance.models.layers.mlp import MLP
from appliance.models.layers.moe import SparseMoe
from appliance.models.layers.norm import RMSNorm
from appliance.models.layers.parallel import PipelineParallel, TensorParallel
from appliance.models.layers.rotary import rope_tables

if TYPE_CHECKING:
    from appliance.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer: norm weights and the live projection modules
    (``nn.Linear`` or a quantized linear such as ``Int8WeightOnlyLinear``)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    q_norm: Optional[torch.Tensor]  # qk_norm models only
    k_norm: Optional[torch.Tensor]
    qkv_proj: nn.Module  # rows q | k | v
    o_proj: nn.Module
    gate_up_proj: Optional[nn.Module]  # rows gate | up; None in a sparse layer
    down_proj: Optional[nn.Module]
    k_scale: float = 1.0  # an fp8 KV cache holds k / k_scale (and v / v_scale)
    v_scale: float = 1.0
    moe: Optional[SparseMoe] = None  # a sparse layer's router and experts


@dataclass(frozen=True)
class ModelWeights:
    """What ``LlamaForCausalLM.weights_view`` hands an executor that runs the
    whole step itself: the architecture, the tensors and projection modules
    (not copies), and fp32 rope tables over the cached positions. A
    tensor-parallel rank's (``tp``) are its part: ``arch`` the dimensions it
    holds (its vocabulary rows among them), ``vocab_size`` the whole
    vocabulary, the logits' width."""

    arch: ModelArch
    embed: Optional[torch.Tensor]  # [vocab, hidden], looked up one row per token; None on a middle pipeline stage
    # (or where the model looks its rows up itself: ``embed_rows``)
    final_norm: Optional[torch.Tensor]  # None on a pipeline stage before the last
    layers: tuple[LayerWeights, ...]
    lm_head: Optional[nn.Module]  # the LM head's own projection (untied or quantized); None: tied to ``embed``
    # (or, on a pipeline stage before the last, no head)
    rope_cos: torch.Tensor  # [positions, head_dim] fp32
    rope_sin: torch.Tensor
    vocab_size: int
    tp: Optional[TensorParallel] = None
    pp: Optional[PipelineParallel] = None  # a pipeline stage's: ``layers`` are its own
    # ids -> their rows, where the embedding is no table (``gguf_blocks.TiedBlockEmbedding``: the head's blocks)
    embed_rows: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


def weights_view(model: LlamaForCausalLM) -> ModelWeights:
    """``model``'s tensors and projections as they are now (after any
    quantization): the Llama family's layers (``llama_layers``)."""
    assert model.rope is not None, "call rope_cache() once before weights_view()"
    cos, sin = model.rope
    if cos.dtype != torch.float32:  # fp32 angles, not bf16-rounded ones
        cos, sin = rope_tables(model.arch, model.rope_positions)
    layers = []
    for layer in model.model.decoder_layers():
        attn, mlp = layer.self_attn, cast(MLP, layer.mlp)
        dense = not layer.sparse
        layers.append(LayerWeights(
            input_norm=cast(RMSNorm, layer.input_layernorm).weight.data,
            post_attention_norm=cast(RMSNorm, layer.post_attention_layernorm).weight.data,
            q_norm=attn.q_norm.weight.data if model.arch.qk_norm else None,
            k_norm=attn.k_norm.weight.data if model.arch.qk_norm else None,
            qkv_proj=attn.qkv_proj, o_proj=attn.o_proj, gate_up_proj=mlp.gate_up_proj if dense else None,
            down_proj=mlp.down_proj if dense else None, k_scale=attn.backend.k_scale,
            v_scale=attn.backend.v_scale, moe=None if dense else cast(SparseMoe, layer.mlp),
        ))
    if not model.holds_head:
        lm_head = None
    elif model.lm_head_q is not None:
        lm_head = model.lm_head_q
    else:
        lm_head = None if model.arch.tie_word_embeddings else model.lm_head
    embed = model.model.embed_tokens if model.holds_embedding else None
    table = embed if isinstance(embed, nn.Embedding) else None
    return ModelWeights(arch=model.arch, embed=table.weight.data if table is not None else None,
                        final_norm=model.model.norm.weight.data if model.holds_head else None, layers=tuple(layers),
                        lm_head=lm_head, rope_cos=cos, rope_sin=sin, vocab_size=model.vocab_size, tp=model.tp,
                        pp=model.pp, embed_rows=embed if embed is not None and table is None else None)
