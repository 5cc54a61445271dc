"""Weight-only int8 and int4 for CPU decoding (``quantization=int8_wo``,
``quantization=int4_wo``).

int8: each packed projection and the LM head keep int8 weights with one
fp32 scale per output channel (symmetric, round to nearest): a quarter of
the fp32 bytes to stream per decode step. ``quantization=w8a8_int8`` keeps
the same weights and quantizes the projections' rows to int8 per call (one
scale per token): the products sum in int32, on AVX512-VNNI where the CPU
has it.

int4: each packed projection keeps 4-bit weights w = d * q + m, q in 0..15,
with a scale d and min m per output channel per group of ``group_size``
inputs (fp16 from this quantizer; fp32 where a checkpoint's scale times an
integer zero point needs it, see ``install_int4``) (asymmetric, round to nearest; llama.cpp's Q4_1 at
group 32): 5 bits a weight at group 32. The LM head is int8 as above (it
holds a fifth of a small model's weights and its logits feel 4-bit
rounding most). The native CPU backend runs these weights as they are
(``appliance/kernels/cpu_native.py``); elsewhere a layer dequantizes its weight per
call, which is correct and slow. torch's packed kernel
(``aten._weight_int8pack_mm``, bf16 activations) runs decode-sized GEMVs
about 3x faster than fp32 on an AVX2 CPU but is 20x slower at 32 rows, so
larger batches dequantize the weight and use the fp32 GEMM
(``INT8_KERNEL_MAX_ROWS`` is the switch-over).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn
import torch.nn.functional as F

from appliance.config.quantization import INT4_GROUP_SIZES

if TYPE_CHECKING:
    from appliance.models.llama import LlamaForCausalLM

INT8_KERNEL_MAX_ROWS = 4


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, fp32 scale per row) with w ~= q * scale."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's dynamic activations: (int8 rows, fp32 scale per row) with
    q = round-half-even(x * (127 / max |x|)) and s = max |x| / 127, each in
    fp32 as the native kernel computes them (a zero row: q = 0, s = 0)."""
    x = x.float()
    amax = x.abs().amax(dim=1)
    inv = torch.where(amax > 0, torch.div(torch.full_like(amax, 127.0), amax), 0.0)  # division, not reciprocal * 127
    return torch.round(x * inv[:, None]).to(torch.int8), amax / 127.0


