"""The composition root: one place turns a resolved config into what runs.

``compose(resolved)`` checks that this machine can run the profile
(``config.execution.check_runnable``), resolves dtype, KV dtype and
attention backend together (walking the hardware's priority list,
importability included), plans memory and returns the frozen
``Deployment`` that the offline ``LLM``, the server, the engine-core
process and ``appliance plan`` all read. The builders under it, each
typed with ``Deployment``:

- ``runner.engine``: ``build_engine``, the engine core (scheduler, KV
  cache, token budget, output constraints, KV events) over
- ``runner.ranks``: the step runner, in this process or over worker
  processes / Ray actors (``rank_group``: what the executors read;
  ``build_rank_runner``: a rank's part, built in its process);
- ``runner.model``: a model runner (weights, quantization, backend, KV
  cache, speculative proposer);
- ``runner.kv``: the KV connector's sides and the KV events' publisher.

The server receives ``build_engine`` as a function, so nothing below this
package imports it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from appliance.config.compose import ResolvedConfig
from appliance.config.deployment import PROMPT_CHARS_PER_TOKEN, Deployment, ExecutorLayout
from appliance.config.detect import DeviceDescription
from appliance.config.execution import check_runnable, execution_here, executor_kind, resolve_execution
from appliance.config.kv_connectors import connector_of
from appliance.config.memory import max_model_len
from appliance.config.plan import format_plan, make_plan
from appliance.config.unbuilt import not_built
from appliance.errors import ConfigError
from appliance.kernels.registry import Selection
from appliance.runner.engine import build_engine
from appliance.runner.kv import connector_key
from appliance.runner.ranks import build_rank_runner, expert_group_address

__all__ = ["build_engine", "build_rank_runner", "compose", "serve", "startup_lines"]


def startup_lines(deployment: Deployment) -> list[str]:
    """What every entry point prints first: the profile picked, then a fallback
    with its reason and the override that avoids it, each once."""
    resolved, ex = deployment.resolved, deployment.execution
    lines = []
    if resolved.profile_reason:
        lines.append(f"profile auto -> {resolved.cfg.profile}: {resolved.profile_reason}")
    note = ex.fallback_note()
    if note:
        lines.append(f"note: {note}")
    return lines


def compose(resolved: ResolvedConfig, *, here: bool = True, device: Optional[DeviceDescription] = None,
            selection: Optional[Selection] = None) -> Deployment:
    """The deployment ``resolved`` describes.

    ``here`` (serving, the offline ``LLM``): as this machine runs it, or
    ConfigError / BackendSelectionError with every reason it cannot.
    Otherwise (``appliance plan``): as this machine would run it when the
    profile is of its kind, else as the target hardware would.
    ``selection`` replaces backend selection (to compare one backend with
    another on the same config)."""
    if selection is not None:
        ex = replace(resolve_execution(resolved.cfg), selection=selection)
    elif here:
        ex = check_runnable(resolved, device)
    else:
        ex = execution_here(resolved, device)
    unbuilt = not_built(resolved.cfg)
    if unbuilt and (here or selection is not None):
        raise ConfigError("this deployment plans but cannot run yet:\n" + "\n".join(f"  - {u}" for u in unbuilt))
    cfg = resolved.cfg
    plan = make_plan(cfg, ex)
    mml = max_model_len(cfg)
    par = cfg.parallel
    return Deployment(
        resolved=resolved, execution=ex, plan=plan,
        device="cuda" if cfg.hardware.device_kind in ("cuda", "rocm") else "cpu",
        num_kv_blocks=cfg.cache.num_blocks or plan.num_kv_blocks,
        max_model_len=mml,
        max_prompt_chars=cfg.server.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * mml,
        layout=ExecutorLayout(par.tensor_parallel_size, par.pipeline_parallel_size, par.data_parallel_size,
                              plan.parallel["expert_parallel_size"], executor_kind(cfg)),
    )


def serve(resolved: ResolvedConfig) -> int:
    from appliance.server.auth import check_exposure, load_api_keys, load_internal_key

    cfg = resolved.cfg
    check_exposure(cfg.server, load_api_keys(cfg.server))
    # the keys read before anything starts: an unreadable file or a missing key leaves nothing half-started
    row = connector_of(cfg)
    if row is not None and row.disaggregated:
        connector_key(cfg)
    else:
        load_internal_key(cfg.server)
    deployment = compose(resolved)
    for line in startup_lines(deployment):
        print(line)
    print(format_plan(deployment.plan))
    print(f"config hash        {resolved.hash}")
    print(f"deployment         {deployment.fingerprint}")
    from appliance.server.launch import serve_forever

    return serve_forever(deployment, build_engine, lambda n: expert_group_address(deployment, n))
