"""The dense gated MLP: one packed gate|up projection, act(gate) * up (SiLU;
a subclass's ``activation``), the down projection (all-reduced across
tensor-parallel ranks)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from appliance.models.arch import ModelArch
from appliance.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from appliance.models.layers.parallel import TensorParallel, row_parallel_output


class MLP(nn.Module):
    """``span``: the rows it has, the dense MLP's ("inter": ``intermediate_size``) or a sparse layer's shared
    experts' ("shared": ``shared_expert_intermediate_size``)."""

    def __init__(self, arch: ModelArch, tp: Optional[TensorParallel] = None, span: str = "inter"):
        super().__init__()
        self.tp = tp
        width = arch.intermediate_size if span == "inter" else arch.shared_expert_intermediate_size
        # gate and up projections packed into one GEMM (rows gate | up).
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, ("gate_proj", "up_proj"), span, width)
        self.intermediate_size = width
        self.down_proj = RowParallelLinear(width, arch.hidden_size, "down_proj", span)

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return row_parallel_output(self.down_proj, self.activation(gate) * up, self.tp)
