"""The quantization methods (``quantization.method``), as a registry: one row
per method with what it stores (bits per weight, where its scales go), what
it may do to activations, where it runs, how the plan counts its bytes, the
rules validation applies to its keys and the notes ``appliance plan`` adds.
Validation, the plan, the dtype choice and the model loader
(``models/loader.quantize_at_load``) read the rows; how a method is read
from a checkpoint's ``quantization_config`` is ``config/checkpoint.py``'s
(``CHECKPOINT_QUANT_METHODS``), how its weights load and shard the loader's.

Torch-free, like the rest of ``config/``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from appliance.config.schema import ApplianceConfig

INT4_GROUP_SIZES = (32, 64, 128)  # the native int4 kernels' groups along k
FP8_HARDWARE = "h100, h200, b200 or mi300x"


def _projection_inputs(cfg: ApplianceConfig) -> dict[str, int]:
    m = cfg.model
    inputs = {"hidden_size": m.hidden_size, "num_heads x head_dim": m.num_heads * m.head_dim,
              "intermediate_size": m.intermediate_size}
    if m.num_experts > 0:
        inputs["moe_intermediate_size"] = m.moe_intermediate_size
    return inputs


def _int4_groups(cfg: ApplianceConfig) -> list[str]:
    """int4_wo: groups the native kernels build, tiling every projection's input."""
    q = cfg.quantization
    if q.group_size not in INT4_GROUP_SIZES:
        return [f"quantization.group_size={q.group_size} is not built for int4_wo; supported: {list(INT4_GROUP_SIZES)}"]
    bad = [f"{name}={v}" for name, v in _projection_inputs(cfg).items() if v % q.group_size]
    if bad:
        return [f"quantization.group_size={q.group_size} does not divide the model's projection inputs "
                f"({', '.join(bad)}); use a group size that does, or quantization=int8_wo"]
    return []


def _checkpoint_groups(cfg: ApplianceConfig) -> list[str]:
    """AWQ and GPTQ checkpoints: even groups that tile the inputs (-1: one group per output channel); the GPU
    int4 GEMM steps k by 32."""
    q, m = cfg.quantization, cfg.model
    if q.group_size == -1:
        return []
    bad = [v for v in (m.hidden_size, m.num_heads * m.head_dim, m.intermediate_size) if v % q.group_size]
    if q.group_size < 2 or q.group_size % 2 or bad:
        common = math.gcd(m.hidden_size, m.num_heads * m.head_dim, m.intermediate_size)
        even = [g for g in range(2, common + 1, 2) if common % g == 0]
        return [f"quantization.group_size={q.group_size} must be even and divide the model's projection "
                f"inputs ({m.hidden_size}, {m.num_heads * m.head_dim}, {m.intermediate_size}), or -1 "
                f"(one group per output channel); supported for this model: {[-1, *even]}"]
    if cfg.hardware.device_kind != "cpu" and q.group_size % 32:
        return [f"quantization.group_size={q.group_size}: the GPU int4 GEMM steps k by 32, so groups must be "
                f"multiples of 32 there (CPU profiles take any even group)"]
    return []


def _gguf_blocks(cfg: ApplianceConfig) -> list[str]:
    q, m = cfg.quantization, cfg.model
    out = []
    if m.path != "smollm2_gguf" and not m.path.endswith(".gguf"):
        out.append(f"quantization=gguf keeps the blocks of a GGUF file, and model.path={m.path} is not one; "
                   f"point model.path at a .gguf file, or use quantization=int4_wo to quantize at load")
    if q.group_size != 32:
        out.append(f"quantization.group_size={q.group_size}: GGUF blocks hold 32 weights; set "
                   f"quantization.group_size=32")
    if not 0 < q.weight_bits <= 32:
        out.append(f"quantization.weight_bits={q.weight_bits:g}: a GGUF file's loaded bits per weight are "
                   f"between 0 and 32 (read from the file when model.path is one)")
    return out


def _nothing(cfg: ApplianceConfig) -> list[str]:
    """No rules of its own, no notes."""
    return []


def _fp8_notes(cfg: ApplianceConfig) -> list[str]:
    if fp8_gemm(cfg):
        return []
    return ["fp8 weights without fp8 activations, or on hardware without fp8, run the reference path "
            "(dequantized per GEMM): correct, not fast; the decode roofline above assumes fp8 bytes"]


def _w8a8_notes(cfg: ApplianceConfig) -> list[str]:
    return ["w8a8_int8: each projection quantizes its rows to int8 per token (dynamic) and sums the "
            "products in int32, on AVX512-VNNI (vpdpbusd) where the CPU has it, else on AVX2 "
            "(vpmaddwd), with the same results; the LM head keeps fp32 activations"]


