"""FlashInfer's CUTLASS fused mixture-of-experts, for a sparse layer's
float experts (bf16 / fp16) on the GPUs its kernels are built for (SM89,
Hopper SM90, Blackwell SM100/103/110/120) where ``flashinfer`` is
importable: ``models.layers.moe.FusedExperts`` prefers it to the Triton kernel
(``appliance/kernels/triton_moe.py``) there.

Its contract (``flashinfer.fused_moe.cutlass_fused_moe``): ``input`` [T,
H]; ``token_selected_experts`` int32 [T, top_k] and
``token_final_scales`` fp32 [T, top_k]; ``fc1_expert_weights`` [E, 2I, H]
holding each expert's **up rows, then its gate rows** (the kernel's
SwiGLU is silu(second half) x first half: vLLM swaps its gate|up stack the
same way), ``fc2_expert_weights`` [E, H, I]; with ``ep_size`` ranks the
ids are global and rank ``ep_rank`` holds experts ``ep_rank x E .. (ep_rank
+ 1) x E - 1``, pairs routed elsewhere adding nothing. It returns the
weighted sum over each token's pairs, [T, H] in ``output_dtype``.

Our experts are stacked gate rows first (``FusedExperts.w13``):
``up_first`` swaps the halves (its own inverse), once, when the layer first
runs here. ``reference`` is that contract in torch, what the tests hold
the plumbing against on CPUs. The kernels are compiled by FlashInfer's JIT
on first use (or come from ``flashinfer-jit-cache``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from appliance.kernels import providers

ARCHS = ("89", "90", "100", "103", "107", "110", "120", "121")  # the archs its CUTLASS MoE is built for
DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _kernel() -> Optional[Callable]:
    try:
        from flashinfer.fused_moe import cutlass_fused_moe
    except (ImportError, OSError):
        return None
    return cutlass_fused_moe


def unusable_reason(x: torch.Tensor) -> Optional[str]:
    """None when FlashInfer's fused MoE runs experts on ``x``'s device and dtype, else why not."""
    if x.device.type != "cuda" or torch.version.hip is not None:
        return f"it runs on NVIDIA GPUs, not {x.device.type}{' (ROCm)' if torch.version.hip else ''}"
    if x.dtype not in DTYPES:
        return f"it takes bf16 or fp16 activations, not {x.dtype}"
    major, minor = torch.cuda.get_device_capability(x.device)
    if f"{major * 10 + minor}" not in ARCHS:
        return f"its kernels are built for SM {', '.join(ARCHS)}, not {major}{minor}"
    why = providers.probe("flashinfer.fused_moe")
    return f"flashinfer.fused_moe {why}" if why else None


def usable(x: torch.Tensor) -> bool:
    """Whether FlashInfer's fused MoE runs experts on ``x``'s device and dtype."""
    return unusable_reason(x) is None


def up_first(w13: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] gate rows then up rows as up rows then gate rows (and back)."""
    inter = w13.shape[1] // 2
    return torch.cat([w13[:, inter:], w13[:, :inter]], dim=1).contiguous()


def fused_experts(x: torch.Tensor, w31: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  first: int, num_slots: int, kernel: Optional[Callable] = None) -> torch.Tensor:
    """Sum over each token's routed slots ``first .. first + len(w31) - 1``
    of weight x down(silu(gate x) * up x): ``w31`` up rows first
    (``up_first``), ids slot ids of all ``num_slots``; ``kernel``: FlashInfer's
    (None), or a stand-in keeping its contract."""
    local = w31.shape[0]
    if num_slots % local or first % local:
        raise ValueError(f"slots {first}..{first + local - 1} of {num_slots} are not one of even ranks' shares")
    run = kernel or _kernel()
    if run is None:
        raise RuntimeError("FlashInfer's fused MoE does not import here")
    out = run(x.contiguous(), ids.to(torch.int32).contiguous(), weights.float().contiguous(),
                                w31, w2, x.dtype, quant_scales=None, ep_size=num_slots // local,
                                ep_rank=first // local)
    return out[0] if isinstance(out, (list, tuple)) else out


def reference(input: torch.Tensor, token_selected_experts: torch.Tensor, token_final_scales: torch.Tensor,
              fc1_expert_weights: torch.Tensor, fc2_expert_weights: torch.Tensor, output_dtype: torch.dtype,
              quant_scales: Any = None, ep_size: int = 1, ep_rank: int = 0, **_: Any) -> torch.Tensor:
    """``cutlass_fused_moe``'s contract for float experts, in torch (fp32 sums)."""
    if token_selected_experts.dtype != torch.int32 or token_final_scales.dtype != torch.float32:
        raise TypeError("token_selected_experts must be int32 and token_final_scales fp32")
    local, inter = fc1_expert_weights.shape[0], fc2_expert_weights.shape[2]
    out = torch.zeros(input.shape[0], fc2_expert_weights.shape[1], dtype=torch.float32, device=input.device)
    for t in range(input.shape[0]):
        for j in range(token_selected_experts.shape[1]):
            e = int(token_selected_experts[t, j]) - ep_rank * local
            if 0 <= e < local:
                h = fc1_expert_weights[e].float() @ input[t].float()
                act = F.silu(h[inter:]) * h[:inter]
                out[t] += token_final_scales[t, j] * (fc2_expert_weights[e].float() @ act)
    return out.to(output_dtype)
