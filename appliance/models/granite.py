"""Granite (``GraniteForCausalLM``), declared on the Llama model: its layers
with Granite's multipliers on the embedding's output, on each attention and
MLP output before its residual add, and the logits divided by
``logits_scaling`` (the attention scores' multiplier is the backend's scale,
``config.sizes.attention_scale``). The native whole-step forward does not
apply them: on ``cpu_native`` the layers run one by one over its attention."""

from __future__ import annotations

from typing import Any

import torch

from appliance.models.arch import ModelArch
from appliance.models.llama import DecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, arch: ModelArch, *args: Any, **kwargs: Any):
        super().__init__(arch, *args, **kwargs)
        self.residual_multiplier = arch.residual_multiplier

    def forward(self, x, cos, sin, kv_cache, attn_metadata):
        r = self.residual_multiplier
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn_metadata) * r
        return x + self.mlp(self.post_attention_layernorm(x)) * r


class GraniteForCausalLM(LlamaForCausalLM):
    family = "granite"
    layer_class = GraniteDecoderLayer
    llama_layers = False  # weights_view cannot carry the multipliers

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super()._embed(input_ids) * self.arch.embedding_multiplier

    def _logits(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return super()._logits(x, logits_indices) / self.arch.logits_scaling
