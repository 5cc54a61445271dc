"""Weight-only int8 for CPU decoding (``quantization=int8_wo``).

Each packed projection and the LM head keep int8 weights with one fp32
scale per output channel (symmetric, round to nearest): a quarter of the
fp32 bytes to stream per decode step. torch's packed kernel
(``aten._weight_int8pack_mm``, bf16 activations) runs decode-sized GEMVs
about 3x faster than fp32 on an AVX2 CPU but is 20x slower at 32 rows, so
larger batches dequantize the weight and use the fp32 GEMM
(``INT8_KERNEL_MAX_ROWS`` is the switch-over).
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

INT8_KERNEL_MAX_ROWS = 4


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, fp32 scale per row) with w ~= q * scale."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8WeightOnlyLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        q, scale = quantize_per_channel(weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale)
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = q.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= INT8_KERNEL_MAX_ROWS and x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.weight_int8, self.scale_bf16).to(x.dtype)
            return y + self.bias if self.bias is not None else y
        w = self.weight_int8.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return F.linear(x, w, self.bias)


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantize_int8_weight_only(model: nn.Module) -> nn.Module:
    """Replace every decoder projection and the LM head in place."""
    for layer in model.model.layers:
        for path in PROJECTIONS:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            lin = getattr(parent, name)
            setattr(parent, name, Int8WeightOnlyLinear(lin.weight.data, lin.bias.data if lin.bias is not None else None))
    # Tied models keep the fp32 embedding for lookups; the LM head gets its own int8 copy.
    model.lm_head_q = Int8WeightOnlyLinear(model.lm_head_weight().data, None)
    if not model.arch.tie_word_embeddings:
        del model.lm_head
    return model
