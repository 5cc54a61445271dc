"""`appliance bench throughput`: offline throughput through ``LLM.generate``,
with Hugging Face transformers on the same model and prompts as the
baseline in the same run (``--baseline hf``).

``--also "OVERRIDES"`` (repeatable) runs our engine again with those extra
overrides on the same prompts (e.g. ``--also quantization=int8_wo``, which
is the cpu_int8 profile), so variants and baselines share one run. Where
the native CPU forward ran, its per-phase seconds are recorded.

Physics printed with every figure: achieved weight-streaming bandwidth
(weights are read once per engine step) as a fraction of `bench machine`'s
bandwidth, and achieved GFLOP/s (2 x parameters x tokens) as a fraction of
its GEMM peak.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from appliance.bench.common import (counting_steps, lengths_for, plot_bars, random_prompts, split_overrides,
                                    write_results)
from appliance.bench.machine import load_or_measure


def _native_phases(reset: bool) -> dict[str, float] | None:
    import sys

    mod = sys.modules.get("appliance.kernels.cpu_native")
    return mod.phase_times(reset=reset) if mod is not None else None


def run_ours(llm: Any, prompts: list[list[int]], output_len: int, repeat: int = 1) -> dict:
    from appliance import SamplingParams

    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    _native_phases(reset=True)
    runs = []
    with counting_steps(llm.engine) as counter:
        for i in range(repeat):
            counter["steps"] = 0
            if i:
                llm.engine.reset_prefix_cache()  # every run computes its prompts
            t = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
            runs.append((time.perf_counter() - t, counter["steps"]))
    elapsed, steps = sorted(runs)[len(runs) // 2]  # the median run
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"elapsed_s": elapsed, "runs_elapsed_s": [r[0] for r in runs], "output_tokens": out_tokens, "steps": steps,
           "output_tok_s": out_tokens / elapsed, "total_tok_s": (out_tokens + sum(map(len, prompts))) / elapsed,
           "requests_s": len(prompts) / elapsed, "attention_backend": llm.deployment.execution.backend,
           "executor": llm.deployment.layout.executor, "tensor_parallel_size": llm.deployment.layout.tensor_parallel_size}
    phases = _native_phases(reset=True)  # of this process: a model run by worker processes reports none
    if phases and llm.deployment.execution.backend == "cpu_native" and llm.deployment.layout.executor == "uni":
        res["native_phases_s"] = {k: v / repeat for k, v in phases.items()}  # mean per run
    return res


def measure(overrides: list[str], prompts: list[list[int]], output_len: int, machine: dict,
            repeat: int = 1) -> tuple[dict, Any, Any]:
    """Our engine on the prompts, with bandwidth and FLOP figures; (result, resolved config, plan)."""
    from appliance import LLM

    llm = LLM(overrides=overrides)
    resolved, plan = llm.resolved, llm.deployment.plan  # what this machine runs
    ours = run_ours(llm, prompts, output_len, repeat)
    del llm  # free the KV pool before the next engine or the baseline loads
    gbps = ours["steps"] * plan.weight_bytes_per_device / ours["elapsed_s"] / 1e9
    flops = 2 * plan.parameter_count * (ours["output_tokens"] + sum(map(len, prompts))) / ours["elapsed_s"] / 1e9
    peak_flops = machine["peak_gflops"].get("bf16" if plan.dtype == "bfloat16" else "fp32", machine["peak_gflops"]["fp32"])
    ours.update({"weight_GBps": gbps, "bandwidth_fraction": gbps / machine["peak_bandwidth_GBps"],
                 "gflops": flops, "gemm_peak_fraction": flops / peak_flops})
    return ours, resolved, plan


def hf_cache_size(prompts: list[list[int]], output_len: int) -> dict:
    """HF continuous batching's cache sized for the workload: every request
    resident at once and every prompt in one batch. Left to itself on a CPU it
    sizes the cache from the host's memory and fills all of it first (28 s and
    gigabytes for a tiny model). Nothing where the version has no such config."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        return {}
    page = ContinuousBatchingConfig().page_size
    blocks = sum(-(-(len(p) + output_len) // page) for p in prompts)
    return {"continuous_batching_config": ContinuousBatchingConfig(
        num_blocks=blocks + 1, max_batch_tokens=max(page, sum(map(len, prompts))))}


def run_hf(folder: str, prompts: list[list[int]], output_len: int, dtype: str, batch_size: int,
           repeat: int = 1) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    res: dict = {}
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        n_out = 0
        with torch.inference_mode():
            for i in range(0, len(prompts), batch_size):
                chunk = prompts[i : i + batch_size]
                width = max(map(len, chunk))
                ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
                out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                                     do_sample=False, pad_token_id=pad)
                n_out += (out.shape[1] - width) * len(chunk)
        runs.append(time.perf_counter() - t)
    elapsed = sorted(runs)[len(runs) // 2]
    res["static"] = {"elapsed_s": elapsed, "runs_elapsed_s": runs, "output_tokens": n_out,
                     "output_tok_s": n_out / elapsed, "batch_size": batch_size}
    if hasattr(model, "generate_batch"):
        try:
            from transformers import GenerationConfig

            gc = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                  eos_token_id=None, pad_token_id=pad)
            t = time.perf_counter()
            outs = model.generate_batch(inputs=prompts, generation_config=gc, progress_bar=False,
                                        **hf_cache_size(prompts, output_len))
            elapsed = time.perf_counter() - t
            n = sum(len(o.generated_tokens) for o in outs.values())
            res["continuous"] = {"elapsed_s": elapsed, "output_tokens": n, "output_tok_s": n / elapsed}
        except Exception as e:  # an API that moved between versions
            res["continuous"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    return res


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench throughput")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-len-range", default=None, help="lo,hi: uniform prompt lengths instead of --input-len")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt shares")
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument("--hf-batch-size", type=int, default=0, help="static batch size of the HF baseline (default: all)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of ours and of HF static batching; the median run is reported (all are recorded)")
    p.add_argument("--also", action="append", default=[], metavar="OVERRIDES",
                   help="run our engine again with these extra overrides (space-separated), e.g. quantization=int8_wo")
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    from appliance.config.compose import resolve
    from appliance.models.loader import resolve_model_folder

    machine = load_or_measure(a.out)
    cfg = resolve(overrides).cfg
    lens = lengths_for(a.num_prompts, a.input_len, a.input_len_range)
    prompts = random_prompts(a.num_prompts, lens, cfg.model.vocab_size, shared_prefix=a.shared_prefix)
    ours, resolved, plan = measure(overrides, prompts, a.output_len, machine, a.repeat)
    gbps, flops = ours["weight_GBps"], ours["gflops"]
    result = {"config_hash": resolved.hash, "profile": cfg.profile, "model": cfg.model.name, "dtype": plan.dtype,
              "num_prompts": a.num_prompts, "input_lens": lens, "output_len": a.output_len,
              "shared_prefix": a.shared_prefix, "appliance": ours, "machine": machine, "also": {}}
    bars = {"appliance": ours["output_tok_s"]}
    for extra in a.also:
        res, r2, _ = measure(overrides + extra.split(), prompts, a.output_len, machine, a.repeat)
        res["config_hash"] = r2.hash
        result["also"][extra] = res
        bars[f"appliance {extra}"] = res["output_tok_s"]
    if a.baseline == "hf":
        hf = run_hf(str(resolve_model_folder(cfg.model)), prompts, a.output_len, plan.dtype,
                    a.hf_batch_size or a.num_prompts, a.repeat)
        result["hf"] = hf
        result["ratio_vs_hf_static"] = ours["output_tok_s"] / hf["static"]["output_tok_s"]
        bars["hf static"] = hf["static"]["output_tok_s"]
        if "output_tok_s" in hf.get("continuous", {}):
            result["ratio_vs_hf_continuous"] = ours["output_tok_s"] / hf["continuous"]["output_tok_s"]
            bars["hf continuous"] = hf["continuous"]["output_tok_s"]
        for res in result["also"].values():
            res["ratio_vs_hf_static"] = res["output_tok_s"] / hf["static"]["output_tok_s"]
            if "output_tok_s" in hf.get("continuous", {}):
                res["ratio_vs_hf_continuous"] = res["output_tok_s"] / hf["continuous"]["output_tok_s"]
    path = write_results(a.out, "throughput", result)
    png = plot_bars(a.out, "throughput", f"Output tok/s, {a.num_prompts} prompts x {a.output_len} tokens", bars, "tok/s")
    print(f"appliance: {ours['output_tok_s']:.1f} output tok/s, {ours['total_tok_s']:.1f} total tok/s, "
          f"{ours['requests_s']:.2f} req/s")
    print(f"  weights streamed at {gbps:.1f} GB/s = {100 * ours['bandwidth_fraction']:.0f}% of "
          f"{machine['peak_bandwidth_GBps']:.1f} GB/s; {flops:.1f} GFLOP/s = {100 * ours['gemm_peak_fraction']:.0f}% of GEMM peak")
    for extra, res in result["also"].items():
        vs = f" (x{res['ratio_vs_hf_static']:.2f} HF static)" if "ratio_vs_hf_static" in res else ""
        print(f"appliance {extra}: {res['output_tok_s']:.1f} output tok/s{vs}")
    if "hf" in result:
        print(f"hf static batching: {result['hf']['static']['output_tok_s']:.1f} tok/s "
              f"(appliance x{result['ratio_vs_hf_static']:.2f})")
        cb = result["hf"].get("continuous", {})
        print("hf continuous batching: " + (f"{cb['output_tok_s']:.1f} tok/s (appliance x{result['ratio_vs_hf_continuous']:.2f})"
                                             if "output_tok_s" in cb else cb.get("error", "not available")))
    print(f"wrote {path} and {png}")
    return 0
