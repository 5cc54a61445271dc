"""Keys that plan but do not run yet.

A config key either changes what runs or is refused: these values resolve
and validate (``appliance plan`` shows what they would take, with a note),
and every entry point that runs a model (``appliance run``, the offline
``LLM``) refuses them with the message here.
"""

from __future__ import annotations

from appliance.config.quantization import method_of
from appliance.config.schema import ApplianceConfig



def not_built(cfg: ApplianceConfig) -> list[str]:
    """What ``cfg`` asks for that plans but does not run yet: serving and the
    offline LLM refuse these (``appliance plan`` notes them)."""
    out = []
    par, cache, q = cfg.parallel, cfg.cache, cfg.quantization
    layout = (f"tp x pp x dp = {par.tensor_parallel_size} x {par.pipeline_parallel_size} x {par.data_parallel_size}"
              f"{', expert parallel' if par.enable_expert_parallel else ''}")
    if par.enable_expert_parallel and par.data_parallel_size > 1 and par.executor == "ray":
        out.append(f"parallel execution ({layout}): expert parallelism across data-parallel engine cores is built "
                   f"on the uni and mp executors (e.g. parallel=dp2_ep, dp8_ep); on Ray it is not built yet")
    if not method_of(cfg).runnable:
        out.append(f"quantization={q.method} can be planned but its weight kernels are not built yet; serve with "
                   f"quantization=none (or int4_wo / int8_wo on a CPU)")
    for key, value, what in [("swap_space_gib", cache.swap_space_gib, "swapping preempted requests' KV to host memory"),
                             ("cpu_offload_gib", cache.cpu_offload_gib, "offloading weights to host memory")]:
        if value > 0:
            out.append(f"cache.{key}={value:g}: {what} is not built yet (preempted requests are recomputed); "
                       f"serve with cache.{key}=0")
    return out
