"""The dense gated MLP: one packed gate|up projection, SiLU(gate) * up, the
down projection (all-reduced across tensor-parallel ranks)."""

from __future__ import annotations

from typing import Optional

from torch import nn
import torch.nn.functional as F

from appliance.models.arch import ModelArch
from appliance.models.layers.parallel import TensorParallel


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, tp: Optional[TensorParallel] = None):
        super().__init__()
        self.tp = tp
        # gate and up projections packed into one GEMM (rows gate | up).
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.intermediate_size = arch.intermediate_size
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        if self.tp is not None:
            self.tp.comm.all_reduce(out)
        return out