@dataclass(frozen=True)
class QuantizationMethod:
    name: str  # quantization.method
    # weight bits it stores (validation holds quantization.weight_bits to one of them, the first by default);
    # () : read from the weights themselves (a GGUF file's blocks)
    bits: tuple[float, ...]
    # where the scales go: "none" (float weights), "channel" (one fp32 scale per output channel), "group"
    # (per quantization.group_size inputs), "channel or group" (a checkpoint's choice; -1: per channel),
    # "blocks" (a GGUF file's own)
    scales: str
    group_param_bits: float = 0.0  # bits of parameters a group carries (scale, min or zero), for the plan
    # activations it can quantize (quantization.activations): "fp8", "int8", or "" (weights only)
    activation_dtype: str = ""
    activations_required: bool = False  # quantizes them always (W8A8 int8)
    # quantized from float weights at load by the CPU kernels (int8 per channel, int4 groups), the LM head in
    # int8 with an fp32 scale per row: CPU profiles only
    cpu_at_load: bool = False
    fp8_weights: bool = False  # fp8 weights: native fp8 on GPU hardware, a reference path on CPUs
    problems: Callable[[ApplianceConfig], list[str]] = _nothing  # its own keys' rules
    plan_notes: Callable[[ApplianceConfig], list[str]] = _nothing  # what ``appliance plan`` says of it
    runnable: bool = True  # its weight kernels are built (else it plans and serving refuses it)


QUANTIZATION_METHODS: dict[str, QuantizationMethod] = {q.name: q for q in (
    QuantizationMethod("none", (), "none"),
    QuantizationMethod("fp8", (8.0,), "channel", group_param_bits=16, activation_dtype="fp8", fp8_weights=True,
                       plan_notes=_fp8_notes),
    QuantizationMethod("gguf", (), "blocks", problems=_gguf_blocks),
    QuantizationMethod("awq", (4.0,), "channel or group", group_param_bits=64, problems=_checkpoint_groups),
    QuantizationMethod("gptq", (4.0, 8.0), "channel or group", group_param_bits=64, problems=_checkpoint_groups),
    QuantizationMethod("int8_wo", (8.0,), "channel", cpu_at_load=True),
    QuantizationMethod("w8a8_int8", (8.0,), "channel", activation_dtype="int8", activations_required=True,
                       cpu_at_load=True, plan_notes=_w8a8_notes),
    QuantizationMethod("int4_wo", (4.0,), "group", group_param_bits=32, cpu_at_load=True, problems=_int4_groups),
)}


def method_of(cfg: ApplianceConfig) -> QuantizationMethod:
    return QUANTIZATION_METHODS[str(cfg.quantization.method)]


def fp8_gemm(cfg: ApplianceConfig) -> bool:
    """Whether the GEMMs multiply fp8 by fp8: fp8 weights and activations on hardware with native fp8."""
    q = cfg.quantization
    return method_of(cfg).activation_dtype == "fp8" and q.activations and cfg.hardware.fp8


def quantization_problems(cfg: ApplianceConfig) -> list[str]:
    """The method's keys: bits, groups, activations, and the hardware it needs."""
    q, hw = cfg.quantization, cfg.hardware
    row = method_of(cfg)
    out = []
    if q.activations and not row.activation_dtype:
        built = " and ".join(r.name for r in QUANTIZATION_METHODS.values() if r.activation_dtype)
        out.append(f"quantization.activations=true (W8A8) is built for quantization={built}; "
                   f"quantization={q.method} quantizes weights only")
    if row.activations_required and not q.activations:
        out.append(f"quantization={q.method} quantizes the activations (quantization.activations=true); for "
                   f"int8 weights with unquantized activations use quantization=int8_wo")
    if row.fp8_weights and not hw.fp8 and hw.device_kind != "cpu":  # CPUs run fp8 through the reference path
        out.append(f"quantization={q.method} (W8A8) needs native fp8 and hardware={hw.name} has none; "
                   f"use quantization=none, or a profile on {FP8_HARDWARE}")
    if row.cpu_at_load and hw.device_kind != "cpu":
        out.append(f"quantization={q.method} is a CPU path; on hardware={hw.name} use quantization=fp8, awq or gptq")
    if row.bits:
        bits = q.weight_bits if q.weight_bits in row.bits else row.bits[0]
        if q.weight_bits != bits:
            out.append(f"quantization.weight_bits={q.weight_bits:g} does not match quantization.method={q.method}, "
                       f"which stores {bits:g}-bit weights; set quantization.weight_bits={bits:g} (the option "
                       f"quantization={q.method} sets both)")
    if row.scales == "channel" and q.group_size != -1:
        out.append(f"quantization.group_size={q.group_size}: {q.method} has one scale per output channel; "
                   f"set quantization.group_size=-1 (or use quantization=int4_wo for groups)")
    return out + row.problems(cfg)

