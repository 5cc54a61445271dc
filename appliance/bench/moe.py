"""`appliance bench moe`: what grouped expert execution buys, on this machine.

A random Qwen3-MoE of a size where the experts dominate (by default 4
sparse layers, hidden 256, 8 experts of 512, top 2; ``model.*`` overrides
change it) runs offline (``LLM.generate``, greedy, ``--num-prompts``
prompts of ``--input-len`` random tokens, ``--output-len`` tokens each,
all submitted together) three ways in one run:

- the native forward (``cpu_native``: one call per step, experts grouped in C),
- the torch layer path with grouped experts (``attention.backend=torch_sdpa``),
- the torch layer path with the naive loop, one token and expert at a time
  (the baseline grouping is measured against).

Results: output tok/s, ms per step, the ratio to the naive loop, achieved
GFLOP/s over the active parameters (2 x active parameters per token,
attention excluded) against the machine's peak, the native forward's
per-phase seconds, and the host's CPU model and flags, as JSON plus a bar
plot. EPLB is not built yet, so its rebalance cost is not measured.
"""

from __future__ import annotations

import argparse
import time

from appliance.bench.common import counting_steps, plot_bars, random_prompts, split_overrides, write_results

MODEL = ["model=tiny_random_moe", "model.num_layers=4", "model.hidden_size=256", "model.intermediate_size=512",
         "model.moe_intermediate_size=512", "model.head_dim=64", "model.mlp_only_layers=[]",
         "model.param_count_b=0", "cache.kv_cache_memory_gib=0.1"]
RUNS = {
    "native forward (grouped)": (["attention.backend=cpu_native"], False),
    "torch path (grouped)": (["attention.backend=torch_sdpa"], False),
    "torch path (per-token loop)": (["attention.backend=torch_sdpa"], True),
}


def run(overrides: list[str], per_token: bool, prompts: list[list[int]], output_len: int) -> dict:
    from appliance import LLM, SamplingParams

    llm = LLM(overrides=overrides)
    runner = llm.engine.runner
    for layer in runner.model.model.layers:
        if layer.sparse:
            layer.mlp.per_token = per_token
    native = runner.uses_native_forward
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
    return {"output_tok_s": tokens / elapsed, "elapsed_s": elapsed, "steps": counter["steps"],
            "ms_per_step": 1e3 * elapsed / counter["steps"], "native_forward": native,
            "achieved_gflop_s": flops / 1e9, "native_phase_s": phases,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench moe")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    from appliance.config.compose import resolve
    from appliance.config.plan import make_plan

    base = ["+profile=cpu", *MODEL, *overrides]
    cfg = resolve(base).cfg
    prompts = random_prompts(a.num_prompts, [a.input_len] * a.num_prompts, cfg.model.vocab_size)
    runs: dict[str, dict] = {}
    for label, (extra, per_token) in RUNS.items():
        runs[label] = run([*base, *extra], per_token, prompts, a.output_len)
        print(f"{label:30s} {runs[label]['output_tok_s']:8.1f} tok/s  {runs[label]['ms_per_step']:7.1f} ms/step  "
              f"{runs[label]['achieved_gflop_s']:6.1f} GFLOP/s", flush=True)
    naive = runs["torch path (per-token loop)"]
    same = all(r["tokens"] == naive["tokens"] for r in runs.values())
    for r in runs.values():
        r["vs_per_token_loop"] = r["output_tok_s"] / naive["output_tok_s"]
        del r["tokens"]
    plan = make_plan(cfg)
    peak = {"float32": cfg.hardware.peak_tflops.fp32, "bfloat16": cfg.hardware.peak_tflops.bf16}[plan.dtype]
    path = write_results(a.out, "moe", {"overrides": base, "num_prompts": a.num_prompts, "input_len": a.input_len,
                                        "output_len": a.output_len, "experts": plan.experts, "dtype": plan.dtype,
                                        "peak_gflop_s": peak * 1e3, "same_tokens_every_way": same,
                                        "eplb_rebalance": "not built yet", "runs": runs})
    plot_bars(a.out, "moe", "mixture of experts: grouped execution vs the per-token loop",
              {k: v["output_tok_s"] for k, v in runs.items()}, "output tok/s")
    print(path)
    return 0
