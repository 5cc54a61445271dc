"""Attention backends by name, their capabilities, and the selector.

Nothing here imports a kernel package at module level: a backend's
implementation module is imported only by ``load_backend`` and its kernel
package is probed only by ``probe_provider``, so every module imports on a
CPU-only machine.

The selector walks the hardware profile's priority list and records why each
backend was rejected; ``appliance plan`` prints that chain.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from appliance.errors import ConfigError
from appliance.kernels import providers

if TYPE_CHECKING:  # kernels sit below config: the type only
    from appliance.config.schema import ApplianceConfig


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _cc_tuple(cc: Optional[str]) -> Optional[tuple[int, int]]:
    if cc is None:
        return None
    try:
        major, minor = cc.split(".")
        return int(major), int(minor)
    except ValueError:
        return None  # non-CUDA capability strings such as "gfx942"


def triton_interpreter_on() -> bool:
    """Whether TRITON_INTERPRET makes Triton run its kernels in the interpreter,
    on the CPU (the values Triton itself reads as true)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes", "y")


# What a refusal calls a feature of BackendCapabilities.features (else "attention <feature>").
FEATURE_NAMES = {"sinks": "attention sinks", "chunked": "chunked local attention"}


@dataclass(frozen=True)
class BackendCapabilities:
    name: str
    impl_path: str  # "module:Class", imported lazily
    probe_modules: tuple[str, ...]  # tried in order; first importable wins
    device_kinds: tuple[str, ...]
    # Device kinds served only under the Triton interpreter (TRITON_INTERPRET=1).
    interpreter_device_kinds: tuple[str, ...] = ()
    min_capability: Optional[tuple[int, int]] = None
    max_capability: Optional[tuple[int, int]] = None
    dtypes: tuple[str, ...] = ("float16", "bfloat16")
    kv_dtypes: tuple[str, ...] = ("auto",)
    head_sizes: tuple[int, ...] = (64, 80, 96, 128, 256)
    block_size_multiple: int = 16
    block_size_power_of_two: bool = False
    # Weight formats a backend that runs the whole step itself can execute (None: any, the model's own modules).
    quantizations: Optional[tuple[str, ...]] = None
    # Walks the KV cache in tiles sized to the device's shared memory (triton_kv_tile).
    shared_memory_tiles: bool = False
    # Weight formats whose batched GEMMs it runs on int8 products (the rows quantized to int8) where the
    # hardware has int8 dot products (hardware.peak_tflops.int8 > 0); w8a8_int8 does everywhere.
    int8_gemm_quantizations: tuple[str, ...] = ()
    # Weight formats whose GEMMs take bf16 dot products (vdpbf16ps; AMX-BF16 tiles from their row count) where the
    # CPU has them: bf16 weights, and 4- and 8-bit weights as their integers in bf16.
    bf16_dot_quantizations: tuple[str, ...] = ()
    # Those with weights in groups of inputs (int4, GGUF's grouped int8), which the tiles take from more rows.
    grouped_quantizations: tuple[str, ...] = ()
    # Those whose GEMMs quantize the activations to int8 too (W8A8: tiles of int8, sums exact in int32).
    w8a8_quantizations: tuple[str, ...] = ()
    # Those whose float rows (q/k/v, the LM head) run in fp32 FMAs on AVX-512 (int8 per channel).
    fma_row_quantizations: tuple[str, ...] = ()
    # What of a model's attention it computes beyond causal softmax over a (windowed) context: "sinks" (a learned
    # logit per head in the softmax, gpt-oss's), "chunked" (chunked local attention, Llama 4's: a token attends
    # within its chunk of CommonAttentionMetadata.attention_chunk positions).
    features: tuple[str, ...] = ("sinks",)

    def supports_block_size(self, block_size: int) -> bool:
        if block_size % self.block_size_multiple:
            return False
        if self.block_size_power_of_two and block_size & (block_size - 1):
            return False
        return True

    def validate(self, cfg: ApplianceConfig, dtype: str, needs: tuple[str, ...] = ()) -> list[str]:
        """Reasons this backend cannot serve ``cfg`` (empty when it can).

        ``cfg`` is the resolved ApplianceConfig; ``dtype`` the resolved
        compute dtype; ``needs`` the attention features the model's layers
        need (``features``). Whether a package serves it here is checked separately (probe_provider)
        so that ``plan`` can reason about a machine it is not running on.
        """
        reasons = [f"no {FEATURE_NAMES.get(need, 'attention ' + need)} ({cfg.model.architecture} has them)"
                   for need in needs if need not in self.features]
        hw = cfg.hardware
        kind = hw.device_kind
        if kind in self.interpreter_device_kinds:
            if not triton_interpreter_on():
                reasons.append(f"device kind {kind} not in {list(self.device_kinds)} "
                               f"(TRITON_INTERPRET=1 runs it on CPU, in the Triton interpreter)")
        elif kind not in self.device_kinds:
            reasons.append(f"device kind {kind} not in {list(self.device_kinds)}")
        cc = _cc_tuple(hw.compute_capability)
        if kind == "cuda" and cc is not None:
            if self.min_capability and cc < self.min_capability:
                reasons.append(f"compute capability {hw.compute_capability} below {_fmt_cc(self.min_capability)}")
            if self.max_capability and cc > self.max_capability:
                reasons.append(f"compute capability {hw.compute_capability} above {_fmt_cc(self.max_capability)}")
        if dtype not in self.dtypes:
            reasons.append(f"dtype {dtype} not in {list(self.dtypes)}")
        kv = cfg.cache.kv_cache_dtype
        if kv not in self.kv_dtypes and kv != dtype:  # naming the model's own dtype is "auto"
            reasons.append(f"kv_cache_dtype {kv} not in {list(self.kv_dtypes)}")
        if self.quantizations is not None and cfg.quantization.method not in self.quantizations:
            reasons.append(f"quantization {cfg.quantization.method} not in {list(self.quantizations)}")
        if cfg.model.head_dim not in self.head_sizes:
            reasons.append(f"head_dim {cfg.model.head_dim} not in {list(self.head_sizes)}")
        if not self.supports_block_size(cfg.cache.block_size):
            rule = f"a multiple of {self.block_size_multiple}"
            if self.block_size_power_of_two:
                rule = f"a power of two and {rule}"
            reasons.append(f"block_size {cfg.cache.block_size} is not {rule}")
        tile = self.kv_tile(cfg, dtype)
        if tile == 0:
            target = hw.compute_capability
            assert target is not None  # a tile is computed only for a named target
            need = triton_attention_shared_bytes(TRITON_MIN_KV_TILE, cfg.model.head_dim, DTYPE_BYTES[dtype],
                                                 triton_block_m(cfg.model.num_heads, cfg.model.num_kv_heads), target)
            reasons.append(f"head_dim {cfg.model.head_dim} in {dtype} needs about {need} bytes of shared memory per "
                           f"thread block at the smallest KV tile; {target} has {shared_memory_limit(target)}")
        return reasons

    def kv_tile(self, cfg: ApplianceConfig, dtype: str) -> Optional[int]:
        """Keys per KV tile on the target GPU; None where no limit applies (a backend that does not
        tile, a CPU under the interpreter, a profile that names no compute capability)."""
        target = cfg.hardware.compute_capability
        if not self.shared_memory_tiles or cfg.hardware.device_kind not in self.device_kinds or not target:
            return None
        block_m = triton_block_m(cfg.model.num_heads, cfg.model.num_kv_heads)
        return triton_kv_tile(cfg.cache.block_size, cfg.model.head_dim, DTYPE_BYTES[dtype], block_m, target)

    def notes(self, cfg: ApplianceConfig, dtype: str) -> list[str]:
        """What the backend adapts to the target, for ``appliance plan``."""
        tile = self.kv_tile(cfg, dtype)
        if tile and tile < cfg.cache.block_size:
            target = cfg.hardware.compute_capability
            assert target is not None  # a tile is computed only for a named target
            return [f"reads each {cfg.cache.block_size}-token KV block in tiles of {tile} keys: a whole block "
                    f"(head_dim {cfg.model.head_dim}, {dtype}) would take more shared memory than a thread block "
                    f"has on {target} ({shared_memory_limit(target)} bytes)"]
        return []


