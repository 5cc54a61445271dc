"""The native CPU library (``csrc/cpu_ops.c``, see ``cpu_native``) as Python
sees it: the loaded library, the structures ``appl_forward`` reads, the ISA
switches (``bf16_dot``, ``fma_rows``, ``int8_rows``, ``vnni``, ``amx``,
``avx512``, ``bf16_attention``), ``NativeLinear`` (its layout from
``cpu_native_pack``), paged attention, and the constrained-logits bitmask kernel."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch

from appliance.kernels.base import CommonAttentionMetadata
from appliance.kernels.cpu_build import build_library
from appliance.kernels.cpu_native_pack import (pack_group_params, pack_int8_quads, pack_panels, pack_q4_pairs,
                                             pack_q4_quads, pack_vnni_panels)
from appliance.kernels.registry import BACKENDS

# Load after torch so the library's libgomp.so.1 resolves to the one torch loaded.
_LIB = ctypes.CDLL(str(build_library()))

WTYPE_F32, WTYPE_I8, WTYPE_BF16, WTYPE_Q4, WTYPE_Q8G, WTYPE_I8A8, WTYPE_I8Q, WTYPE_Q8GQ, WTYPE_Q4Q = range(9)
_p = ctypes.c_void_p
_i32, _i64, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class Linear(ctypes.Structure):
    _fields_ = [("w", _p), ("scale", _p), ("bias", _p), ("qparams", _p), ("perm", _p), ("n", _i32), ("k", _i32),
                ("wtype", _i32), ("group", _i32), ("qparams_f32", _i32), ("float_rows", _i32)]


class Moe(ctypes.Structure):
    _fields_ = [("n_experts", _i32), ("top_k", _i32), ("inter", _i32), ("first", _i32), ("n_local", _i32),
                ("_pad", _i32), ("router", Linear), ("w13", ctypes.POINTER(Linear)), ("w2", ctypes.POINTER(Linear))]


class Layer(ctypes.Structure):
    _fields_ = [("ln1", _p), ("ln2", _p), ("q_norm", _p), ("k_norm", _p),
                ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
                ("k_cache", _p), ("v_cache", _p), ("k_scale", _f32), ("v_scale", _f32), ("moe", ctypes.POINTER(Moe)),
                ("group", _i32), ("_pad3", _i32)]


# logits [T, n_experts] fp32, T, n_experts, top_k -> ids int32 [T, top_k], weights fp32 [T, top_k]
RouteFn = ctypes.CFUNCTYPE(None, _p, _i64, _i32, _i32, _p, _p)


class Model(ctypes.Structure):
    _fields_ = [("n_layers", _i32), ("hidden", _i32), ("inter", _i32), ("n_heads", _i32), ("n_kv_heads", _i32),
                ("head_dim", _i32), ("vocab", _i32), ("max_pos", _i32), ("eps", _f32), ("attn_scale", _f32),
                ("kv_type", _i32), ("embed_bf16", _i32), ("embed", _p), ("final_norm", _p), ("rope_cos", _p), ("rope_sin", _p),
                ("lm_head", Linear), ("layers", ctypes.POINTER(Layer)), ("route", RouteFn),
                ("moe_experts", _i32), ("moe_top_k", _i32), ("moe_inter", _i32), ("rope_dim", _i32),
                ("reduce", _p), ("reduce_ctx", _p), ("vocab_start", _i64)]


# a tensor-parallel rank's fp32 all-reduce in place: (context, data, n) -> 0, or nonzero on failure
ReduceFn = ctypes.CFUNCTYPE(ctypes.c_int, _p, _p, _i64)


class Step(ctypes.Structure):
    _fields_ = [("n_tokens", _i32), ("n_reqs", _i32), ("n_logits", _i32), ("block_size", _i32),
                ("bt_stride", _i32), ("failed", _i32),
                ("input_ids", _p), ("positions", _p), ("slot_mapping", _p), ("logits_indices", _p),
                ("qsl", _p), ("seq_lens", _p), ("block_table", _p), ("scratch", _p), ("logits", _p),
                ("hidden_in", _p), ("hidden_out", _p), ("group_tables", _p), ("group_slots", _p),
                ("group_windows", _p)]


_LIB.appl_forward.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(Step)]
_LIB.appl_forward.restype = None
_LIB.appl_scratch_floats.argtypes = [ctypes.POINTER(Model), _i64]
_LIB.appl_scratch_floats.restype = _i64
_LIB.appl_linear.argtypes = [ctypes.POINTER(Linear), _p, _i64, _p, _i64, _i64, ctypes.c_int]
_LIB.appl_linear.restype = None
_LIB.appl_attention.argtypes = [_p, _i64, _p, _i64, _p, _p, ctypes.c_int, ctypes.c_int, _p, _p, _p,
                                ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, _f32, ctypes.c_int,
                                _f32, _f32, ctypes.c_int, ctypes.c_int, _f32, _p]  # ..., window, chunk, softcap, sinks
_LIB.appl_attention.restype = None
_LIB.appl_phase_times.argtypes = [ctypes.POINTER(ctypes.c_double), ctypes.c_int]
_LIB.appl_phase_times.restype = ctypes.c_int
_LIB.appl_bf16_dot.argtypes = [ctypes.c_int]
_LIB.appl_bf16_dot.restype = ctypes.c_int
_LIB.appl_fma_rows.argtypes = [ctypes.c_int]
_LIB.appl_fma_rows.restype = ctypes.c_int
_LIB.appl_bf16_attention.argtypes = [ctypes.c_int]
_LIB.appl_bf16_attention.restype = ctypes.c_int
_LIB.appl_decode_tiles.argtypes = [ctypes.c_int] * 4
_LIB.appl_decode_tiles.restype = ctypes.c_int
_LIB.appl_avx512.argtypes = [ctypes.c_int]
_LIB.appl_avx512.restype = ctypes.c_int
_LIB.appl_vnni.argtypes = [ctypes.c_int]
_LIB.appl_vnni.restype = ctypes.c_int
_LIB.appl_int8_rows.argtypes = [ctypes.c_int]
_LIB.appl_int8_rows.restype = ctypes.c_int
_LIB.appl_int8_quads.argtypes = []
_LIB.appl_int8_quads.restype = ctypes.c_int
_LIB.appl_amx.argtypes = [ctypes.c_int]
_LIB.appl_amx.restype = ctypes.c_int
_LIB.appl_amx_min_rows.argtypes = [ctypes.c_int, ctypes.c_int]
_LIB.appl_amx_min_rows.restype = ctypes.c_int
_LIB.appl_apply_token_bitmask.argtypes = [_p, _i64, _p, _i64, _p, ctypes.c_int, _i64]
_LIB.appl_apply_token_bitmask.restype = None

PHASES = ("norm", "qkv", "rope_kv_write", "attention", "o_proj", "gate_up", "silu_mul", "down", "lm_head",
          "moe_route_and_combine", "tp_all_reduce")


def phase_times(reset: bool = False) -> dict[str, float]:
    """Seconds the native forward spent per phase since the last reset."""
    buf = (ctypes.c_double * len(PHASES))()
    _LIB.appl_phase_times(buf, int(reset))
    return dict(zip(PHASES, buf))


def bf16_dot(enabled: Optional[bool] = None) -> bool:
    """Whether bf16-weight GEMMs (and those of int8 weight-only, int4 and
    grouped int8 weights that do not take int8 rows: their integers exact in
    bf16, a group's scale and min applied to its sums) run on AVX512-BF16 at
    every row count (vdpbf16ps, the rows rounded to bf16 on the way in; a
    row's result the same bits whatever shares its step) rather than in fp32
    FMAs; on by default where the CPU has it, unless
    ``APPLIANCE_CPU_BF16_DOT=0`` (benchmarks then see what an AVX2-only CPU
    runs). bf16 weights take ``fma_rows`` first where that is on.
    ``enabled`` switches it (off: bf16 weights give the same sums as
    fp32 weights of the bf16 values, bit for bit); on is refused, returning
    False, where the CPU lacks it."""
    return bool(_LIB.appl_bf16_dot(-1 if enabled is None else int(enabled)))


def fma_rows(enabled: Optional[bool] = None) -> bool:
    """Whether bf16-weight GEMMs (and int8 per-channel ones that keep float
    rows: ``int8_wo``'s q/k/v and LM head, or all of them with ``int8_rows``
    off) run in AVX-512 fp32 FMAs at every row count (the rows fp32 as they
    come, each weight widened exactly in registers, one chain per row and
    channel: a row's result the same bits whatever shares its step), ahead
    of ``bf16_dot``, while ``avx512`` is on; where AMX-BF16 tiles take the
    larger row counts (``amx_min_rows()``), below those. On by
    default where the CPU has AVX-512F, except where vdpbf16ps does more
    multiply-adds a cycle (AMD's AVX512-BF16 CPUs: twice the FMAs');
    Intel's AVX512-BF16 CPUs issue vdpbf16ps once every two cycles, half the
    FMAs' multiply-adds. ``APPLIANCE_CPU_FMA_ROWS=0`` or ``=1`` sets it.
    ``enabled`` switches it; on is refused, returning False, where the CPU
    lacks AVX-512F."""
    return bool(_LIB.appl_fma_rows(-1 if enabled is None else int(enabled)))


def bf16_attention(enabled: Optional[bool] = None) -> bool:
    """Whether prefill attention tiles over a bf16 or fp8 KV cache (and,
    where ``decode_tiles`` says so, decode attention over a bf16 one) run on
    bf16 products (Q K^T and P V; the queries and the softmax weights
    rounded to bf16, sums and the normaliser fp32: the output moves by at
    most 2^-9 of the largest |v| from attention over the rounded queries)
    rather than in fp32: on AMX tiles (tdpbf16ps) where ``amx`` is on and
    the head size is a multiple of 32, else on AVX512-BF16 (vdpbf16ps). On
    by default on CPUs with AMX-BF16 (2.5x the fp32 tiles) and on AMD CPUs
    with AVX512-BF16 (Zen 4 on: vdpbf16ps there does twice the multiply-adds
    a cycle of fp32 FMAs), off on Intel's without AMX (one port for
    vdpbf16ps, two for FMAs: no faster there);
    ``APPLIANCE_CPU_BF16_ATTENTION=0`` or ``=1`` sets it. ``enabled``
    switches it; on is refused, returning False, where the CPU lacks it."""
    return bool(_LIB.appl_bf16_attention(-1 if enabled is None else int(enabled)))


def avx512(enabled: Optional[bool] = None) -> bool:
    """Whether int4-weight GEMMs over one to six rows run on AVX-512F (16
    channels a register, every widened panel feeding up to four rows)
    rather than on AVX2 (the GEMV at one row, one panel by up to four rows
    beyond), and prefill attention tiles on AVX-512F (16 keys a register);
    on by default where the CPU has AVX512F/BW, unless
    ``APPLIANCE_CPU_AVX512=0``. Both sum in fp32; only the order differs.
    ``enabled`` switches it; on is refused, returning False, where the CPU
    lacks it."""
    return bool(_LIB.appl_avx512(-1 if enabled is None else int(enabled)))


def vnni(enabled: Optional[bool] = None) -> bool:
    """Whether W8A8 int8 GEMMs (``quantization=w8a8_int8``) sum on
    AVX512-VNNI (vpdpbusd: 16 channels by four inputs an instruction) rather
    than on AVX2 (vpmaddwd); on by default where the CPU has it, unless
    ``APPLIANCE_CPU_VNNI=0``. Both sum the same int8 products exactly in
    int32: the results are equal bit for bit. ``enabled`` switches it; on is
    refused, returning False, where the CPU lacks it."""
    return bool(_LIB.appl_vnni(-1 if enabled is None else int(enabled)))


def int8_rows(enabled: Optional[bool] = None) -> bool:
    """Whether GEMMs with 4- or 8-bit weights (GGUF, ``int4_wo``,
    ``int8_wo``, AWQ, GPTQ), decode's too, run on integer dot products: each
    row quantized to int8 per group of the weights' inputs (32 against int8
    per channel; one scale a group, as llama.cpp quantizes its
    activations), each group's products summed exactly in int32 on
    AVX512-VNNI (vpdpbusd, twice the multiply-adds of vdpbf16ps) and its
    scale and min applied once (the mins against the rows' exact group
    sums); a row's results do not depend on the rows beside it. The native
    forward keeps float rows for the LM head and the attention's q/k/v
    projection. On by default where the CPU has
    AVX512-VNNI, unless ``APPLIANCE_CPU_INT8_ROWS=0`` (or ``vnni`` is off:
    it needs vpdpbusd); off, these GEMMs take vdpbf16ps (``bf16_dot``) or
    fp32. Where AMX-BF16 tiles take the rows (``amx_min_rows``) they
    stay there. ``enabled`` switches it; on is refused, returning False,
    where the CPU lacks VNNI."""
    return bool(_LIB.appl_int8_rows(-1 if enabled is None else int(enabled)))


def int8_quads() -> bool:
    """Whether 4- and 8-bit weights (int8 per channel: ``int8_wo``; grouped
    int8: GGUF's Q8_0; int4) packed now are stored for the int8 rows: each
    panel's channels as k quads (int8 plus 128; int4 two quads a byte), the
    unsigned operand of vpdpbusd, so no GEMM re-lays a panel per call
    (1.2-1.5x at 8 rows on a 1B model's MLP, where the re-lay cost about as
    much as reading the weights). So while ``int8_rows`` runs and AMX-BF16
    tiles do not take the larger GEMMs (they read the plain panels). Layers
    that keep float rows (q/k/v, the LM head) are packed plainly whatever
    this says; weights packed as quads still run every other path, re-laid
    whole for each call (the switches turned off after packing:
    comparisons, not deployments)."""
    return bool(_LIB.appl_int8_quads())


def decode_tiles(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> bool:
    """Whether decode attention (decodes and chunks of under eight tokens) of these shapes over a KV cache of
    ``kv_dtype`` runs on AMX-BF16 tiles, as the switches stand: a bf16 cache, ``bf16_attention`` and ``amx``
    on, AVX-512F, a head size that is a multiple of 32 and 4 to 16 query heads a kv head (fewer run as fast in
    the AVX-512 items). q and the softmax weights are rounded to bf16 there, within ``bf16_attention``'s bound."""
    return bool(_LIB.appl_decode_tiles(num_heads, num_kv_heads, head_dim, KV_TYPES[kv_dtype]))


def amx(enabled: Optional[bool] = None) -> bool:
    """Whether GEMMs of ``amx_min_rows()`` rows or more run on AMX tiles where
    the CPU has them (Sapphire Rapids and later): bf16, int8 and int4 weights
    on AMX-BF16 (tdpbf16ps; only while ``bf16_dot`` is on, whose rounding of
    the rows it shares), W8A8 int8 on AMX-INT8 (tdpbssd, the same bits as
    every W8A8 path); on by default where the CPU and the OS grant them, unless
    ``APPLIANCE_CPU_AMX=0``. ``enabled`` switches them; on is refused,
    returning False, where the CPU lacks AMX."""
    return bool(_LIB.appl_amx(-1 if enabled is None else int(enabled)))


def amx_min_rows(int8: bool = False, grouped: bool = False) -> int:
    """The row count from which AMX tiles take a GEMM (where ``amx`` is on): W8A8 on AMX-INT8 (``int8``), or
    AMX-BF16 over grouped panels (int4, grouped int8: widened and rounded per call, so from more rows) or
    bf16 and int8 per-channel ones."""
    return int(_LIB.appl_amx_min_rows(int(int8), int(grouped)))


def host_notes(cfg: Any, dtype: str) -> list[str]:
    """What the native kernels run on this CPU for a deployment of compute ``dtype``, as the run-time
    switches stand (CPUID, then the APPLIANCE_CPU_* variables): for ``appliance plan``."""
    q, caps = cfg.quantization.method, BACKENDS["cpu_native"]
    kv = dtype if cfg.cache.kv_cache_dtype == "auto" else cfg.cache.kv_cache_dtype
    tiles = (f", and from {amx_min_rows(grouped=q in caps.grouped_quantizations)} rows on AMX tiles (tdpbf16ps, "
             "the rows rounded to bf16)" if amx() and bf16_dot() else "")
    if q in caps.w8a8_quantizations:
        gemm = (f"W8A8 GEMMs on AMX-INT8 tiles (tdpbssd) from {amx_min_rows(int8=True)} rows, " if amx()
                else "W8A8 GEMMs ") + \
               ("on AVX512-VNNI (vpdpbusd)" if vnni() else "on AVX2 (vpmaddwd)") + ", exact in int32"
    elif q in caps.int8_gemm_quantizations and int8_rows():
        gemm = ("GEMMs on integer dot products (AVX512-VNNI vpdpbusd; the rows quantized "
                "to int8 per group of inputs, the sums exact in int32; q/k/v and the LM head keep float rows"
                + (", in AVX-512 fp32 FMAs" if q in caps.fma_row_quantizations and fma_rows() and avx512()
                   else ", on vdpbf16ps" if bf16_dot() else "") + ")" + tiles)
    elif dtype == "bfloat16" and q == "none" and fma_rows() and avx512():
        gemm = "GEMMs in AVX-512 fp32 FMAs, the bf16 weights widened in registers, the rows fp32" + tiles
    elif (dtype == "bfloat16" or q != "none") and q in caps.bf16_dot_quantizations and bf16_dot():
        gemm = "GEMMs on vdpbf16ps, the rows rounded to bf16" + tiles
    else:
        gemm = "GEMMs in fp32 FMAs" + (" over weights widened to fp32" if dtype != "float32" or q != "none" else "")
    m = cfg.model
    head_dim = m.head_dim or (m.hidden_size // m.num_heads if m.hidden_size and m.num_heads else 0)
    if kv != "float32" and bf16_attention() and amx() and head_dim and head_dim % 32 == 0:
        att = "prefill attention tiles on AMX tiles (tdpbf16ps; q and the softmax weights rounded to bf16)"
    elif kv != "float32" and bf16_attention():
        att = "prefill attention tiles on vdpbf16ps (q and the softmax weights rounded to bf16)"
    else:
        att = f"prefill attention tiles in fp32 FMAs ({'AVX-512F' if avx512() else 'AVX2'})"
    wide = avx512() and head_dim and head_dim % 32 == 0  # the 16-lane decode items (appl_attention)
    kv_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(kv)
    if kv_dtype and m.num_heads and decode_tiles(m.num_heads, m.num_kv_heads or m.num_heads, head_dim, kv_dtype):
        dec = "decode attention on AMX tiles (tdpbf16ps; q and the softmax weights rounded to bf16)"
    else:
        dec = f"decode attention in fp32 FMAs ({'AVX-512F' if wide else 'AVX2'})"
    dec += ", a context split every 256 positions"
    return [f"on this CPU: {gemm}; {att}; {dec}"]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[tuple[int, int]],
                        vocab_size: int) -> None:
    """Structured outputs' mask, in place: for each (logits row, bitmask
    row) in ``rows``, the first ``vocab_size`` logits of that row whose bit
    is clear in the packed int32 ``bitmask`` row (xgrammar's layout: bit b of
    word w is token 32 w + b) become -inf; the same result as xgrammar's
    ``apply_token_bitmask_inplace``, in one pass over each row."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"the native bitmask needs 2-d fp32 CPU logits with unit stride; got {logits.dtype} "
                         f"{tuple(logits.shape)} on {logits.device}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or not bitmask.is_contiguous():
        raise ValueError("the bitmask must be a contiguous 2-d int32 tensor")
    if vocab_size > min(logits.shape[1], 32 * bitmask.shape[1]):
        raise ValueError(f"vocab_size {vocab_size} exceeds the logits ({logits.shape[1]}) or the bitmask "
                         f"({32 * bitmask.shape[1]})")
    for dst, src in rows:
        if not (0 <= dst < logits.shape[0] and 0 <= src < bitmask.shape[0]):
            raise IndexError(f"row pair {(dst, src)} is outside the logits ({logits.shape[0]}) or the bitmask "
                             f"({bitmask.shape[0]})")
    if not rows:
        return
    pairs = torch.tensor(rows, dtype=torch.int32)
    _LIB.appl_apply_token_bitmask(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.shape[1],
                                  pairs.data_ptr(), len(rows), vocab_size)


if os.environ.get("APPLIANCE_CPU_BF16_DOT") == "0":
    bf16_dot(False)
if os.environ.get("APPLIANCE_CPU_FMA_ROWS") in ("0", "1"):
    fma_rows(os.environ["APPLIANCE_CPU_FMA_ROWS"] == "1")
if os.environ.get("APPLIANCE_CPU_BF16_ATTENTION") in ("0", "1"):
    bf16_attention(os.environ["APPLIANCE_CPU_BF16_ATTENTION"] == "1")
if os.environ.get("APPLIANCE_CPU_AVX512") == "0":
    avx512(False)
if os.environ.get("APPLIANCE_CPU_VNNI") == "0":
    vnni(False)
if os.environ.get("APPLIANCE_CPU_INT8_ROWS") == "0":
    int8_rows(False)
if os.environ.get("APPLIANCE_CPU_AMX") == "0":
    amx(False)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _f32_contig(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"cpu_native needs fp32 CPU tensors; {what} is {t.dtype} on {t.device}")
    return t.contiguous()


def _small_f32(t: torch.Tensor, what: str) -> torch.Tensor:
    """A norm weight or bias as fp32: a bf16 model's are widened once here (a
    few KiB per layer), so the kernels read every small vector as fp32."""
    return _f32_contig(t.float() if t.dtype == torch.bfloat16 else t, what)


WEIGHT_DTYPES = {torch.float32: WTYPE_F32, torch.bfloat16: WTYPE_BF16}  # unquantized weights, packed as they are


def _as_quads(module: Any, float_rows: bool) -> bool:
    """Whether a module's 4- or 8-bit weights are packed as the int8 rows' k quads (``int8_quads``)."""
    return not float_rows and module.in_features % 4 == 0 and int8_quads()


class NativeLinear:
    """A ctypes view of an fp32 or bf16 nn.Linear, an int8 or int4
    weight-only linear, or a W8A8 int8 one (``act_int8``: the rows quantized
    per call), its weight packed in panels (in its own dtype). Keeps
    references to the tensors it points at.

    With ``release`` the packed weight is stored on the module
    (``weight_packed``, and ``qparams_packed`` for int4) and the row-major
    original is freed, so the weights are held once; the module is then
    usable only through this view.

    ``float_rows``: the rows stay floating point where int8 rows would run
    (q/k/v, the LM head); 4- and 8-bit weights are then packed plainly
    rather than as quads (``int8_quads``)."""

    def __init__(self, module: Any, release: bool = False, float_rows: bool = False):
        packed = getattr(module, "weight_packed", None)
        packed_before = packed is not None
        qparams, group = None, 0
        if hasattr(module, "weight_q4") or hasattr(module, "weight_q8"):
            q4 = hasattr(module, "weight_q4")
            quads = packed.dim() == 4 if packed is not None else (  # as packed before
                _as_quads(module, float_rows) and module.group % 4 == 0 and module.in_features % (8 if q4 else 4) == 0)
            if packed is None:
                qparams = pack_group_params(module.q_scale, module.q_min)
                if q4:
                    packed = pack_q4_quads(module.weight_q4) if quads else pack_q4_pairs(module.weight_q4)
                else:
                    packed = pack_int8_quads(module.weight_q8) if quads else pack_panels(module.weight_q8)
            else:
                qparams = module.qparams_packed
            wtype = (WTYPE_Q4Q if quads else WTYPE_Q4) if q4 else (WTYPE_Q8GQ if quads else WTYPE_Q8G)
            scale, group = None, module.group
        elif hasattr(module, "weight_int8"):
            if getattr(module, "act_int8", False):
                wtype = WTYPE_I8A8
            elif packed is not None:
                wtype = WTYPE_I8Q if packed.dim() == 4 else WTYPE_I8  # as packed before
            else:
                wtype = WTYPE_I8Q if _as_quads(module, float_rows) else WTYPE_I8
            if packed is None:
                if wtype == WTYPE_I8A8:
                    packed, qparams = pack_vnni_panels(module.weight_int8)
                elif wtype == WTYPE_I8Q:
                    packed = pack_int8_quads(module.weight_int8)
                else:
                    packed = pack_panels(module.weight_int8)
            elif wtype == WTYPE_I8A8:
                qparams = module.qparams_packed
            scale = _f32_contig(module.scale, "an int8 scale")
        else:
            w = packed if packed is not None else module.weight.data
            if w.dtype not in WEIGHT_DTYPES or w.device.type != "cpu":
                raise ValueError(f"cpu_native needs fp32 or bf16 CPU weights; a linear weight is {w.dtype} on {w.device}")
            if packed is None:
                packed = pack_panels(w)
            scale, wtype = None, WEIGHT_DTYPES[w.dtype]
        n, k = module.out_features, module.in_features
        if release and not packed_before:
            module.weight_packed = packed
            if wtype in (WTYPE_Q4, WTYPE_Q4Q, WTYPE_Q8G, WTYPE_Q8GQ):
                module.qparams_packed = qparams
                if wtype in (WTYPE_Q4, WTYPE_Q4Q):
                    module.weight_q4 = torch.empty(0, dtype=torch.uint8)
                else:
                    module.weight_q8 = torch.empty(0, dtype=torch.int8)
                module.q_scale = module.q_min = torch.empty(0, dtype=cast(torch.Tensor, qparams).dtype)
            elif wtype in (WTYPE_I8, WTYPE_I8Q, WTYPE_I8A8):
                module.weight_int8 = torch.empty(0, dtype=torch.int8)
                if wtype == WTYPE_I8A8:
                    module.qparams_packed = qparams
            else:
                module.weight.data = torch.empty(0, dtype=packed.dtype)
        bias = getattr(module, "bias", None)
        bias = None if bias is None else _small_f32(bias.data, "a linear bias")
        perm = getattr(module, "in_perm", None)
        perm = None if perm is None else perm.to(torch.int32).contiguous()
        self._keep = (packed, scale, bias, qparams, perm)
        self.struct = Linear(_ptr(packed), _ptr(scale), _ptr(bias), _ptr(qparams), _ptr(perm), n, k, wtype, group,
                             int(qparams is not None and qparams.dtype == torch.float32), int(float_rows))

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> "NativeLinear":
        """A view of a bare weight (the tied LM head): packs a copy."""
        from types import SimpleNamespace

        return cls(SimpleNamespace(weight=weight, bias=None, out_features=weight.shape[0], in_features=weight.shape[1]))

    def __call__(self, x: torch.Tensor, out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
        x = _f32_contig(x, "the activation")
        m = x.shape[0]
        if out is None:
            out = torch.empty(m, self.struct.n, dtype=torch.float32)
        _LIB.appl_linear(ctypes.byref(self.struct), x.data_ptr(), x.shape[1], out.data_ptr(), out.shape[1], m,
                         int(accumulate))
        return out


@dataclass
class NativeMetadata:
    common: CommonAttentionMetadata
    qsl: torch.Tensor  # int32, contiguous
    seq_lens: torch.Tensor  # int32
    block_table: torch.Tensor  # int32 [num_reqs, stride]


def paged_attention(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, md: NativeMetadata,
                    num_heads: int, num_kv_heads: int, head_dim: int, scale: float, k_scale: float = 1.0,
                    v_scale: float = 1.0, soft_cap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None) -> None:
    """q [T, H*D] (row stride may exceed H*D), out [T, H*D]: attention over the paged
    cache (fp32, bf16 or fp8; an fp8 one holds k / k_scale and v / v_scale) in place,
    within the metadata's sliding window or each token's chunk where it has one, the scores soft-capped
    (``soft_cap * tanh(score / soft_cap)``) where ``soft_cap`` is set, each head's attention sink (``sinks``
    [H], a learned logit) in the softmax's denominator where given."""
    c = md.common
    held = None if sinks is None else _f32_contig(sinks.float(), "the attention sinks")  # alive through the call
    _LIB.appl_attention(q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), kv_cache[0].data_ptr(),
                        kv_cache[1].data_ptr(), c.num_actual_tokens, c.num_reqs, md.qsl.data_ptr(),
                        md.seq_lens.data_ptr(), md.block_table.data_ptr(), md.block_table.stride(0), c.block_size,
                        num_heads, num_kv_heads, head_dim, scale, KV_TYPES[kv_cache.dtype], k_scale, v_scale,
                        c.sliding_window or 0, c.attention_chunk or 0, soft_cap or 0.0,
                        None if held is None else held.data_ptr())


KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}  # KV_* in cpu_ops.c
KV_DTYPES = tuple(KV_TYPES)
