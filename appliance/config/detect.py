"""What machine is this, and which profile fits it (``+profile=auto``)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DeviceDescription:
    kind: str  # cpu | cuda | rocm
    name: str = ""
    capability: Optional[tuple[int, int]] = None
    memory_gib: float = 0.0
    count: int = 0


CPUINFO = "/proc/cpuinfo"
# The flags that decide what runs on a CPU: the native kernels need AVX2 and FMA;
# native bf16 arithmetic is AVX512-BF16 or AMX-BF16.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]

    @property
    def fast_bf16(self) -> bool:
        """Native bf16 arithmetic. Elsewhere torch's bf16 matmuls run about
        100x slower than fp32: correct, but never the fast choice."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def isa(self) -> list[str]:
        return [f for f in ISA_FLAGS if f in self.flags]

    def describe(self) -> str:
        return f"{self.model or 'unknown CPU'} ({' '.join(self.isa) or 'no AVX2'})"


def parse_cpuinfo(text: str) -> CpuInfo:
    """Model name and flags of the first processor in a /proc/cpuinfo text."""
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuInfo(model, flags)


def cpu_info() -> CpuInfo:
    """This CPU, read from /proc/cpuinfo (empty where there is none)."""
    try:
        with open(CPUINFO) as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return CpuInfo("", frozenset())


def cpu_has_fast_bf16() -> bool:
    return cpu_info().fast_bf16


# Device nodes a Linux GPU driver makes: NVIDIA's control node, AMD's compute
# (KFD) node, and WSL2's GPU paravirtualization node (CUDA under Windows).
GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def no_gpu_driver(nodes: tuple[str, ...] = GPU_NODES) -> bool:
    """Linux with none of the GPU drivers' device nodes: no CUDA or ROCm
    device can be visible, so there is no need to import torch to ask."""
    return sys.platform.startswith("linux") and not any(os.path.exists(n) for n in nodes)


def detect_device() -> DeviceDescription:
    if no_gpu_driver():
        return DeviceDescription(kind="cpu", name="cpu")
    try:
        import torch
    except ImportError:
        return DeviceDescription(kind="cpu", name="no torch")
    if not torch.cuda.is_available():
        return DeviceDescription(kind="cpu", name="cpu")
    props = torch.cuda.get_device_properties(0)
    kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return DeviceDescription(
        kind=kind,
        name=props.name,
        capability=(props.major, props.minor),
        memory_gib=props.total_memory / 1024**3,
        count=torch.cuda.device_count(),
    )


def pick_profile(d: DeviceDescription) -> tuple[str, str]:
    """(profile, reason). Raises ConfigError when no profile fits."""
    from appliance.errors import ConfigError

    if d.kind == "cpu":
        return "cpu", "no CUDA or ROCm device found"
    if d.kind == "rocm":
        return "mi300x_bf16", f"ROCm device {d.name}"
    cc = d.capability or (0, 0)
    if cc[0] == 9:
        if d.memory_gib > 100:
            return "h200_fp8", f"CUDA capability 9.0 with {d.memory_gib:.0f} GiB ({d.name}): H200"
        return "h100_fp8", f"CUDA capability 9.0 with {d.memory_gib:.0f} GiB ({d.name}): H100"
    if cc[0] == 10:
        return "b200_fp8", f"CUDA capability {cc[0]}.{cc[1]} ({d.name}): Blackwell"
    raise ConfigError(
        f"no profile fits CUDA device {d.name} (capability {cc[0]}.{cc[1]}); "
        f"pass +profile=NAME with one of the profiles and override hardware.* as needed"
    )
