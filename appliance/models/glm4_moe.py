"""GLM-4.5 (``Glm4MoeForCausalLM``), declared from the layer library: the
Llama family's layers (q, k and v biased where its config says, o never;
q/k norms per head where it says; rope over the first half of each head's
channels) whose sparse layers route as DeepSeek-V3 does
(``layers.moe.grouped_route``: sigmoid scores, the checkpoint's score
correction, groups of experts, the routed scaling factor) beside shared
experts, after its first dense layers. The native whole-step forward does
not route so: on ``cpu_native`` the layers run one by one over its
attention. The checkpoint's multi-token-prediction layer (past the model's
layers) is not read."""

from __future__ import annotations

from appliance.models.llama import LlamaForCausalLM


class Glm4MoeForCausalLM(LlamaForCausalLM):
    family = "glm4_moe"
    llama_layers = False  # the native forward's experts softmax their router and have no shared experts
