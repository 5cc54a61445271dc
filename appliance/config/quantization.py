"""The quantization methods (``quantization.method``), as a registry: one row
per method with what it stores (bits per weight, where its scales go), what
it may do to activations, where it runs, how the plan counts its bytes, the
rules validation applies to its keys and the notes ``appliance plan`` adds.
A row also says how the method is read from a checkpoint's
``quantization_config`` (``checkpoint_readers``: per ``quant_method`` value
it reads, the ``quantization`` keys that config states and what of it
cannot run; ``checkpoint_method`` finds the row), which
``config/checkpoint.py`` applies.
Validation, the plan, the dtype choice and the model loader
(``models/loader.quantize_at_load``) read the rows; how its weights load
and shard is the loader's.

Torch-free, like the rest of ``config/``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable, Optional

from appliance.config.architectures import ARCHITECTURES
from appliance.config.facts import Fact
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


# -- reading a checkpoint's quantization_config: (facts, problems) ---------------------------------------------------
CheckpointFacts = tuple[list[Fact], list[str]]


def _fp8_checkpoint(qc: dict) -> CheckpointFacts:
    """``quant_method: fp8`` (per-tensor or per-channel scales, or blocks with dynamic activations)."""
    scheme = qc.get("activation_scheme")
    facts = [Fact("weight_bits", 8.0, "quantization_config.quant_method=fp8"),
             Fact("group_size", -1, "quantization_config.quant_method=fp8 (per-tensor or per-channel scales)"),
             Fact("activations", scheme is not None, f"quantization_config.activation_scheme={scheme}")]
    problems = []
    if scheme not in (None, "dynamic", "static"):
        problems.append(f"fp8 activation_scheme={scheme} is not supported (dynamic or static)")
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            problems.append(f"fp8 weight_block_size={block} must be two positive integers [rows, inputs]")
        elif scheme == "static":
            problems.append("fp8 weight_block_size with activation_scheme=static is not supported (block-wise "
                            "fp8 checkpoints quantize activations per token group, dynamic)")
    return facts, problems


def _compressed_tensors_schemes(qc: dict) -> tuple[bool, list[str]]:
    """A compressed-tensors quantization_config (llm-compressor) whose every
    scheme is 8-bit float weights: (whether activations are quantized too,
    problems). Other schemes (int4 pack-quantized, 2:4 sparse, ...) are
    problems."""
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        return False, ["compressed-tensors quantization_config has no config_groups"]
    activations, problems = False, []
    for g in groups:
        w, a = g.get("weights") or {}, g.get("input_activations")
        if (w.get("type"), w.get("num_bits")) != ("float", 8) or w.get("strategy") not in ("tensor", "channel"):
            problems.append(f"compressed-tensors weights {json.dumps(w, sort_keys=True)} are not built "
                            f"(fp8 weights with a per-tensor or per-channel scale only)")
        if a:
            if (a.get("type"), a.get("num_bits")) != ("float", 8) or a.get("strategy") not in ("tensor", "token"):
                problems.append(f"compressed-tensors input activations {json.dumps(a, sort_keys=True)} are not "
                                f"built (fp8, per tensor or per token)")
            activations = True
    if qc.get("format") not in (None, "float-quantized", "naive-quantized"):
        problems.append(f"compressed-tensors format {qc.get('format')} is not supported (float-quantized)")
    return activations, problems


def _compressed_tensors_checkpoint(qc: dict) -> CheckpointFacts:
    """llm-compressor's fp8 checkpoints: fp8 weights per tensor or channel,
    fp8 or no input activations, at most one fp8 KV scale per layer."""
    activations, problems = _compressed_tensors_schemes(qc)
    kv = qc.get("kv_cache_scheme")
    if kv and (kv.get("type", "float"), kv.get("num_bits", 8), kv.get("strategy", "tensor")) != ("float", 8, "tensor"):
        problems.append(f"compressed-tensors kv_cache_scheme type={kv.get('type')} num_bits={kv.get('num_bits')} "
                        f"strategy={kv.get('strategy')} is not supported (fp8 with one k_scale and v_scale per "
                        f"layer: type=float, num_bits=8, strategy=tensor)")
    return [Fact("weight_bits", 8.0, "compressed-tensors fp8 weights"),
            Fact("group_size", -1, "compressed-tensors fp8 (per-tensor or per-channel scales)"),
            Fact("activations", activations, f"compressed-tensors input activations "
                                             f"{'quantized' if activations else 'unquantized'}")], problems


def _int_groups_checkpoint(method: str, bits_built: tuple[int, ...]) -> Callable[[dict], CheckpointFacts]:
    """AWQ's and GPTQ's integer weights: bits and group size (AutoAWQ's
    w_bit and q_group_size too), each method's own layout rules."""

    def read(qc: dict) -> CheckpointFacts:
        bits = qc.get("bits", qc.get("w_bit"))
        group = qc.get("group_size", qc.get("q_group_size", -1))
        if not isinstance(bits, int) or not isinstance(group, int):  # the method stands; its width cannot be read
            return [], [f"quantization_config of {method} needs integer bits and group_size; it has "
                        f"bits={bits}, group_size={group}"]
        facts = [Fact("weight_bits", float(bits), f"quantization_config bits={bits}"),
                 Fact("group_size", group, f"quantization_config group_size={group}")]
        problems = []
        if bits not in bits_built:
            problems.append(f"{method} with {bits}-bit weights is not supported; supported: "
                            f"{', '.join(map(str, bits_built))}-bit")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            problems.append(f"AWQ version {qc.get('version')} is not supported (the GEMM layout only)")
        if method == "awq" and not qc.get("zero_point", True):
            problems.append("AWQ without zero points is not supported")
        if method == "gptq" and qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v1"):
            problems.append(f"GPTQ checkpoint_format={qc.get('checkpoint_format')} is not supported (gptq only)")
        return facts, problems

    return read


