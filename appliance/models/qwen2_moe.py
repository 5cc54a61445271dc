"""Qwen2-MoE (``Qwen2MoeForCausalLM``: Qwen1.5-MoE, Qwen2-57B-A14B), declared
from the layer library: Qwen2's layers (a bias on q, k and v; sliding
windows where its config says) whose sparse layers route as Qwen3-MoE's do
beside a shared expert whose output each token gates
(``layers.moe.SparseMoe.shared_expert_gate``; the checkpoint's
``mlp.shared_expert`` is the layer's ``shared_experts``,
``llama.canonical_name``). The native whole-step forward has no shared
experts: on ``cpu_native`` the layers run one by one over its attention."""

from __future__ import annotations

from appliance.models.llama import LlamaForCausalLM


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    family = "qwen2_moe"
    llama_layers = False  # the native forward's sparse layers have no shared expert
