"""No key without an effect: every leaf of the schema, changed on its own
from a runnable deployment, either changes what is composed (plan,
execution, KV blocks, limits, layout), or is refused (by validation, or by
the composition root as not built yet), or is read where the engine is
built or served (``runner/`` and its gate ``config/execution.py``,
``engine/``, ``worker/``, ``models/``, ``server/``; config code that only
validates or plans does not count).

A key added to the schema is covered the moment it exists: give it a
valid alternative value in ``ALTERNATIVES`` when the generic one is out of
its range."""

import ast
import dataclasses
import functools
from enum import Enum
from pathlib import Path
from typing import Any, get_args

import pytest

from appliance.config import schema
from appliance.config.compose import resolve
from appliance.errors import ConfigError
from appliance.runner import compose

ROOT = Path(__file__).resolve().parents[2] / "appliance"
CONSUMERS = [*(ROOT / "runner").rglob("*.py"), *(ROOT / "engine").rglob("*.py"), *(ROOT / "worker").rglob("*.py"),
             *(ROOT / "models").rglob("*.py"), *(ROOT / "server").rglob("*.py"),
             ROOT / "config" / "execution.py"]  # check_runnable: the composition root's gate before it serves
BASE = ["+profile=cpu"]
# Keys that matter only beside other values (another profile, a pool sized
# from memory): compared from there.
FROM_MEMORY = [*BASE, "cache.kv_cache_memory_gib=null"]
BASES = {
    # AWQ's default groups of 128 do not divide SmolLM2's 576 inputs
    "quantization.weight_bits": [*BASE, "quantization=awq", "quantization.group_size=64"],
    "quantization.group_size": [*BASE, "quantization=awq", "quantization.group_size=64"],
    "quantization.activations": ["+profile=h100_fp8"],
    "cache.memory_utilization": FROM_MEMORY,
    "hardware.memory_gib": FROM_MEMORY,
    # the default GGUF's prefill multiplies int8 rows (hardware.peak_tflops.int8); dequantized, fp32 or bf16
    "hardware.peak_tflops.fp32": [*BASE, "model.dtype=float32", "quantization=none"],
    "hardware.peak_tflops.bf16": [*BASE, "quantization=none"],
    "hardware.peak_tflops.fp16": ["+profile=h100_bf16", "model.dtype=float16"],
    "hardware.peak_tflops.fp8": ["+profile=h100_fp8"],
    "hardware.fp8": ["+profile=h100_fp8"],
    "hardware.compute_capability": ["+profile=h100_bf16"],
    "parallel.pipeline_parallel_size": [*BASE, "hardware.num_devices=2"],
    "parallel.data_parallel_size": [*BASE, "hardware.num_devices=2"],
    # collectives exist only across ranks
    "hardware.interconnect_gbps": [*BASE, "parallel=tp3"],
    "hardware.collective_latency_us": [*BASE, "parallel=tp3"],
    "parallel.pp_layer_partition": [*BASE, "parallel=pp2"],
    # which layers slide, beside a window to slide
    "model.layer_types": [*BASE, "model.sliding_window=512"],
}
# Keys whose effect is only where the engine is built or served (the tests
# of those parts show it); the test checks that code there reads them.
RUN_TIME_KEYS = {
    "model.path", "model.rope_theta", "model.rms_norm_eps", "model.rope_scaling.factor",
    "model.rope_scaling.low_freq_factor", "model.rope_scaling.high_freq_factor",
    "model.rope_scaling.original_max_position_embeddings", "model.seed",
    "scheduler.long_prefill_token_threshold", "scheduler.max_num_partial_prefills", "scheduler.policy",
    "cache.enable_prefix_caching", "cache.prefix_caching_hash_algo",
    "attention.fallback",  # acts when the profile's first backend cannot run here
    "parallel.step_timeout_s",  # how long the mp executor waits for a step
    "parallel.cpu_collectives",  # how the mp executor's CPU ranks exchange
    *(f"server.{k}" for k in (
        "host", "port", "api_key", "api_key_file", "internal_key", "internal_key_file", "allow_unauthenticated",
        "tenant_isolation", "max_queue_len", "max_body_bytes", "request_timeout_s", "shutdown_timeout_s",
        "header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "max_connections", "tokenizer_threads",
        "max_core_restarts", "core_restart_window_s", "core_restart_backoff_s", "core_start_timeout_s",
        "core_heartbeat_timeout_s", "cors_origins", "dev_mode", "otlp_traces_endpoint", "responses_store_max",
        "responses_store_mib")),
    # how output constraints are bounded: checked at the boundary and in the trial compile (server/structured.py)
    *(f"structured_output.{k}" for k in ("max_schema_bytes", "max_schema_depth", "compile_timeout_s",
                                         "compile_memory_mib")),
    # read by `appliance route` (server/router.py), not by the deployment it runs beside
    *(f"router.{k}" for k in ("policy", "instances", "kv_load_weight", "kv_match_threshold", "host", "port",
                              "health_interval_s", "request_timeout_s")),
}

