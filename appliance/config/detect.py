"""What machine is this, and which profile fits it (``+profile=auto``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DeviceDescription:
    kind: str  # cpu | cuda | rocm
    name: str = ""
    capability: Optional[tuple[int, int]] = None
    memory_gib: float = 0.0
    count: int = 0


def cpu_has_fast_bf16() -> bool:
    """True when this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16).

    Elsewhere torch's bf16 matmuls run 100x slower than fp32, so ``dtype=auto``
    stays fp32. ``APPLIANCE_CPU_BF16=0|1`` overrides the detection.
    """
    forced = os.environ.get("APPLIANCE_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def detect_device() -> DeviceDescription:
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
    from appliance.config.compose import ConfigError

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
