"""Granite (``GraniteForCausalLM``), declared on the Llama model: its layers
with Granite's multipliers on the embedding's output, on each attention and
MLP output before its residual add, and the logits divided by
``logits_scaling`` (the attention scores' multiplier is the backend's scale,
``config.sizes.attention_scale``). The native whole-step forward does not
apply them: on ``cpu_native`` the layers run one by one over its attention."""

from __future__ import annotations

import torch

from appliance.models.layers.decoder import LayerSpec
from appliance.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    family = "granite"
    layer_spec = LayerSpec(residual_multiplier=True)
    llama_layers = False  # weights_view cannot carry the multipliers

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super()._embed(input_ids) * self.arch.embedding_multiplier

    def _logits(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return super()._logits(x, logits_indices) / self.arch.logits_scaling