def _mxfp4_checkpoint(qc: dict) -> CheckpointFacts:
    """gpt-oss's MXFP4 experts (e2m1 values, an e8m0 scale per 32): nothing more to read."""
    return [], []


def _mxfp4_experts(cfg: ApplianceConfig) -> list[str]:
    row = ARCHITECTURES.get(cfg.model.architecture)
    if row is None or not row.gpt_oss:
        return [f"quantization=mxfp4 reads gpt-oss's MXFP4 experts; model.architecture={cfg.model.architecture} "
                f"has none"]
    if cfg.model.path in ("tiny_random", "smollm2_gguf") or cfg.model.path.endswith(".gguf"):
        return [f"quantization=mxfp4 reads a checkpoint folder's MXFP4 experts; model.path={cfg.model.path} is "
                f"not one"]
    return []


def mxfp4_dequantized_share(cfg: ApplianceConfig) -> float:
    """The share of gpt-oss's MXFP4 expert weights a deployment dequantizes at load: down_proj's (a third) where
    a tensor-parallel rank's share of its inputs is not whole groups of 32, else none."""
    per_rank = cfg.model.moe_intermediate_size // cfg.parallel.tensor_parallel_size
    return 1 / 3 if per_rank % 32 else 0.0


def _mxfp4_notes(cfg: ApplianceConfig) -> list[str]:
    tp = cfg.parallel.tensor_parallel_size
    down = (f"; down_proj dequantized to the model dtype at load: a rank's {cfg.model.moe_intermediate_size // tp} "
            f"of its inputs at tp={tp} are not whole groups of 32" if mxfp4_dequantized_share(cfg) else "")
    return ["mxfp4: the checkpoint's MXFP4 experts kept at 4 bits (4.25 a weight with their e8m0 scales), "
            "multiplied by the native MXFP4 GEMM on CPUs with AVX2/FMA (else dequantized per call) and by the "
            "Triton one on GPUs" + down]


