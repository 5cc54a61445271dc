"""gpt-oss (``GptOssForCausalLM``), declared from the layer library: the
Llama family's attention with biased q/k/v and o projections and a learned
attention sink per head (``Attention``, the backends' ``sinks``), layers
alternating between a sliding window and full attention (KV-cache groups),
and in every layer a mixture of experts of its own: a biased router whose
top-k logits are softmaxed, and experts stacked as the checkpoint stores
them (``gate_up_proj`` [experts, hidden, 2 x inter], gate and up channels
interleaved, ``down_proj`` [experts, inter, hidden], each with its bias)
through the clamped SwiGLU. Norms weight the fp32 rows before the cast back
(OLMo 2's). The native whole-step forward does not compute these layers: on
``cpu_native`` they run layer by layer over its attention. Tensor-parallel
ranks hold their heads (and sinks) and every expert's slice of channels, or
with expert parallelism whole experts; pipeline stages their layers. A
checkpoint's MXFP4 experts stay at 4 bits (``models/mxfp4.py``; a
tensor-parallel rank's share of down_proj's inputs that is not whole groups
of 32 is dequantized at load)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from appliance.models.arch import ModelArch
from appliance.models.layers.decoder import LayerSpec
from appliance.models.layers.moe import ExpertParallel, expert_range, grouped_experts
from appliance.models.layers.norm import WeightFirstRMSNorm
from appliance.models.layers.parallel import TensorParallel
from appliance.models.llama import LlamaForCausalLM
from appliance.models.mxfp4 import mxfp4_linear


class GptOssExperts(nn.Module):
    """A layer's experts as the checkpoint stacks them, the torch path grouping each step's tokens by expert
    (``grouped_experts``): x @ gate_up_proj[e] + bias, the interleaved gate and up channels through
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) with g = min(gate, limit), then @ down_proj[e] + bias.
    A projection an MXFP4 checkpoint gives is kept at 4 bits (``hold_mxfp4``: its blocks and scales by output
    row, [experts, out, in / 32, 16] and [experts, out, in / 32]) and multiplied by ``mxfp4_linear``."""

    PROJECTIONS = ("gate_up_proj", "down_proj")

    def __init__(self, arch: ModelArch, down_bias: bool = True, experts: Optional[tuple[int, int]] = None):
        super().__init__()
        # the experts held: [first, last) of the model's (expert parallelism), else all of them
        self.first, last = experts if experts is not None else (0, arch.num_experts)
        e, h, i = last - self.first, arch.hidden_size, arch.moe_intermediate_size
        if arch.swiglu_limit is None or arch.swiglu_alpha is None:
            raise ValueError("gpt-oss's experts need swiglu_limit and swiglu_alpha (its config.json's)")
        self.num_experts, self.limit, self.alpha = e, arch.swiglu_limit, arch.swiglu_alpha
        self.down_bias = down_bias  # False on tensor-parallel ranks but the first: the bias once in their sum
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, i, h), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        for name in self.PROJECTIONS:
            self.register_buffer(f"{name}_blocks", None)
            self.register_buffer(f"{name}_scales", None)

    def hold_mxfp4(self, name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """Projection ``name`` kept as MXFP4 blocks and scales; its float parameter freed."""
        setattr(self, f"{name}_blocks", blocks)
        setattr(self, f"{name}_scales", scales)
        setattr(self, name, nn.Parameter(torch.empty(0, dtype=self.gate_up_proj_bias.dtype,
                                                     device=blocks.device), requires_grad=False))

    def _project(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        blocks = getattr(self, f"{name}_blocks")
        if blocks is None:
            return x @ getattr(self, name)[e]
        return mxfp4_linear(x, blocks[e], getattr(self, f"{name}_scales")[e])

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = self._project("gate_up_proj", e, x) + self.gate_up_proj_bias[e]
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        out = self._project("down_proj", e, (up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
        return out + self.down_proj_bias[e] if self.down_bias else out

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return grouped_experts(x, weights, ids, self.first, self.num_experts, self.expert)


class GptOssMoe(nn.Module):
    """The router (biased: each token's top-k logits softmaxed into its experts' weights), then the experts; a
    tensor-parallel rank holds its slice of every expert's intermediate channels, or under expert parallelism
    (``ep``: the tensor-parallel ranks of one engine core) whole experts, a run of them (``expert_range``), each
    with its biases; the partial sums all-reduced. The router runs in the model's dtype, as transformers and
    vLLM run gpt-oss's (in bf16 a near tie between two experts' logits falls as theirs; an fp32 router parted
    from them at a prompt's first token)."""

    def __init__(self, arch: ModelArch, tp: Optional[TensorParallel] = None, ep: Optional[ExpertParallel] = None):
        super().__init__()
        if ep is not None and not ep.replicated:
            raise ValueError("gpt-oss's experts split over one engine core's ranks, not across engine cores")
        self.top_k, self.comm = arch.num_experts_per_tok, ep.comm if ep is not None else tp.comm if tp else None
        self.router = nn.Linear(arch.hidden_size, arch.num_experts, bias=True)
        if ep is not None:  # whole experts, each bias once (on the rank holding the expert)
            self.experts = GptOssExperts(arch, experts=expert_range(arch.num_experts, ep.rank, ep.size))
        else:
            self.experts = GptOssExperts(arch, down_bias=tp is None or tp.rank == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.weight, self.router.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        out = self.experts(x, torch.softmax(top, dim=-1), ids)
        if self.comm is not None:
            self.comm.all_reduce(out)
        return out


def _experts(arch: ModelArch, tp: Optional[TensorParallel], index: int, ep: Optional[ExpertParallel]) -> GptOssMoe:
    # its experts are its own, not the Llama family's (no EPLB, no expert installing)
    return GptOssMoe(arch, tp, ep)


class GptOssForCausalLM(LlamaForCausalLM):
    family = "gpt_oss"
    # attention (with sinks), then the experts, each after its norm and before its residual add
    layer_spec = LayerSpec(norm=WeightFirstRMSNorm, mlp=_experts)
    llama_layers = False  # weights_view cannot describe them
    stacked_experts = True  # the checkpoint's expert tensors are the parameters, as stored