# Where the generic change (below) is not a valid value for the base deployment.
ALTERNATIVES = {
    "router.policy": "least_load",
    "server.reasoning_parser": "qwen3",
    "server.tool_parser": "llama3_json",  # auto reads as hermes on a chat-template model
    "router.instances": ["http://127.0.0.1:8001"],
    "parallel.executor": "mp",  # one rank in a worker process
    "parallel.pp_layer_partition": [13, 17],
    "model.path": "tiny_random",
    "model.layer_types": ["full_attention"] * 15 + ["sliding_attention"] * 15,  # SmolLM2's 30 layers
    "model.architecture": "Qwen2ForCausalLM",
    "model.head_dim": 128,
    "model.num_kv_heads": 1,
    "model.num_heads": 3,
    "model.max_position_embeddings": 4096,
    "model.rope_scaling.type": "linear",
    "model.rope_scaling.short_factor": [1.0] * 32,  # SmolLM2's 64-wide heads: one per rotated pair
    "model.rope_scaling.long_factor": [1.0] * 32,
    "quantization.weight_bits": 8.0,
    "quantization.method": "int8_wo",
    "quantization.activations": False,
    "quantization.group_size": 32,
    "cache.block_size": 32,
    "cache.memory_utilization": 0.5,
    "cache.kv_cache_memory_gib": 0.5,
    "cache.kv_cache_dtype": "bfloat16",
    "cache.num_blocks": 100,
    "hardware.name": "other_cpu",
    "hardware.device_kind": "cuda",
    "hardware.compute_capability": "8.0",
    "hardware.min_block_size": 32,
    "hardware.max_block_size": 8,
    "hardware.attention_backends": ["torch_sdpa"],
    "hardware.supported_dtypes": ["float32"],
    "hardware.fp8": False,
    "server.host": "0.0.0.0",
    "server.otlp_traces_endpoint": "http://127.0.0.1:4318",
    "speculative.method": "ngram",
    "speculative.num_speculative_tokens": 2,
    "attention.backend": "torch_sdpa",
    "attention.fallback": "deny",
    "profile": "cpu_int8",
}


