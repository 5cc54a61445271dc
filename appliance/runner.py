"""One runner composes the deployment a resolved config describes.

It checks that this machine can run the profile, selects the attention
backend (walking the hardware's priority list, importability included),
and hands model, backend and engine to the server or the offline API.
"""

from __future__ import annotations

from typing import Any

from appliance.config.compose import ConfigError, ResolvedConfig
from appliance.config.detect import DeviceDescription, detect_device
from appliance.config.execution import Execution, resolve_execution
from appliance.config.plan import format_plan, make_plan
from appliance.kernels.registry import BackendSelectionError


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


def execution_here(resolved: ResolvedConfig, device: DeviceDescription | None = None) -> Execution:
    """What ``resolved`` runs as on this machine when the profile is of this
    machine's kind (probed: importable backends only); the target hardware's
    plan otherwise."""
    device = device or detect_device()
    if _v(resolved.cfg.hardware.device_kind) != device.kind:
        return resolve_execution(resolved.cfg)
    return resolve_execution(resolved.cfg, probe=True, device=device)


def check_runnable(resolved: ResolvedConfig, device: DeviceDescription | None = None) -> Execution:
    """The execution this machine will run, or ConfigError with every reason it cannot."""
    device = device or detect_device()
    problems = device_problems(resolved.cfg, device)
    if problems:
        raise ConfigError("\n".join(problems))
    ex = resolve_execution(resolved.cfg, probe=True, device=device)
    sel = ex.selection
    if sel.chosen is None:
        raise BackendSelectionError(
            "no attention backend can serve this deployment:\n" + "\n".join(f"  - {ln}" for ln in sel.explain())
            + ("\n  (attention.fallback=allow lets the profile fall back to the next backend)"
               if _v(resolved.cfg.attention.fallback) == "deny" else "")
        )
    return ex


def startup_lines(resolved: ResolvedConfig, ex: Execution) -> list[str]:
    """What every entry point prints first: the profile picked, then a fallback
    with its reason and the override that avoids it, each once."""
    lines = []
    if resolved.profile_reason:
        lines.append(f"profile auto -> {resolved.cfg.profile}: {resolved.profile_reason}")
    note = ex.fallback_note()
    if note:
        lines.append(f"note: {note}")
    return lines


def serve(resolved: ResolvedConfig) -> int:
    from appliance.server.auth import check_exposure, load_api_keys

    check_exposure(resolved.cfg.server, load_api_keys(resolved.cfg.server))
    ex = check_runnable(resolved)
    for line in startup_lines(resolved, ex):
        print(line)
    print(format_plan(make_plan(resolved.cfg, ex)))
    print(f"config hash        {resolved.hash}")
    print(f"deployment         {ex.fingerprint(resolved.hash)}")
    from appliance.server.launch import serve_forever

    return serve_forever(resolved, ex)