# The most shared memory one thread block may use (the opt-in limit), by compute capability or AMD target.
SHARED_MEMORY_BYTES = {
    "8.0": 166912, "8.6": 101376, "8.7": 166912, "8.9": 101376, "9.0": 232448,
    "10.0": 232448, "10.3": 232448, "11.0": 232448, "12.0": 101376, "12.1": 101376,
    "gfx90a": 65536, "gfx942": 65536, "gfx950": 163840,
}


def shared_memory_limit(target: str) -> int:
    """The shared memory of a thread block on ``target``; an unknown one gets the smallest of the table."""
    return SHARED_MEMORY_BYTES.get(target, min(SHARED_MEMORY_BYTES.values()))


TRITON_MAX_BLOCK_M = 64  # query rows of one program of the Triton attention kernel (TritonAttentionBackend.block_q_for)
TRITON_MIN_KV_TILE = 16  # the smallest N of a tl.dot


def pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (x - 1).bit_length())


# Shared memory of the Triton attention kernel, per key of a KV tile and per query row, in units of
# head_dim_pad x dtype bytes, plus a fixed part: (16-bit, fp32) by target family. 16-bit K and V tiles are
# staged through shared memory by the software pipeline (three stages), fp32 ones are not. Fitted to, and
# held above, what Triton 3.6 and 3.9 allocate for a launch on aligned tensors (tests/triton_compile.py
# compiles every configuration for sm_90a, sm_100a and gfx942 and checks the bound; a launch on an H200
# took what the compile for sm_90a said).
TRITON_ATTENTION_SHARED = {
    "cuda": (((4.0, 1.0), (4.5, 1.7)), 8192),
    "hip": (((2.0, 0.75), (2.25, 0.5)), 4096),
}


