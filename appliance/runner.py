"""One runner composes the deployment a resolved config describes.

It checks that this machine can run the profile, selects the attention
backend (walking the hardware's priority list, importability included),
and hands model, backend and engine to the server or the offline API.
"""

from __future__ import annotations

import logging
from typing import Any

from appliance.config.compose import ConfigError, ResolvedConfig
from appliance.config.detect import DeviceDescription, detect_device
from appliance.config.plan import format_plan, make_plan, resolve_dtype
from appliance.kernels.registry import BackendSelectionError, Selection, select_backend

log = logging.getLogger("appliance")


def _v(x: Any) -> Any:
    return getattr(x, "value", x)


def device_problems(cfg: Any, device: DeviceDescription) -> list[str]:
    """Why this machine cannot run ``cfg`` (empty when it can)."""
    hw = cfg.hardware
    want = _v(hw.device_kind)
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
    if device.count and needed > device.count:
        problems.append(f"the parallel layout needs {needed} devices; this machine has {device.count}")
    return problems


def select_runtime_backend(cfg: Any) -> Selection:
    dtype = resolve_dtype(cfg)
    sel = select_backend(cfg, dtype, check_import=True)
    if sel.chosen is None:
        raise BackendSelectionError(
            "no attention backend can serve this deployment:\n" + "\n".join(f"  - {ln}" for ln in sel.explain())
            + ("\n  (attention.fallback=allow lets the profile fall back to the next backend)"
               if _v(cfg.attention.fallback) == "deny" else "")
        )
    if sel.fallback_used:
        log.warning("attention backend %s is a fallback: %s", sel.chosen, "; ".join(sel.explain()[:-1]))
    return sel


def check_runnable(resolved: ResolvedConfig, device: DeviceDescription | None = None) -> Selection:
    problems = device_problems(resolved.cfg, device or detect_device())
    if problems:
        raise ConfigError("\n".join(problems))
    return select_runtime_backend(resolved.cfg)


def serve(resolved: ResolvedConfig) -> int:
    sel = check_runnable(resolved)
    if resolved.profile_reason:
        print(f"profile auto -> {resolved.cfg.profile}: {resolved.profile_reason}")
    print(format_plan(make_plan(resolved.cfg)))
    print(f"attention backend at run time: {sel.chosen}")
    from appliance.server.launch import serve_forever

    return serve_forever(resolved, sel)
