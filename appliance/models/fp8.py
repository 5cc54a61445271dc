"""FP8 weights (``quantization=fp8``): e4m3 weights with a scale per output
channel (or per tensor, as checkpoints store it), and with
``quantization.activations`` (W8A8) activations quantized to e4m3 per token
at run time (dynamic) or with a checkpoint's static ``input_scale``.

A projection is quantized at load from a bf16/fp16/fp32 checkpoint (scale =
the row's largest magnitude / 448), or loaded from an fp8 checkpoint
(``quantization_config.quant_method: fp8``: ``weight`` in float8_e4m3fn,
``weight_scale``, optional ``input_scale``; or, with ``weight_block_size``
[rows, inputs] as DeepSeek-V3 and Qwen3 FP8 checkpoints have it,
``weight_scale_inv`` per block of the weight, and activations quantized
per token per group of that many inputs, dynamically).

W8A8 on CUDA runs ``torch._scaled_mm`` (row-wise scales: per-token
activations, per-channel weights; Hopper and Blackwell) where its inputs
and outputs are multiples of 16 (``scaled_mm_fits``; a projection of
other sizes, a tensor-parallel shard say, takes the reference path); on
ROCm CDNA3 the same on e4m3fnuz, whose bit patterns mean half the e4m3fn
value, so the scales double. Weight-only fp8, block-wise scales and every CPU take a
reference path: the weight (and the quantized activations) dequantized
per call and an ordinary GEMM in the activation dtype; correct, not fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from appliance.models.layers.linear import Projections, replace_linear

if TYPE_CHECKING:
    from appliance.models.llama import LlamaForCausalLM

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def quantize_per_channel_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale per row) with w ~= q * scale, saturating."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_token_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None):
    """(e4m3 rows, fp32 scale per row [rows, 1]): dynamic (each row's largest
    magnitude / 448) or the checkpoint's static scalar."""
    x = x.float()
    if static_scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()  # _scaled_mm wants it dense
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_token_group_fp8(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [rows, k] as e4m3 with a scale per row per group of ``group`` inputs
    (each group's largest magnitude / 448), dequantized back: what a
    block-wise fp8 GEMM multiplies."""
    rows, k = x.shape
    pad = -k % group
    g = F.pad(x.float(), (0, pad)).reshape(rows, -1, group)
    scale = (g.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (q.float() * scale).reshape(rows, -1)[:, :k]


class Fp8Linear(nn.Module):
    """``weight_scale``: one, one per row, or (with ``block_k``) one per row
    per block of ``block_k`` inputs ([rows, ceil(k / block_k)]: a checkpoint's
    block scales repeated over their rows)."""

    weight_fp8: torch.Tensor  # buffers
    weight_scale: torch.Tensor
    input_scale: Optional[torch.Tensor]
    _fnuz: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # the weight as AMD CDNA3's GEMM takes it

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 activations: bool, input_scale: torch.Tensor | None = None, block_k: int = 0):
        super().__init__()
        if weight.dtype != FP8:
            raise ValueError(f"fp8 weights are float8_e4m3fn, not {weight.dtype}")
        n, k = weight.shape
        if block_k:
            scale = weight_scale.float()
            if scale.shape != (n, -(-k // block_k)):
                raise ValueError(f"an fp8 weight [{n}, {k}] in blocks of {block_k} inputs has scales of shape "
                                 f"{tuple(scale.shape)}, not ({n}, {-(-k // block_k)})")
            if input_scale is not None:
                raise ValueError("block-wise fp8 quantizes activations per token group: no static input_scale")
        else:
            scale = weight_scale.float().reshape(-1)
            if scale.numel() not in (1, n):
                raise ValueError(f"an fp8 weight of {n} rows has {scale.numel()} scales (one, or one per row)")
            scale = scale.expand(n)
        self.block_k = block_k
        self.register_buffer("weight_fp8", weight.contiguous())
        self.register_buffer("weight_scale", scale.contiguous())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(()))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.activations = activations
        self.out_features, self.in_features = weight.shape

    @property
    def scaled_mm_fits(self) -> bool:
        """Whether ``torch._scaled_mm`` takes this projection: it needs its
        inputs and outputs to be multiples of 16."""
        return self.in_features % 16 == 0 and self.out_features % 16 == 0

    def dequantized_weight(self) -> torch.Tensor:
        if self.block_k:
            k = self.in_features
            return self.weight_fp8.float() * self.weight_scale.repeat_interleave(self.block_k, dim=1)[:, :k]
        return self.weight_fp8.float() * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if x.is_cuda and self.activations and not self.block_k and self.scaled_mm_fits:
            y = self._scaled_mm(rows)
        else:
            if self.activations and self.block_k:
                rows = quantize_per_token_group_fp8(rows, self.block_k).to(x.dtype)
            elif self.activations:
                xq, xs = quantize_per_token_fp8(rows, self.input_scale)
                rows = (xq.float() * xs).to(x.dtype)
            y = F.linear(rows, self.dequantized_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return y.reshape(*x.shape[:-1], self.out_features)

    def _scaled_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """W8A8 on the GPU's fp8 tensor cores: torch._scaled_mm with row-wise
        scales (the activation rows padded to a multiple of 16), bf16 out
        (the output row-wise scaling supports everywhere), then the model's
        dtype."""
        xq, xs = quantize_per_token_fp8(rows, self.input_scale)
        w, ws = self._device_weight()
        if w.dtype == torch.float8_e4m3fnuz:
            xq, xs = _to_fnuz(xq), xs * 2
        m = rows.shape[0]
        pad = -m % 16
        if pad:
            xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(xq.dtype)
            xs = F.pad(xs, (0, 0, 0, pad), value=1.0)
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.view(1, -1), bias=bias, out_dtype=torch.bfloat16)
        return y[:m].to(rows.dtype)

    def _device_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight and its scales as the GPU's fp8 GEMM takes them: e4m3fnuz
        with doubled scales on AMD CDNA3 (MI300: the same bits are half the
        value, and 0x80 is its NaN), converted once; e4m3fn elsewhere."""
        if not _fnuz_device(self.weight_fp8.device):
            return self.weight_fp8, self.weight_scale
        if self._fnuz is None:
            self._fnuz = (_to_fnuz(self.weight_fp8), self.weight_scale * 2)
        return self._fnuz


def _fnuz_device(device: torch.device) -> bool:
    """ROCm on CDNA3 (gfx94x) takes e4m3fnuz; later AMD GPUs and NVIDIA take e4m3fn."""
    return torch.version.hip is not None and "gfx94" in torch.cuda.get_device_properties(device).gcnArchName


def _to_fnuz(x: torch.Tensor) -> torch.Tensor:
    """e4m3fn bits as e4m3fnuz (half the value; -0, fnuz's NaN, becomes 0)."""
    xi = x.view(torch.int8)
    return torch.where(xi == -128, torch.zeros_like(xi), xi).view(torch.float8_e4m3fnuz)


# an fp8 checkpoint's projection tensors (weight_scale_inv: block-wise scales, weight_block_size)
CHECKPOINT_TENSORS = ("weight", "weight_scale", "input_scale", "weight_scale_inv")


def _row_scales(p: dict[str, torch.Tensor], block: list[int] | None) -> torch.Tensor:
    """A part's scales on its rows: [rows] (per tensor or per channel), or
    [rows, k blocks] (its block scales repeated over each block's rows)."""
    rows, k = p["weight"].shape
    if block is None:
        return p["weight_scale"].float().reshape(-1).expand(rows)
    bn, bk = block
    s = p["weight_scale_inv"].float()
    if s.shape != (-(-rows // bn), -(-k // bk)):
        raise ValueError(f"block scales of shape {tuple(s.shape)} do not cover a [{rows}, {k}] weight in [{bn}, {bk}] "
                         f"blocks")
    return s.repeat_interleave(bn, dim=0)[:rows]


def install_fp8(model: LlamaForCausalLM, parts: dict[str, dict[str, torch.Tensor]], activations: bool,
                block: list[int] | None = None, full_arch: Any = None, tp: Any = None, ep: Any = None,
                projections: Optional[Projections] = None) -> set[str]:
    """An fp8 checkpoint's projections (by checkpoint weight name: its
    ``weight``, ``weight_scale`` and optional ``input_scale``; with
    ``block`` = weight_block_size, ``weight_scale_inv`` per block) as
    Fp8Linear modules; a fused projection stacks its parts with each part's
    scales on its rows and the largest static input scale (as vLLM takes).
    With ``tp`` (a ``layers.parallel.TensorParallel``; ``full_arch`` the whole
    model's), each part is cut to the rank's rows or inputs as
    ``layers.parallel.tensor_shard`` cuts a dense weight (``projections``:
    the model's linears, found here when not given), its scales with it (block
    scales by whole blocks of inputs). Experts' projections
    (``...mlp.experts.E.gate_proj.weight``) become their layers' experts
    (``install_fp8_experts``): each rank's slice of every expert, or with
    expert parallelism (``ep``) its whole experts. Returns the module
    weight names replaced."""
    from appliance.models.layers.parallel import tensor_shard

    experts = {name: p for name, p in parts.items() if ".mlp.experts." in name}
    if "lm_head.weight" in parts:
        raise ValueError("an fp8 LM head is not built yet (fp8 projections only; keep lm_head in the model dtype)")
    needed = ("weight", "weight_scale_inv") if block else ("weight", "weight_scale")
    for name, p in parts.items():
        missing = [t for t in needed if t not in p]
        if missing:
            raise ValueError(f"fp8 projection {name} lacks {', '.join(missing)}")
    parts_all, parts = parts, {name: p for name, p in parts.items() if name not in experts}
    projections = projections or Projections(model)
    groups = projections.fused_parts(parts)

    def rank_part(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, scales on its rows) of this rank."""
        weight, scale = parts_all[name]["weight"], _row_scales(parts_all[name], block)
        span = None if tp is None else tensor_shard(full_arch, tp.rank, tp.size, name, projections)
        if span is None:
            return weight, scale
        dim, start, stop = span
        if dim == 0:
            return weight[start:stop], scale[start:stop]
        if block is None:
            return weight[:, start:stop], scale
        bk = block[1]
        if start % bk or stop % bk:
            raise ValueError(f"{name}: rank {tp.rank} of {tp.size} holds inputs {start}..{stop}, which cut its "
                             f"fp8 scale blocks of {bk}; use a tensor-parallel size that splits whole blocks")
        return weight[:, start:stop], scale[:, start // bk : stop // bk]

    def make(names: list[str]):
        def build(lin: nn.Linear) -> nn.Module:
            out = _stacked_fp8([rank_part(n) for n in names], [parts[n] for n in names], activations, block,
                               None if lin.bias is None else lin.bias.data)
            if (out.out_features, out.in_features) != (lin.out_features, lin.in_features):
                raise ValueError(f"fp8 weights of shape {(out.out_features, out.in_features)} for a projection of "
                                 f"{(lin.out_features, lin.in_features)}")
            return out
        return build

    for target, names in groups.items():
        replace_linear(model, target, make(names))
    if not experts:
        return set(groups)
    return set(groups) | install_fp8_experts(model, experts, activations, block,
                                             lambda n: (parts_all[n]["weight"], _row_scales(parts_all[n], block))
                                             if ep is not None else rank_part(n))


def _stacked_fp8(cut: list[tuple[torch.Tensor, torch.Tensor]], parts: list[dict[str, torch.Tensor]],
                 activations: bool, block: list[int] | None, bias: torch.Tensor | None) -> Fp8Linear:
    """One Fp8Linear of parts stacked in row order (``cut``: each part's
    weight and scales on its rows), with the largest static input scale."""
    static = [p["input_scale"] for p in parts if "input_scale" in p]
    input_scale = torch.stack([s.float().reshape(()) for s in static]).max() if static else None
    return Fp8Linear(torch.cat([w for w, _ in cut]), torch.cat([sc for _, sc in cut]), bias, activations,
                     input_scale, block_k=block[1] if block else 0)


def install_fp8_experts(model: LlamaForCausalLM, parts: dict[str, dict[str, torch.Tensor]], activations: bool,
                        block: list[int] | None,
                        cut: Callable[[str], tuple[torch.Tensor, torch.Tensor]]) -> set[str]:
    """Each sparse layer's experts from an fp8 checkpoint's tensors: gate|up
    stacked into one Fp8Linear, down another, each part as ``cut(name)``
    gives it (weight, scales on its rows: whole, or a rank's slice).
    Returns the module weights filled."""
    from appliance.models.layers.moe import install_checkpoint_experts

    def build(names: list[str]) -> Fp8Linear:
        return _stacked_fp8([cut(n) for n in names], [parts[n] for n in names], activations, block, None)

    return install_checkpoint_experts(model.model.sparse_mlps(), parts, "fp8", build)


def quantize_fp8(model: LlamaForCausalLM, activations: bool) -> LlamaForCausalLM:
    """Every decoder projection and expert to fp8 with per-channel scales, in
    place (the LM head, embedding and routers stay in the model dtype, as
    vLLM keeps them)."""
    from appliance.models.quant import replace_projections

    replace_projections(model, lambda w, b: Fp8Linear(*quantize_per_channel_fp8(w), b, activations))
    for _, mlp in model.model.sparse_mlps():  # every expert's gate|up and down, per output channel the same way
        mlp.experts.quantize("fp8", lambda w: Fp8Linear(*quantize_per_channel_fp8(w), None, activations))
    return model