class Int8WeightOnlyLinear(nn.Module):
    """int8 weights with one fp32 scale per output channel. Weight-only, or
    with ``activations`` (``quantization=w8a8_int8``) W8A8: each call
    quantizes its rows to int8 (``quantize_rows_int8``), sums the products
    exactly in int32 and scales the sums, ((float)sum * row scale) * channel
    scale + bias, the native kernel's result bit for bit on every CPU."""

    weight_int8: torch.Tensor  # buffers
    scale: torch.Tensor
    scale_bf16: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, activations: bool = False):
        super().__init__()
        self.act_int8 = activations
        q, scale = quantize_per_channel(weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale)
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = q.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_int8:
            return self._w8a8(x)
        if x.shape[0] <= INT8_KERNEL_MAX_ROWS and x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.weight_int8, self.scale_bf16).to(x.dtype)
            return y + self.bias if self.bias is not None else y
        w = self.weight_int8.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return F.linear(x, w, self.bias)

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        q, s = quantize_rows_int8(rows)
        sums = int8_matmul(q, self.weight_int8)
        y = sums.float() * s[:, None] * self.scale[None, :]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def int8_matmul(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact int32 sums of int8 rows [m, k] times int8 weights [n, k]:
    ``torch._int_mm``, except for k == 1, where its oneDNN path returns wrong
    sums on CPUs with AVX512-VNNI/AMX (the outer product is taken in int32
    there), and for no rows."""
    if not q.shape[0]:
        return q.new_zeros(0, w.shape[0], dtype=torch.int32)
    if q.shape[1] == 1:
        return q.to(torch.int32) * w.to(torch.int32).t()
    return torch._int_mm(q, w.t())


def quantize_groups_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [n, k] in 0..15, d fp16 [n, k / group], m fp16 [n, k / group])
    with w ~= d * q + m per group: m is the group's minimum and d spans it to
    the maximum in 15 steps, both rounded to fp16 before q is rounded
    against them."""
    n, k = w.shape
    if group not in INT4_GROUP_SIZES or k % group:
        raise ValueError(f"int4 groups of {group} do not tile k={k} (group sizes: {INT4_GROUP_SIZES}, dividing k)")
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    d, m = ((hi - lo) / 15).to(torch.float16), lo.to(torch.float16)
    df, mf = d.float()[..., None], m.float()[..., None]
    q = torch.where(df > 0, torch.round((g - mf) / torch.where(df > 0, df, 1.0)), 0.0).clamp(0, 15)
    return q.to(torch.uint8).reshape(n, k), d, m


def dequantize_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """fp32 d * q + m, the group's d and m repeated over its inputs."""
    group = q.shape[1] // d.shape[1]
    return q.float() * d.float().repeat_interleave(group, dim=1) + m.float().repeat_interleave(group, dim=1)


class _GroupedLinear(nn.Module):
    """Weights d * q + m with a scale and min per output channel per group of
    inputs, held as buffers ``weight_attr`` (q), ``q_scale`` and ``q_min``;
    the torch path dequantizes per call (correct, not fast). With
    ``in_perm`` (a GPTQ act-order checkpoint) the stored inputs are the
    projection's inputs in that order: stored column j is input in_perm[j]."""

    weight_attr = ""
    q_scale: torch.Tensor  # buffers (and the weights under ``weight_attr``)
    q_min: torch.Tensor
    in_perm: Optional[torch.Tensor]

    def _hold(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None,
              in_perm: torch.Tensor | None = None) -> None:
        if q.dim() != 2 or d.dim() != 2 or d.shape[0] != q.shape[0] or q.shape[1] % d.shape[1] \
                or (q.shape[1] // d.shape[1]) % 2:
            raise ValueError(f"blocks of {tuple(q.shape)} weights with {tuple(d.shape)} scales: each row's "
                             f"groups must tile its inputs in an even number of weights")
        if in_perm is not None and not torch.equal(torch.sort(in_perm).values, torch.arange(q.shape[1])):
            raise ValueError(f"an input order of {q.shape[1]} inputs must be a permutation of them")
        self.register_buffer(self.weight_attr, q)
        self.register_buffer("q_scale", d)
        self.register_buffer("q_min", m)
        self.register_buffer("in_perm", None if in_perm is None else in_perm.to(torch.int64))
        self.group = q.shape[1] // d.shape[1]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = q.shape

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [out, in], inputs in the projection's own order."""
        w = dequantize_int4(getattr(self, self.weight_attr), self.q_scale, self.q_min)
        if self.in_perm is None:
            return w
        natural = torch.empty_like(w)
        natural[:, self.in_perm] = w
        return natural

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantized().to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def _through(self, x: torch.Tensor, gemm) -> torch.Tensor:
        """``gemm(rows)`` over x's rows, inputs in the stored order (gathered
        for act-order), shaped back to x's leading dimensions."""
        rows = x.reshape(-1, x.shape[-1])
        if self.in_perm is not None:
            rows = rows.index_select(1, self.in_perm)
        return gemm(rows).reshape(*x.shape[:-1], self.out_features)


class Int4WeightOnlyLinear(_GroupedLinear):
    """4-bit weights with group scales and mins (fp16, or fp32), from a float
    weight (quantized here) or from given (q, d, m) (a checkpoint's own blocks);
    on CUDA/ROCm through the Marlin GEMM where it takes them (integer zero
    points: AWQ and GPTQ; ``appliance/kernels/marlin_int4.py``), else the Triton int4
    GEMM."""

    weight_attr = "weight_q4"
    weight_q4: torch.Tensor  # buffers
    weight_rows: Optional[torch.Tensor]
    marlin_words: Optional[torch.Tensor]
    marlin_scales: Optional[torch.Tensor]
    marlin_zeros: Optional[torch.Tensor]

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, group: int = 32,
                 blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 in_perm: torch.Tensor | None = None):
        super().__init__()
        if blocks is None:
            if weight is None:
                raise ValueError("an int4 linear is made from a float weight or from its blocks")
            blocks = quantize_groups_int4(weight, group)
        q, d, m = blocks
        if q.dtype != torch.uint8 or d.dtype not in (torch.float16, torch.float32) or m.dtype != d.dtype \
                or d.shape != m.shape:
            raise ValueError("int4 blocks are uint8 q with fp16 (or fp32) scales and mins of one dtype and shape")
        self._hold(q, d, m, bias, in_perm)
        self.register_buffer("weight_rows", None)  # on a GPU: two k per byte, for the Triton GEMM
        # or, for the Marlin GEMM: GPTQ words (Marlin's tiles once on the device), scales, zero points
        self.register_buffer("marlin_words", None)
        self.register_buffer("marlin_scales", None)
        self.register_buffer("marlin_zeros", None)
        self.marlin_tiled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return super().forward(x)
        return self._marlin(x) if self.marlin_words is not None else self._triton(x)

    def prepare_for(self, device: torch.device, dtype: torch.dtype) -> None:
        """Lay the weight out for ``device``'s GEMM with ``dtype`` activations
        and free the unpacked one (the runner does it before moving the model
        to a GPU, so the device holds 4 bits a weight): Marlin's layouts where
        it runs and takes these blocks, else two k per byte for the Triton GEMM."""
        from appliance.kernels import marlin_int4

        if self.weight_rows is not None or self.marlin_words is not None:
            return
        marlin = marlin_int4.prepare(self.weight_q4, self.q_scale, self.q_min, dtype) \
            if marlin_int4.usable(device, dtype) else None
        if marlin is None:
            self.pack_rows()
            return
        self.marlin_words, self.marlin_scales, self.marlin_zeros = marlin
        self.weight_q4 = torch.empty(0, dtype=torch.uint8, device=self.marlin_words.device)

    def pack_rows(self) -> None:
        """Repack the weight two k per byte for the Triton GEMM and free the unpacked one."""
        from appliance.kernels.triton_int4 import pack_int4_rows

        if self.weight_rows is None:
            self.weight_rows = pack_int4_rows(self.weight_q4)
            self.weight_q4 = torch.empty(0, dtype=torch.uint8, device=self.weight_rows.device)

    def _triton(self, x: torch.Tensor) -> torch.Tensor:
        """CUDA/ROCm: the Triton int4 GEMM (appliance/kernels/triton_int4.py)."""
        from appliance.kernels.triton_int4 import int4_gemm

        self.pack_rows()
        packed = self.weight_rows
        assert packed is not None
        return self._through(x, lambda rows: int4_gemm(rows, packed, self.q_scale, self.q_min, self.bias))

    def _marlin(self, x: torch.Tensor) -> torch.Tensor:
        """CUDA: the Marlin GEMM (appliance/kernels/marlin_int4.py), its tiles made on first use."""
        from appliance.kernels import marlin_int4

        words, scales, zeros = self.marlin_words, self.marlin_scales, self.marlin_zeros
        assert words is not None and scales is not None, "prepare_for() chose Marlin"  # zeros: None when symmetric
        if not self.marlin_tiled:
            words = self.marlin_words = marlin_int4.repack(words, self.out_features, self.in_features)
            self.marlin_tiled = True
        return self._through(x, lambda rows: marlin_int4.gemm(
            rows.to(scales.dtype), words, scales, zeros, self.out_features, self.bias).to(x.dtype))


class GroupedInt8Linear(_GroupedLinear):
    """int8 weights with fp32 group scales and mins: GGUF's Q8_0, Q5_K and
    Q6_K kept at their width, GPTQ 8-bit, and int4 parts fused beside them.
    The native CPU backend runs it as it is; CUDA/ROCm the Triton grouped
    int8 GEMM (groups of a multiple of 16; others dequantize per call);
    elsewhere the torch path."""

    weight_attr = "weight_q8"
    weight_q8: torch.Tensor  # buffers (the native backend's panels once it packs them)
    weight_packed: torch.Tensor
    qparams_packed: torch.Tensor

    def __init__(self, blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor], bias: torch.Tensor | None,
                 in_perm: torch.Tensor | None = None):
        super().__init__()
        q, d, m = blocks
        if q.dtype != torch.int8 or d.dtype != torch.float32 or m.dtype != d.dtype or d.shape != m.shape:
            raise ValueError(f"grouped int8 blocks are int8 q with fp32 scales and mins of one shape; got {q.dtype} "
                             f"q, {d.dtype} {tuple(d.shape)} scales, {m.dtype} {tuple(m.shape)} mins")
        self._hold(q, d, m, bias, in_perm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from appliance.kernels.triton_int4 import int8_block_k

            if int8_block_k(self.group) is not None:
                return self._triton(x)
        return super().forward(x)

    def _triton(self, x: torch.Tensor) -> torch.Tensor:
        """CUDA/ROCm: the Triton grouped int8 GEMM (appliance/kernels/triton_int4.py)."""
        from appliance.kernels.triton_int4 import int8_gemm

        return self._through(x, lambda rows: int8_gemm(rows, self.weight_q8, self.q_scale, self.q_min, self.bias))

    def rows(self, channels: torch.Tensor) -> torch.Tensor:
        """The dequantized weight's rows (d q + m, fp32, as ``dequantize_int4`` computes them) of the given
        output channels, read from the blocks as stored: row-major, or in the native backend's panels
        (``weight_packed`` int8 [panels, in, 16], or uint8 [panels, in / 4, 16, 4]: its int8 rows' k quads
        + 128; ``qparams_packed`` [panels, groups, 2, 16]) once it packed them and let the row-major copy go.
        An embedding tied to this head looks its tokens up here."""
        if self.in_perm is not None:
            raise ValueError("rows of an act-order (GPTQ g_idx) linear are stored in another input order")
        c = channels.reshape(-1).to(torch.int64)
        if self.weight_q8.numel():
            q, d, m = self.weight_q8[c], self.q_scale[c], self.q_min[c]
        else:
            panel, lane = c // 16, c % 16
            q = self.weight_packed[panel, :, lane]  # quads: [channels, in / 4, 4], k = 4 j + i
            if self.weight_packed.dtype == torch.uint8:
                q = q.reshape(len(c), -1).to(torch.int16) - 128
            d, m = self.qparams_packed[panel, :, 0, lane], self.qparams_packed[panel, :, 1, lane]
        return q.float() * d.repeat_interleave(self.group, dim=1) + m.repeat_interleave(self.group, dim=1)


def _input_order(target: str, parts: list[tuple]) -> torch.Tensor | None:
    """The input order (``perm``, a 4th block entry) the fused parts share;
    parts read one input, so they must share it."""
    perms = [p[3] if len(p) > 3 else None for p in parts]
    first = perms[0]
    if any(p is None for p in perms) != all(p is None for p in perms) or \
            any(p is not None and first is not None and not torch.equal(p, first) for p in perms):
        raise ValueError(f"{target}: its parts hold their inputs in different act-order orders (GPTQ g_idx), and "
                         f"fused parts read one input; fusing them is not supported")
    return perms[0]


def _as_grouped_int8(parts: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack blocks of 4- and 8-bit parts as int8 with fp32 parameters at the
    finest group among them (a coarser part's d and m repeat over its
    sub-groups): the same weights, exactly."""
    groups = [p[0].shape[1] // p[1].shape[1] for p in parts]
    fine = math.gcd(*groups)
    q = torch.cat([torch.as_tensor(p[0]).to(torch.int8) for p in parts])
    d, m = (torch.cat([torch.as_tensor(p[i]).float().repeat_interleave(g // fine, dim=1) for p, g in zip(parts, groups)])
            for i in (1, 2))
    return q, d, m


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def replace_projections(model: LlamaForCausalLM,
                        make: Callable[[torch.Tensor, Optional[torch.Tensor]], nn.Module]) -> None:
    """Every decoder projection replaced by ``make(weight, bias or None)``
    (a sparse layer's experts are quantized by ``quantize_experts``)."""
    for layer in model.model.decoder_layers():
        for path in PROJECTIONS:
            parent_name, name = path.split(".")
            if parent_name == "mlp" and getattr(layer, "sparse", False):
                continue
            parent = getattr(layer, parent_name)
            lin = getattr(parent, name)
            setattr(parent, name, make(lin.weight.data, lin.bias.data if lin.bias is not None else None))


def _int8_lm_head(model: LlamaForCausalLM) -> None:
    # Tied models keep the embedding for lookups; the LM head gets its own int8 copy.
    if not getattr(model, "holds_head", True):  # a pipeline stage before the last has none
        return
    model.lm_head_q = Int8WeightOnlyLinear(model.lm_head_weight().data, None)
    if not model.arch.tie_word_embeddings:
        del model.lm_head


def quantize_experts(model: LlamaForCausalLM, method: str, group: int = 32) -> None:
    """Every sparse layer's experts to ``method`` (``int8_wo``, ``w8a8_int8``
    or ``int4_wo``); routers stay fp32."""
    make = {"int8_wo": lambda w: Int8WeightOnlyLinear(w, None),
            "w8a8_int8": lambda w: Int8WeightOnlyLinear(w, None, activations=True),
            "int4_wo": lambda w: Int4WeightOnlyLinear(w, None, group)}[method]
    for _, mlp in model.model.sparse_mlps():
        mlp.experts.quantize(method, make)


def quantize_int8_weight_only(model: LlamaForCausalLM, activations: bool = False) -> LlamaForCausalLM:
    """Replace every decoder projection, the experts and the LM head in place;
    with ``activations`` (W8A8) the projections and experts quantize their
    rows per call, while the LM head stays weight-only (logits keep fp32
    activations; it runs on one row per sequence, where reading its weights
    is the cost)."""
    replace_projections(model, lambda w, b: Int8WeightOnlyLinear(w, b, activations))
    quantize_experts(model, "w8a8_int8" if activations else "int8_wo")
    _int8_lm_head(model)
    return model


def install_int4(model: LlamaForCausalLM, blocks: dict[str, tuple], method: str = "int4") -> set[str]:
    """Replace the projections and the LM head given as blocks
    ((q, d, m) by checkpoint weight name, e.g. ``...self_attn.q_proj.weight``;
    q uint8 0..15 for int4, int8 for grouped int8; a 4th entry is an
    act-order input order, see ``_GroupedLinear``) with int4 linears, or
    grouped int8 ones where any part is int8; a fused projection's parts are
    stacked in its row order, and fp16 parameters widen exactly to fp32
    beside fp32 ones; experts' blocks (``...mlp.experts.E.gate_proj.weight``)
    become their layers' experts (``install_expert_blocks``, labelled
    ``method``). Returns the module weight names replaced (every part of a
    fused projection must be given)."""
    from appliance.models.layers.linear import Projections, replace_linear

    experts = {name: b for name, b in blocks.items() if ".mlp.experts." in name}
    filled = install_expert_blocks(model, experts, method) if experts else set()
    blocks = {name: b for name, b in blocks.items() if name not in experts}
    arch = model.arch
    parts = Projections(model).fused_parts(n for n in blocks if n != "lm_head.weight")

    def linear(names: list[str], target: str, bias: torch.Tensor | None) -> nn.Module:
        return block_linear([blocks[n] for n in names], target, bias)

    def make(names: list[str], target: str):
        def build(lin: nn.Linear) -> nn.Module:
            rows = sum(blocks[name][0].shape[0] for name in names)
            if rows != lin.out_features:
                raise ValueError(f"{target}: int4 blocks give {rows} of its {lin.out_features} rows")
            return linear(names, target, lin.bias.data if lin.bias is not None else None)
        return build

    for target, names in parts.items():
        replace_linear(model, target, make(names, target))
    filled |= set(parts)
    if "lm_head.weight" in blocks:
        model.lm_head_q = linear(["lm_head.weight"], "lm_head", None)
        if not arch.tie_word_embeddings:  # a tied model keeps its embedding for lookups
            del model.lm_head
            filled.add("lm_head.weight")
    return filled


def block_linear(parts: list[tuple], target: str, bias: torch.Tensor | None) -> nn.Module:
    """One linear of ``parts`` (blocks, stacked in row order): int4, or
    grouped int8 where any part is int8; fp16 parameters widen exactly to
    fp32 beside fp32 ones."""
    perm = _input_order(target, parts)
    if any(torch.as_tensor(p[0]).dtype == torch.int8 for p in parts):
        return GroupedInt8Linear(_as_grouped_int8(parts), bias, perm)
    f32 = any(torch.as_tensor(p[1]).dtype == torch.float32 for p in parts)
    q, d, m = (torch.cat([torch.as_tensor(p[i]) for p in parts]) for i in range(3))
    if f32:
        d, m = d.float(), m.float()
    return Int4WeightOnlyLinear(None, bias, blocks=(q, d, m), in_perm=perm)


def install_expert_blocks(model: LlamaForCausalLM, blocks: dict[str, tuple], method: str) -> set[str]:
    """Each sparse layer's experts from their blocks (by checkpoint name,
    ``...mlp.experts.E.gate_proj.weight``): gate|up stacked into one
    linear, down another (``block_linear``), the experts ``quantized`` as
    ``method``. Returns the module weights filled."""
    from appliance.models.layers.moe import install_checkpoint_experts

    return install_checkpoint_experts(model.model.sparse_mlps(), blocks, method,
                                      lambda names: block_linear([blocks[n] for n in names], names[0], None))


def quantize_int4_weight_only(model: LlamaForCausalLM, group: int = 32) -> LlamaForCausalLM:
    """Every decoder projection and expert to int4 groups of ``group``, the LM head to int8, in place."""
    replace_projections(model, lambda w, b: Int4WeightOnlyLinear(w, b, group))
    quantize_experts(model, "int4_wo", group)
    _int8_lm_head(model)
    return model

