"""Attention backends by name, their capabilities, and the selector.

Nothing here imports a kernel package at module level: a backend's
implementation module is imported only by ``load_backend`` and its kernel
package is probed only by ``probe_importable``, so every module imports on a
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

if TYPE_CHECKING:  # kernels sit below config: the type only
    from appliance.config.schema import ApplianceConfig


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

    def supports_block_size(self, block_size: int) -> bool:
        if block_size % self.block_size_multiple:
            return False
        if self.block_size_power_of_two and block_size & (block_size - 1):
            return False
        return True

    def validate(self, cfg: ApplianceConfig, dtype: str) -> list[str]:
        """Reasons this backend cannot serve ``cfg`` (empty when it can).

        ``cfg`` is the resolved ApplianceConfig; ``dtype`` the resolved
        compute dtype. Importability is checked separately (probe_importable)
        so that ``plan`` can reason about a machine it is not running on.
        """
        reasons = []
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
        return reasons


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
        quantizations=("none", "gguf", "int8_wo", "w8a8_int8", "int4_wo", "awq", "gptq"),  # fp8: the torch reference path
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
    ),
}


def probe_importable(name: str) -> tuple[Optional[str], Optional[str]]:
    """(module that imported, None) or (None, every try's error)."""
    errors = []
    for mod in BACKENDS[name].probe_modules:
        try:
            importlib.import_module(mod)
            return mod, None
        except Exception as e:  # ImportError, or a CUDA load failure
            errors.append(f"{mod}: {type(e).__name__}: {e}".splitlines()[0])
    return None, " | ".join(errors)


@dataclass
class Selection:
    chosen: Optional[str]
    rejected: list[tuple[str, list[str]]] = field(default_factory=list)
    provider: Optional[str] = None  # the module that serves the chosen backend
    fallback_used: bool = False

    def explain(self) -> list[str]:
        lines = [f"{name}: rejected: {'; '.join(reasons)}" for name, reasons in self.rejected]
        if self.chosen:
            via = f" via {self.provider}" if self.provider else ""
            lines.append(f"{self.chosen}: chosen{via}")
        return lines


class BackendSelectionError(ConfigError):
    pass


def select_backend(cfg: ApplianceConfig, dtype: str, check_import: bool) -> Selection:
    """Walk the profile's priority list (or the forced backend).

    With ``check_import`` (serving) a backend whose package does not import
    is rejected with "package not importable: <error>"; whether the walk may
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
        reasons = BACKENDS[name].validate(cfg, dtype)
        provider = None
        if not reasons and check_import:
            provider, err = probe_importable(name)
            if provider is None:
                reasons = [f"package not importable: {err}"]
        if reasons:
            sel.rejected.append((name, reasons))
            if check_import and i == 0 and fallback == "deny" and any(
                r.startswith("package not importable") for r in reasons
            ):
                break
            continue
        sel.chosen, sel.provider, sel.fallback_used = name, provider, i > 0
        return sel
    return sel


def load_backend(name: str) -> Any:
    module, _, cls = BACKENDS[name].impl_path.partition(":")
    return getattr(importlib.import_module(module), cls)
