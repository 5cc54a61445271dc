"""The packages that provide GPU kernels, and whether one really serves here.

A package that imports can still be unusable: PyPI's ``flash_attn_interface``
0.0.1 is an empty placeholder; ``fa3-fwd`` 0.0.3 is built without paged KV
and fp16 (its library then holds flash-attention's "This flash attention
build does not support ..." messages); a kernel package built for another
torch fails to load; FlashInfer compiles its kernels at first use and needs
nvcc for that unless a package of precompiled kernels is installed. ``probe``
checks each of these, in that order, and says which failed and why; the
attention registry, ``appliance plan`` and the layers that prefer a kernel
(Marlin, FlashInfer's MoE) all ask it, so an unusable provider is never
selected and none is skipped without a reason.

Like the registry, nothing here imports a kernel package at module level.
"""

from __future__ import annotations

import functools
import glob
import importlib
import importlib.util
import inspect
import mmap
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Optional

# feature -> the message a flash-attention (hopper/) build holds when it was compiled without it
FA3_MISSING = {
    "paged_kv": b"does not support paged KV",
    "float16": b"does not support FP16",
    "fp8": b"does not support FP8",
}
FLASHINFER_PRECOMPILED = ("flashinfer_jit_cache", "flashinfer_cubin")


@dataclass(frozen=True)
class Provider:
    module: str  # what is imported
    package: str  # what pip installs (for the messages)
    kernel: str  # the attribute that must exist on the module: the kernel entry point
    missing_features: Optional[dict[str, bytes]] = None  # features a build can lack, found in its libraries
    jit: bool = False  # compiles kernels at first use: needs nvcc, or one of ``precompiled``
    precompiled: tuple[str, ...] = ()
    # features a version takes as a keyword of the kernel's method: feature -> the method (the keyword is the
    # feature's name), absent from the versions before the feature
    keyword_features: Optional[dict[str, str]] = None


PROVIDERS: dict[str, Provider] = {p.module: p for p in (
    Provider("torch", "torch", "nn.functional.scaled_dot_product_attention"),
    Provider("triton", "triton", "jit"),
    Provider("appliance.kernels.cpu_native", "appliance", "CpuNativeBackend"),
    Provider("flashinfer", "flashinfer-python", "BatchPrefillWithPagedKVCacheWrapper", jit=True,
             precompiled=FLASHINFER_PRECOMPILED, keyword_features={"sinks": "run"}),
    Provider("flashinfer.fused_moe", "flashinfer-python", "cutlass_fused_moe", jit=True,
             precompiled=FLASHINFER_PRECOMPILED),
    Provider("flash_attn_interface", "flash-attention's hopper/ build (FA3)", "flash_attn_with_kvcache",
             missing_features=FA3_MISSING),
    Provider("fa3_fwd_interface", "fa3-fwd", "flash_attn_with_kvcache", missing_features=FA3_MISSING),
    Provider("sgl_kernel.flash_attn", "sgl-kernel", "flash_attn_with_kvcache", missing_features=FA3_MISSING),
    Provider("sgl_kernel", "sgl-kernel", "gptq_marlin_gemm"),
)}


def nvcc() -> Optional[str]:
    """The CUDA compiler a JIT would use: $CUDA_HOME/bin/nvcc, else nvcc on the PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None)


def _libraries(module) -> list[str]:
    """The compiled extension files of the package ``module`` belongs to."""
    top = importlib.import_module(module.__name__.split(".")[0])
    roots = list(getattr(top, "__path__", [])) or [os.path.dirname(getattr(top, "__file__", "") or ".")]
    files = [f for r in roots for f in glob.glob(os.path.join(r, "**", "*.so"), recursive=True)]
    if not getattr(top, "__path__", None) and getattr(top, "__file__", "").endswith(".so"):
        files.append(str(top.__file__))
    return sorted(set(files))


def _holds(path: str, needle: bytes) -> bool:
    with open(path, "rb") as f:
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return m.find(needle) >= 0
        except ValueError:  # an empty file
            return False


def _keywords(fn: Any) -> frozenset[str]:
    """The keyword parameters ``fn`` takes (none where it is not a callable with a signature)."""
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


@functools.cache
def _probe(module: str, needs: frozenset[str]) -> Optional[str]:
    p = PROVIDERS.get(module) or Provider(module, module, "")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # ImportError, or a library that does not load (built for another torch or CUDA)
        return f"does not import: {type(e).__name__}: {e}".splitlines()[0]
    target: Any = mod
    for part in p.kernel.split(".") if p.kernel else ():
        target = getattr(target, part, None)
        if target is None:
            return (f"has no {p.kernel} (a placeholder package, or another build of {p.package})")
    for feature, method in (p.keyword_features or {}).items():
        if feature in needs and feature not in _keywords(getattr(target, method, None)):
            return (f"its {p.kernel}.{method}() takes no {feature} (a {p.package} from before them), which this "
                    f"deployment needs")
    if p.missing_features:
        libs = _libraries(mod)
        lacking = sorted(f for f in needs if f in p.missing_features
                         and any(_holds(lib, p.missing_features[f]) for lib in libs))
        if lacking:
            return f"built without {', '.join(lacking)}, which this deployment needs"
    if p.jit and not any(importlib.util.find_spec(m) for m in p.precompiled) and nvcc() is None:
        return (f"compiles its kernels at first use and there is no nvcc here (set CUDA_HOME, or install "
                f"{' or '.join(p.precompiled).replace('_', '-')} for precompiled kernels)")
    return None


def probe(module: str, needs: frozenset[str] = frozenset()) -> Optional[str]:
    """None when ``module`` provides its kernel here with every feature in ``needs``, else why not."""
    return _probe(module, frozenset(needs))


def host_notes(module: str, cfg: Any, dtype: str) -> list[str]:
    """What a provider the probe found serving here (and so imported) says it runs on this machine for
    ``cfg`` (its ``host_notes``, where it has one): how the run-time choices of its kernels stand."""
    notes = getattr(sys.modules.get(module), "host_notes", None)
    return notes(cfg, dtype) if notes is not None else []


def first_usable(modules: tuple[str, ...], needs: frozenset[str] = frozenset()) -> tuple[Optional[str], list[str]]:
    """(the first of ``modules`` that serves, the reason each one before it does not)."""
    rejected: list[str] = []
    for module in modules:
        why = probe(module, needs)
        if why is None:
            return module, rejected
        rejected.append(f"{module}: {why}")
    return None, rejected


def attention_needs(backend: str, dtype: str, kv_cache_dtype: str) -> frozenset[str]:
    """The provider features an attention backend needs for a deployment's dtypes."""
    if backend != "flash_attn3":
        return frozenset()
    needs = {"paged_kv"}
    if dtype == "float16":
        needs.add("float16")
    if kv_cache_dtype.startswith("fp8"):
        needs.add("fp8")
    return frozenset(needs)