def shared_memory_family(target: str) -> str:
    """The TRITON_ATTENTION_SHARED row of a compute capability ("9.0") or AMD target ("gfx942")."""
    return "hip" if target.startswith("gfx") else "cuda"


def triton_attention_shared_bytes(kv_tile: int, head_dim: int, dtype_bytes: int, block_m: int, target: str) -> int:
    """An upper bound of the shared memory one program of the Triton attention kernel takes on ``target``:
    the K and V tiles of ``kv_tile`` keys as the software pipeline stages them, the query rows' operands,
    and a fixed part."""
    (narrow, wide), fixed = TRITON_ATTENTION_SHARED[shared_memory_family(target)]
    per_key, per_row = wide if dtype_bytes >= 4 else narrow
    return int(pow2(head_dim) * dtype_bytes * (per_key * kv_tile + per_row * block_m)) + fixed


def triton_block_m(num_heads: int, num_kv_heads: int) -> int:
    """The most query rows one program takes: 64, or one token's whole GQA group when that is larger."""
    return max(TRITON_MAX_BLOCK_M, pow2(num_heads // num_kv_heads))


def triton_kv_tile(block_size: int, head_dim: int, dtype_bytes: int, block_m: int,
                   target: Optional[str]) -> int:
    """Keys the Triton attention kernel loads at once on ``target`` (None: the interpreter, no limit): the
    whole KV block when it fits in the target's shared memory, else the largest power of two that does (a
    block is then read in several tiles), or 0 when even the smallest tile does not fit."""
    if target is None:
        return block_size
    limit = shared_memory_limit(target)
    tile = block_size
    while tile >= TRITON_MIN_KV_TILE and \
            triton_attention_shared_bytes(tile, head_dim, dtype_bytes, block_m, target) > limit:
        tile //= 2
    return tile if tile >= TRITON_MIN_KV_TILE else 0


def _fmt_cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


BACKENDS: dict[str, BackendCapabilities] = {
    "torch_sdpa": BackendCapabilities(
        name="torch_sdpa",
        # torch SDPA (reference)
        impl_path="appliance.kernels.torch_sdpa:TorchSDPABackend",
        probe_modules=("torch",),
        device_kinds=("cpu", "cuda", "rocm"),
        dtypes=("float32", "bfloat16", "float16"),
        kv_dtypes=("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2"),
        head_sizes=tuple(range(8, 513, 8)),
        block_size_multiple=1,
        features=("sinks", "chunked"),
    ),
    "cpu_native": BackendCapabilities(
        name="cpu_native",
        # native CPU kernels (AVX2, whole-step forward, fp32 or bf16 weights)
        impl_path="appliance.kernels.cpu_native:CpuNativeBackend",
        probe_modules=("appliance.kernels.cpu_native",),
        device_kinds=("cpu",),
        dtypes=("float32", "bfloat16"),
        kv_dtypes=("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2"),
        head_sizes=tuple(range(8, 513, 8)),
        block_size_multiple=1,
        # fp8: the torch reference path; mxfp4: its experts kept at 4 bits, multiplied by the native MXFP4 GEMM
        quantizations=("none", "gguf", "int8_wo", "w8a8_int8", "int4_wo", "awq", "gptq", "mxfp4"),
        # 4- and 8-bit weights' GEMMs: int8 rows on AVX512-VNNI (cpu_native.int8_rows)
        int8_gemm_quantizations=("gguf", "int8_wo", "int4_wo", "awq", "gptq"),
        bf16_dot_quantizations=("none", "int8_wo", "gguf", "awq", "gptq", "int4_wo"),
        grouped_quantizations=("gguf", "awq", "gptq", "int4_wo"),
        w8a8_quantizations=("w8a8_int8",),
        fma_row_quantizations=("int8_wo",),
        # chunked: in the layer-by-layer forward (its whole-step forward refuses chunked groups)
        features=("sinks", "chunked"),
    ),
    "triton": BackendCapabilities(
        name="triton",
        # Triton unified paged attention
        impl_path="appliance.kernels.triton_attention:TritonAttentionBackend",
        probe_modules=("triton",),
        device_kinds=("cuda", "rocm"),
        interpreter_device_kinds=("cpu",),
        min_capability=(8, 0),
        dtypes=("float16", "bfloat16", "float32"),
        kv_dtypes=("auto", "fp8_e4m3"),
        # The kernel pads HEAD_DIM to a power of two and masks the rest; 16 is the
        # smallest K of a 16-bit tl.dot on NVIDIA, and past 256 the fp32
        # accumulator (BLOCK_M x 512) no longer fits in registers.
        head_sizes=tuple(range(16, 257, 8)),
        block_size_multiple=16,
        block_size_power_of_two=True,
        shared_memory_tiles=True,
        features=("sinks", "chunked"),
    ),
    "flashinfer": BackendCapabilities(
        name="flashinfer",
        impl_path="appliance.kernels.flashinfer_attention:FlashInferBackend",
        probe_modules=("flashinfer",),
        device_kinds=("cuda",),
        min_capability=(8, 0),
        dtypes=("float16", "bfloat16"),
        kv_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"),
        head_sizes=(64, 128, 256),
        block_size_multiple=1,
        # sinks: its wrapper's run() takes them in the flashinfer-python builds that have them (the provider
        # probe checks the installed one's); chunked: as causal attention over a virtual batch (local_attention)
        features=("sinks", "chunked"),
    ),
    "flash_attn3": BackendCapabilities(
        name="flash_attn3",
        impl_path="appliance.kernels.flash_attn_attention:FlashAttn3Backend",
        probe_modules=("flash_attn_interface", "fa3_fwd_interface", "sgl_kernel.flash_attn"),
        device_kinds=("cuda",),
        min_capability=(9, 0),
        max_capability=(9, 0),
        dtypes=("float16", "bfloat16"),
        kv_dtypes=("auto", "fp8_e4m3"),
        head_sizes=(64, 96, 128, 192, 256),
        block_size_multiple=16,
        features=("chunked",),  # chunked: over a virtual batch (local_attention); its sinks not wired yet
    ),
}


def probe_provider(name: str, dtype: str = "bfloat16", kv_cache_dtype: str = "auto", model_needs: tuple[str, ...] = ()
                   ) -> tuple[Optional[str], Optional[str]]:
    """(the first of the backend's packages that serves here, None) or (None, why each one does not):
    it must import, have its kernel and every feature a deployment of these dtypes and the model's attention
    (``model_needs``: sinks) needs (providers.probe)."""
    needs = providers.attention_needs(name, dtype, kv_cache_dtype) | frozenset(model_needs)
    module, rejected = providers.first_usable(BACKENDS[name].probe_modules, needs)
    return (module, None) if module else (None, " | ".join(rejected))


@dataclass
class Selection:
    chosen: Optional[str]
    rejected: list[tuple[str, list[str]]] = field(default_factory=list)
    provider: Optional[str] = None  # the module that serves the chosen backend
    fallback_used: bool = False
    notes: list[str] = field(default_factory=list)  # what the chosen backend adapts to the target

    def explain(self) -> list[str]:
        lines = [f"{name}: rejected: {'; '.join(reasons)}" for name, reasons in self.rejected]
        if self.chosen:
            via = f" via {self.provider}" if self.provider else ""
            lines.append(f"{self.chosen}: chosen{via}")
            lines += [f"{self.chosen}: {note}" for note in self.notes]
        return lines


class BackendSelectionError(ConfigError):
    pass


def select_backend(cfg: ApplianceConfig, dtype: str, check_import: bool, needs: tuple[str, ...] = ()) -> Selection:
    """Walk the profile's priority list (or the forced backend); ``needs``: the attention features the
    model's layers need (``BackendCapabilities.features``).

    With ``check_import`` (serving) a backend whose package does not import
    is rejected with "no usable package: <why>"; whether the walk may
    then continue past the profile's first choice depends on
    ``attention.fallback``. Without it (plan on another machine) only the
    static capabilities count and importability is reported as a note.
    """
    forced = cfg.attention.backend
    if forced != "auto":
        if forced not in BACKENDS:
            raise BackendSelectionError(
                f"attention.backend={forced} is unknown; known backends: {sorted(BACKENDS)}"
            )
        order = [forced]
    else:
        order = list(cfg.hardware.attention_backends)
    sel = Selection(chosen=None)
    fallback = cfg.attention.fallback
    for i, name in enumerate(order):
        if name not in BACKENDS:
            sel.rejected.append((name, [f"unknown backend (known: {sorted(BACKENDS)})"]))
            continue
        reasons = BACKENDS[name].validate(cfg, dtype, needs)
        provider = None
        if not reasons and check_import:
            provider, err = probe_provider(name, dtype, cfg.cache.kv_cache_dtype, needs)
            if provider is None:
                reasons = [f"no usable package: {err}"]
        if reasons:
            sel.rejected.append((name, reasons))
            if check_import and i == 0 and fallback == "deny" and any(
                r.startswith("no usable package") for r in reasons
            ):
                break
            continue
        sel.chosen, sel.provider, sel.fallback_used = name, provider, i > 0
        sel.notes = BACKENDS[name].notes(cfg, dtype) + (providers.host_notes(provider, cfg, dtype) if provider else [])
        return sel
    return sel


def load_backend(name: str) -> Any:
    module, _, cls = BACKENDS[name].impl_path.partition(":")
    return getattr(importlib.import_module(module), cls)
