"""`appliance bench moe`: what grouped expert execution buys, on this machine.

A random Qwen3-MoE of a size where the experts dominate (by default 4
sparse layers, hidden 256, 8 experts of 512, top 2; ``model.*`` overrides
change it) runs offline (``LLM.generate``, greedy, ``--num-prompts``
prompts of ``--input-len`` random tokens, ``--output-len`` tokens each,
all submitted together) three ways in one run:

- the native forward (``cpu_native``: one call per step, experts grouped in C),
- the torch layer path with grouped experts (``attention.backend=torch_sdpa``),
- the torch layer path with the naive loop, one token and expert at a time
  (the baseline grouping is measured against);

and, with ``--eplb-interval N`` (0: skip), expert parallelism over two
ranks (``parallel=tp2`` with ``enable_expert_parallel``) without and with
load balancing every N forwards (two redundant slots): the balancer's
balancedness and the time its rebalances took (placing the experts and
moving their weights between the ranks), each and in all.

Results: output tok/s, ms per step, the ratio to the naive loop, achieved
GFLOP/s over the active parameters (2 x active parameters per token,
attention excluded) against the machine's peak, the native forward's
per-phase seconds, and the host's CPU model and flags, as JSON plus a bar
plot.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from appliance.bench.common import counting_steps, plot_bars, random_prompts, split_overrides, write_results

MODEL = ["model=tiny_random_moe", "model.num_layers=4", "model.hidden_size=256", "model.intermediate_size=512",
         "model.moe_intermediate_size=512", "model.head_dim=64", "model.mlp_only_layers=[]",
         "model.param_count_b=0", "cache.kv_cache_memory_gib=0.1"]
RUNS = {
    "native forward (grouped)": (["attention.backend=cpu_native"], False),
    "torch path (grouped)": (["attention.backend=torch_sdpa"], False),
    "torch path (per-token loop)": (["attention.backend=torch_sdpa"], True),
}
EP = ["parallel=tp2", "parallel.enable_expert_parallel=true"]


def eplb_runs(interval: int) -> dict[str, tuple[list[str], bool]]:
    return {"ep2 (torch path)": (EP, False),
            f"ep2 + eplb every {interval} forwards": ([*EP, "parallel.eplb.enabled=true",
                                                      "parallel.eplb.num_redundant_experts=2",
                                                      f"parallel.eplb.step_interval={interval}",
                                                      f"parallel.eplb.window_size={interval}"], False)}


def run(overrides: list[str], per_token: bool, prompts: list[list[int]], output_len: int) -> dict:
    from appliance import LLM

    llm = LLM(overrides=overrides)
    try:
        return _timed(llm, per_token, prompts, output_len)
    finally:
        getattr(llm.engine.runner, "close", lambda: None)()  # an executor's worker processes


def _timed(llm: Any, per_token: bool, prompts: list[list[int]], output_len: int) -> dict:
    from appliance import SamplingParams

    runner = llm.engine.runner
    model = getattr(runner, "model", None)  # None under the mp executor: the model lives in its workers
    for layer in model.model.layers if model is not None else ():
        if layer.sparse:
            layer.mlp.per_token = per_token
    native = getattr(runner, "uses_native_forward", False)
    phases = None
    if native:
        from appliance.kernels.cpu_native import phase_times
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    if native:
        phase_times(reset=True)
    with counting_steps(llm.engine) as counter:
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        elapsed = time.perf_counter() - t
    if native:
        phases = phase_times()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    processed = tokens + sum(len(p) for p in prompts)  # every position runs the experts once
    plan = llm.deployment.plan
    flops = 2 * plan.experts["active_parameter_count"] * processed / elapsed
    stats = llm.engine.last_stats
    eplb = None
    if stats.expert_load:
        eplb = {"balancedness": stats.eplb_balancedness, "rebalances": stats.eplb_rebalances,
                "rebalance_s": stats.eplb_rebalance_seconds,
                "ms_per_rebalance": 1e3 * stats.eplb_rebalance_seconds / max(1, stats.eplb_rebalances)}
    return {"output_tok_s": tokens / elapsed, "elapsed_s": elapsed, "steps": counter["steps"],
            "ms_per_step": 1e3 * elapsed / counter["steps"], "native_forward": native,
            "achieved_gflop_s": flops / 1e9, "native_phase_s": phases, "eplb": eplb,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench moe")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--eplb-interval", type=int, default=8,
                   help="ep2 without and with load balancing every N forwards (0: skip those runs)")
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    from appliance.config.compose import resolve
    from appliance.config.plan import make_plan

    base = ["+profile=cpu", *MODEL, *overrides]
    cfg = resolve(base).cfg
    prompts = random_prompts(a.num_prompts, [a.input_len] * a.num_prompts, cfg.model.vocab_size)
    runs: dict[str, dict] = {}
    ways = {**RUNS, **(eplb_runs(a.eplb_interval) if a.eplb_interval > 0 else {})}
    for label, (extra, per_token) in ways.items():
        runs[label] = run([*base, *extra], per_token, prompts, a.output_len)
        print(f"{label:30s} {runs[label]['output_tok_s']:8.1f} tok/s  {runs[label]['ms_per_step']:7.1f} ms/step  "
              f"{runs[label]['achieved_gflop_s']:6.1f} GFLOP/s", flush=True)
    naive = runs["torch path (per-token loop)"]
    same = all(r["tokens"] == naive["tokens"] for r in runs.values())  # fp32: every way the same greedy tokens
    for r in runs.values():
        r["vs_per_token_loop"] = r["output_tok_s"] / naive["output_tok_s"]
        del r["tokens"]
    plan = make_plan(cfg)
    peak = {"float32": cfg.hardware.peak_tflops.fp32, "bfloat16": cfg.hardware.peak_tflops.bf16}[plan.dtype]
    path = write_results(a.out, "moe", {"overrides": base, "num_prompts": a.num_prompts, "input_len": a.input_len,
                                        "output_len": a.output_len, "experts": plan.experts, "dtype": plan.dtype,
                                        "peak_gflop_s": peak * 1e3, "same_tokens_every_way": same, "runs": runs})
    plot_bars(a.out, "moe", "mixture of experts: grouped execution vs the per-token loop",
              {k: v["output_tok_s"] for k, v in runs.items()}, "output tok/s")
    print(path)
    return 0