def leaves(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for f in dataclasses.fields(cls):
        t = f.type if not isinstance(f.type, str) else eval(f.type, vars(schema))  # noqa: S307 (the schema's own names)
        if dataclasses.is_dataclass(t):
            out += leaves(t, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", t))
    return out


LEAVES = leaves(schema.ApplianceConfig)


def generic_change(value: Any, typ: Any) -> Any:
    if isinstance(typ, type) and issubclass(typ, Enum):
        return next(m.value for m in typ if m.value != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1 if value > 0 else 2
    if isinstance(value, float):
        return value * 2 if value else 0.5
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return value[:-1] if value else ["x"]
    if value is None:
        inner = [a for a in get_args(typ) if a is not type(None)]
        return {int: 512, float: 0.5, str: "x"}[inner[0]]
    raise AssertionError(f"no generic change for {value!r}")


def value_at(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def written(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ",".join(map(str, v)) + "]"
    return str(v)


def observe(overrides: list[str]) -> tuple[str, Any]:
    """("refused", why) when validation refuses; else whether this machine
    would refuse to run it (None: it runs) and what it composes to."""
    try:
        r = resolve(overrides)
    except ConfigError as e:
        return "refused", str(e)
    try:
        compose(r)
        refused_here = None
    except ConfigError as e:  # cannot run here, or not built yet
        refused_here = str(e)
    d = compose(r, here=False)
    return "composed", (refused_here, d.plan.to_dict(), d.execution.to_dict(), d.num_kv_blocks, d.max_model_len,
                        d.max_prompt_chars, d.device, d.model_name, d.layout)


def read_by_consumers(attr: str) -> list[str]:
    hits = []
    for path in CONSUMERS:
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(tree)):
            hits.append(path.name)
    return hits


def test_every_leaf_is_listed():
    assert len(LEAVES) > 90 and len({p for p, _ in LEAVES}) == len(LEAVES)
    assert set(ALTERNATIVES) <= {p for p, _ in LEAVES}


@functools.lru_cache(maxsize=None)
def observe_base(base: tuple[str, ...]) -> tuple[Any, tuple[str, Any]]:
    """The resolved config and ``observe`` of a base override set, once per
    set: every key's case compares against one of a few bases."""
    return resolve(list(base)).cfg, observe(list(base))


@pytest.mark.parametrize("path,typ", LEAVES, ids=[p for p, _ in LEAVES])
def test_changing_a_key_has_an_effect(path, typ):
    base = BASES.get(path, BASE)
    base_cfg, base_seen = observe_base(tuple(base))
    before = value_at(base_cfg, path)
    after = ALTERNATIVES[path] if path in ALTERNATIVES else generic_change(before, typ)
    assert after != before
    kind, seen = observe(base + [f"{path}={written(after)}"])
    if kind == "refused":
        # A refusal must be about this key, not an unrelated invalid alternative.
        assert path.rsplit(".", 1)[-1] in seen or "not built yet" in seen, seen
        return
    if (kind, seen) != base_seen:
        return
    attr = path.rsplit(".", 1)[-1]
    assert path in RUN_TIME_KEYS, (f"{path}={after} changes nothing that is composed: if it acts when the engine is "
                                   f"built or served, list it in RUN_TIME_KEYS; else delete it or refuse it")
    assert read_by_consumers(attr), f"no code that builds or serves the engine reads .{attr}"


def test_run_time_keys_are_schema_leaves():
    assert RUN_TIME_KEYS <= {p for p, _ in LEAVES}


@pytest.mark.parametrize("override,message", [
    ("model=tiny_random_moe parallel=dp2 parallel.enable_expert_parallel=true parallel.executor=ray "
     "parallel.ray_address=auto", "on Ray it is not built yet"),
    ("parallel=pp2 parallel.pp_layer_partition=[10,10]", "must give each of the 2 pipeline stages"),
    ("parallel=dp2 parallel.executor=ray", "needs parallel.ray_address"),
    ("parallel.ray_address=auto", "has no effect with parallel.executor=auto"),
    ("hardware=h100 parallel.cpu_collectives=gloo", "parallel.cpu_collectives=gloo has no effect on hardware=h100"),
    ("cache.swap_space_gib=1", "not built yet"),
    ("cache.cpu_offload_gib=1", "not built yet"),
    ("speculative.num_speculative_tokens=3", "has no effect with speculative=off"),
])
def test_planned_but_unbuilt_keys_are_refused_when_run(override, message):
    kind, seen = observe(BASE + [*override.split(), "hardware.num_devices=4"])
    why = seen if kind == "refused" else seen[0]  # refused by validation, or by compose for this machine
    assert why and message in why


def test_plan_notes_what_serving_would_refuse():
    plan = compose(resolve(BASE + ["cache.swap_space_gib=1"]), here=False).plan
    assert any("not built yet" in n and "swap_space_gib" in n for n in plan.notes)
