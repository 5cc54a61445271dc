"""What a config runs as on a given host: compute dtype, KV dtype and
attention backend, chosen together.

``model.dtype=auto`` on a CPU is not a property of the CPU alone: the
native kernels (``cpu_native``) and torch's kernels (``torch_sdpa``) are
fastest at different dtypes, so the dtype follows the backend that will
actually run. The profile's backends are walked in order; each is offered
the dtypes it runs fastest at on this CPU (``cpu_dtype_preference``), and
the first backend that accepts one (and, when serving, can be imported or
built here) decides both. Elsewhere ``auto`` is the hardware's first
supported dtype.

``resolve_execution(cfg, probe=False)`` reasons about the target hardware
(plan on any machine: a backend's package is assumed present);
``probe=True`` asks this machine (serving, and plan/config/profiles for a
profile of this machine's kind). The config hash stays the hash of the
declarative config; ``Execution.fingerprint`` adds what was resolved here.

``check_runnable`` is the serving gate: the execution this machine will
run, or every reason it cannot (``device_problems``: the device kind,
compute capability and device count; the executor's package; no attention
backend). ``executor_kind`` says what runs an engine core's ranks.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from appliance.config.architectures import ARCHITECTURES
from appliance.config.kv_groups import kv_layout
from appliance.config.detect import CpuInfo, DeviceDescription, cpu_info, detect_device
from appliance.config.quantization import QUANTIZATION_METHODS
from appliance.config.schema import ApplianceConfig
from appliance.kernels import registry
from appliance.errors import ConfigError
from appliance.kernels.registry import BACKENDS, BackendSelectionError, Selection, select_backend

if TYPE_CHECKING:
    from appliance.config.compose import ResolvedConfig


def kv_dtype(cfg: ApplianceConfig, dtype: str) -> str:
    """The KV cache's element type for compute ``dtype``: the one place
    ``cache.kv_cache_dtype=auto`` is decided (it keeps the compute dtype)."""
    kv = cfg.cache.kv_cache_dtype
    return dtype if kv == "auto" else kv


def cpu_dtype_preference(backend: str, cpu: CpuInfo, quantization: str = "none") -> tuple[str, ...]:
    """The dtypes ``backend`` runs fastest at on ``cpu``, fastest first.

    Measured with `appliance bench throughput` (docs/benchmarks.md, "dtype and
    backend per CPU class"). The native kernels stream half the weight bytes
    in bf16 (1.7-2x fp32 at one request on any CPU; at 32 requests equal
    where bf16 weights are widened to fp32, 2x where AVX512-BF16 runs the
    GEMMs), so they prefer bf16 everywhere; with int8 or int4 weights only the
    embedding and norms would be bf16, which measured slower at one request.
    torch's bf16 matmuls are fast only with native bf16 arithmetic (about
    100x slower than fp32 elsewhere). A GGUF file's own blocks (gguf) keep
    bf16 first: with their block-quantized LM head, bf16 (embedding, norms,
    the KV cache auto follows) measured 1.05x fp32 at one request on
    SmolLM2's Q4_1 file. The Triton interpreter computes in fp32 whatever
    the dtype."""
    if backend == "cpu_native":
        return ("float32", "bfloat16") if QUANTIZATION_METHODS[quantization].cpu_at_load else ("bfloat16", "float32")
    if backend == "triton" or not cpu.fast_bf16:
        return ("float32", "bfloat16", "float16")
    return ("bfloat16", "float32", "float16")


@dataclass(frozen=True)
class Execution:
    dtype_requested: str
    dtype: str
    dtype_reason: str
    kv_cache_dtype_requested: str
    kv_cache_dtype: str
    selection: Selection
    host: str  # what was asked: this machine, or the target hardware (not probed)
    probed: bool

    @property
    def backend(self) -> Optional[str]:
        return self.selection.chosen

    def fallback_note(self) -> Optional[str]:
        """One line when the backend is not the profile's first choice: why,
        and the override or fix that avoids it."""
        if not self.selection.fallback_used or not self.selection.rejected:
            return None
        first, reasons = self.selection.rejected[0]
        fixes = [_fix(first, r) for r in reasons]
        fix = "; ".join(f for f in fixes if f)
        return (f"attention backend {self.backend} instead of {first} ({'; '.join(reasons)})"
                + (f"; to run {first}: {fix}" if fix else ""))

    def fingerprint(self, config_hash: str) -> str:
        """The declarative config hash plus what this host resolved it to."""
        key = "|".join([config_hash, self.dtype, self.kv_cache_dtype, str(self.backend),
                        str(self.selection.provider), self.host])
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "probed": self.probed,
            "dtype": {"requested": self.dtype_requested, "resolved": self.dtype, "reason": self.dtype_reason},
            "kv_cache_dtype": {"requested": self.kv_cache_dtype_requested, "resolved": self.kv_cache_dtype},
            "attention_backend": {"resolved": self.backend, "provider": self.selection.provider,
                                  "chain": self.selection.explain(), "fallback": self.fallback_note()},
        }

    def summary(self) -> list[str]:
        """Lines for plan / config / run: what was asked, what runs."""
        where = "on this host" if self.probed else "for the target hardware"
        return [
            f"host               {self.host}",
            f"dtype              {self.dtype_requested} -> {self.dtype} {where} ({self.dtype_reason})",
            f"kv cache dtype     {self.kv_cache_dtype_requested} -> {self.kv_cache_dtype}",
        ]


def _fix(backend: str, reason: str) -> str:
    if reason.startswith("dtype "):
        return "model.dtype=auto"
    if reason.startswith("kv_cache_dtype "):
        return "cache.kv_cache_dtype=auto"
    if reason.startswith("no usable package") and backend == "cpu_native":
        return "install gcc (the kernels build once at first start) or set APPLIANCE_KERNEL_DIR to a prebuilt library"
    if reason.startswith("no usable package"):
        return f"install a package that provides {backend} (README, Install notes)"
    if reason.startswith("block_size "):
        return "a cache.block_size the backend supports"
    return ""


def describe_host(cfg: ApplianceConfig, device: Optional[DeviceDescription] = None) -> str:
    kind = cfg.hardware.device_kind
    if kind == "cpu":
        return f"cpu: {cpu_info().describe()}"
    if device is not None and device.kind == kind:
        cc = f" {device.capability[0]}.{device.capability[1]}" if device.capability else ""
        return f"{kind}: {device.name}{cc}"
    return f"{kind}: {cfg.hardware.name}"


def choose_dtype(cfg: ApplianceConfig, probe: bool = False) -> tuple[str, str]:
    """(compute dtype, why) for ``cfg``; ``auto`` resolved (see module doc)."""
    requested = cfg.model.dtype
    supported = list(cfg.hardware.supported_dtypes) or ["float32"]
    if requested != "auto":
        return requested, "set in the config"
    if cfg.hardware.device_kind != "cpu":
        return supported[0], f"the first dtype {cfg.hardware.name} supports"
    return _cpu_auto_dtype(cfg, supported, probe)


def attention_needs(cfg: ApplianceConfig) -> tuple[str, ...]:
    """What of the model's attention a backend must compute (``BackendCapabilities.features``): its layers'
    attention sinks (gpt-oss's), chunked local attention (Llama 4's, where a chunk ends before max_model_len)."""
    m = cfg.model
    row = ARCHITECTURES.get(m.architecture)
    sinks = ("sinks",) if row is not None and row.gpt_oss else ()
    chunked = any(g.attention_chunk is not None
                  for g in kv_layout(m, m.max_model_len or m.max_position_embeddings).groups)
    return sinks + (("chunked",) if chunked else ())


def resolve_execution(cfg: ApplianceConfig, probe: bool = False, device: Optional[DeviceDescription] = None) -> Execution:
    """Choose dtype, KV dtype and attention backend for ``cfg`` (see module doc)."""
    dtype, reason = choose_dtype(cfg, probe)
    sel = select_backend(cfg, dtype, check_import=probe, needs=attention_needs(cfg))
    kind = cfg.hardware.device_kind
    return Execution(
        dtype_requested=cfg.model.dtype, dtype=dtype, dtype_reason=reason,
        kv_cache_dtype_requested=cfg.cache.kv_cache_dtype, kv_cache_dtype=kv_dtype(cfg, dtype),
        selection=sel, host=describe_host(cfg, device) if probe else f"{kind}: {cfg.hardware.name} (target hardware, not probed here)",
        probed=probe,
    )


def _cpu_auto_dtype(cfg: ApplianceConfig, supported: list[str], probe: bool) -> tuple[str, str]:
    cpu = cpu_info()
    forced = cfg.attention.backend
    order = [forced] if forced != "auto" else list(cfg.hardware.attention_backends)
    deny = cfg.attention.fallback == "deny"
    first_choice = None
    for i, name in enumerate(order):
        if name not in BACKENDS:
            continue
        for dtype in cpu_dtype_preference(name, cpu, cfg.quantization.method):
            if dtype not in supported or BACKENDS[name].validate(cfg, dtype, attention_needs(cfg)):
                continue
            first_choice = first_choice or (dtype, name)
            if probe and registry.probe_provider(name, dtype, cfg.cache.kv_cache_dtype)[0] is None:
                break  # this backend cannot run here: offer the next one its own best dtype
            return dtype, _why(name, cpu)
        else:
            continue
        if i == 0 and deny:
            break
    if first_choice:  # nothing runs here; plan as the profile's first choice would
        return first_choice[0], _why(first_choice[1], cpu)
    return supported[0], "no backend of the profile accepts a supported dtype"


def _why(backend: str, cpu: CpuInfo) -> str:
    if backend == "torch_sdpa":
        return f"fastest on {backend} on a CPU {'with' if cpu.fast_bf16 else 'without'} native bf16"
    return f"fastest on {backend}"


def device_problems(cfg: ApplianceConfig, device: DeviceDescription) -> list[str]:
    """Why this machine cannot run ``cfg`` (empty when it can)."""
    hw = cfg.hardware
    want = hw.device_kind
    if want == "cpu":
        return []
    if device.kind != want:
        kind = {"cuda": "a CUDA", "rocm": "a ROCm"}[want]
        return [
            f"profile {cfg.profile} needs {kind} device (hardware={hw.name}"
            + (f", compute capability {hw.compute_capability}" if want == "cuda" else "")
            + f"); this machine has {'none' if device.kind == 'cpu' else device.kind}. "
            "Use +profile=cpu, or +profile=auto to pick what this machine can run"
        ]
    problems = []
    if want == "cuda" and hw.compute_capability and device.capability:
        have = f"{device.capability[0]}.{device.capability[1]}"
        if have != hw.compute_capability:
            problems.append(
                f"profile {cfg.profile} targets compute capability {hw.compute_capability} but "
                f"{device.name} has {have}; use +profile=auto"
            )
    needed = cfg.parallel.tensor_parallel_size * cfg.parallel.pipeline_parallel_size * cfg.parallel.data_parallel_size
    # Ray places the ranks on its cluster's nodes (and says when it cannot); otherwise they are this machine's
    if device.count and needed > device.count and executor_kind(cfg) != "ray":
        problems.append(f"the parallel layout needs {needed} devices; this machine has {device.count}")
    return problems


def execution_here(resolved: ResolvedConfig, device: DeviceDescription | None = None) -> Execution:
    """What ``resolved`` runs as on this machine when the profile is of this
    machine's kind (probed: importable backends only); the target hardware's
    plan otherwise."""
    device = device or detect_device()
    if resolved.cfg.hardware.device_kind != device.kind:
        return resolve_execution(resolved.cfg)
    return resolve_execution(resolved.cfg, probe=True, device=device)


def check_runnable(resolved: ResolvedConfig, device: DeviceDescription | None = None) -> Execution:
    """The execution this machine will run, or ConfigError with every reason it cannot."""
    device = device or detect_device()
    problems = device_problems(resolved.cfg, device)
    if problems:
        raise ConfigError("\n".join(problems))
    ex = resolve_execution(resolved.cfg, probe=True, device=device)
    if executor_kind(resolved.cfg) == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("parallel.executor=ray needs the ray package, which is not installed here: "
                          "pip install 'appliance[ray]' (or use parallel.executor=mp)")
    sel = ex.selection
    if sel.chosen is None:
        raise BackendSelectionError(
            "no attention backend can serve this deployment:\n" + "\n".join(f"  - {ln}" for ln in sel.explain())
            + ("\n  (attention.fallback=allow lets the profile fall back to the next backend)"
               if resolved.cfg.attention.fallback == "deny" else "")
        )
    return ex


def executor_kind(cfg: ApplianceConfig) -> str:
    """What runs an engine core's ranks (tensor x pipeline; each
    data-parallel rank is a core of its own): ``parallel.executor``, where
    ``auto`` is ``uni`` for one rank and ``mp`` for more."""
    par = cfg.parallel
    if par.executor != "auto":
        return par.executor
    return "uni" if par.tensor_parallel_size * par.pipeline_parallel_size == 1 else "mp"