_INT_GROUPS_ONLY = ("loads an {name} checkpoint, and model.path={{path}} has no quantization_config; use "
                    "quantization=int4_wo to quantize at load on a CPU")


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
    # the quantization_config.quant_method values it reads from a checkpoint, each with its reader: the
    # quantization keys the config states besides the method (dotted below ``quantization``), and what of the
    # config cannot run
    checkpoint_readers: tuple[tuple[str, Callable[[dict], CheckpointFacts]], ...] = ()
    # a method that only reads checkpoints: what it loads and what to use instead, said when it is named for a
    # folder with no quantization_config (``{path}``: model.path)
    without_checkpoint: str = ""
    # bits an expert weight keeps, its scales counted (mxfp4: 4-bit codes and an 8-bit scale per 32); 0: the
    # experts are stored as the other weights are
    expert_bits: float = 0.0

    @property
    def kept_blocks(self) -> bool:
        """It serves a GGUF file's block tensors as they are stored (the rest of the file read as float)."""
        return self.scales == "blocks"


QUANTIZATION_METHODS: dict[str, QuantizationMethod] = {q.name: q for q in (
    QuantizationMethod("none", (), "none"),
    QuantizationMethod("fp8", (8.0,), "channel", group_param_bits=16, activation_dtype="fp8", fp8_weights=True,
                       plan_notes=_fp8_notes,
                       # llm-compressor's fp8 checkpoints too: the same weights, their own quantization_config
                       checkpoint_readers=(("fp8", _fp8_checkpoint),
                                           ("compressed-tensors", _compressed_tensors_checkpoint))),
    QuantizationMethod("gguf", (), "blocks", problems=_gguf_blocks),
    QuantizationMethod("awq", (4.0,), "channel or group", group_param_bits=64, problems=_checkpoint_groups,
                       checkpoint_readers=(("awq", _int_groups_checkpoint("awq", (4,))),),
                       without_checkpoint=_INT_GROUPS_ONLY.format(name="AWQ")),
    QuantizationMethod("gptq", (4.0, 8.0), "channel or group", group_param_bits=64, problems=_checkpoint_groups,
                       checkpoint_readers=(("gptq", _int_groups_checkpoint("gptq", (4, 8))),),
                       without_checkpoint=_INT_GROUPS_ONLY.format(name="GPTQ")),
    QuantizationMethod("int8_wo", (8.0,), "channel", cpu_at_load=True),
    QuantizationMethod("w8a8_int8", (8.0,), "channel", activation_dtype="int8", activations_required=True,
                       cpu_at_load=True, plan_notes=_w8a8_notes),
    QuantizationMethod("int4_wo", (4.0,), "group", group_param_bits=32, cpu_at_load=True, problems=_int4_groups),
    # gpt-oss's checkpoints: MXFP4 experts kept at 4 bits, the other weights float
    QuantizationMethod("mxfp4", (), "none", problems=_mxfp4_experts, plan_notes=_mxfp4_notes, expert_bits=4.25,
                       checkpoint_readers=(("mxfp4", _mxfp4_checkpoint),),
                       without_checkpoint="loads gpt-oss's MXFP4 experts, and model.path={path} has no "
                                          "quantization_config; drop the override"),
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


# quantization_config.quant_method (lower case) -> (the method's row, its reader)
_CHECKPOINT_READERS = {name: (row, read) for row in QUANTIZATION_METHODS.values()
                       for name, read in row.checkpoint_readers}


def checkpoint_method(quant_method: str) -> Optional[QuantizationMethod]:
    """The method that reads a checkpoint whose quantization_config names ``quant_method`` (None: none does)."""
    found = _CHECKPOINT_READERS.get(quant_method.lower())
    return found[0] if found is not None else None


def checkpoint_quantization(qc: dict) -> CheckpointFacts:
    """The ``quantization`` keys a checkpoint's ``quantization_config`` states
    (the method first), and what of it cannot run."""
    name = str(qc.get("quant_method", "")).lower()
    found = _CHECKPOINT_READERS.get(name)
    if found is None:
        return [], [f"quantization_config.quant_method={name or '(none)'} is not supported; supported: "
                    f"{', '.join(_CHECKPOINT_READERS)}"]
    row, read = found
    facts, problems = read(qc)
    source = f"quantization_config.quant_method={name}" + (f" ({row.name} weights)" if name != row.name else "")
    return [Fact("method", row.name, source), *facts], problems
