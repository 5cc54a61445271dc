"""Write docs/benchmarks.md (and copy the plots) from a full run of
scripts/run_benchmarks.sh in bench-results/full."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INT8 = "quantization=int8_wo cache.kv_cache_dtype=bfloat16"  # the cpu_int8 profile, as --also overrides
PHASES = ("norm", "qkv", "rope_kv_write", "attention", "o_proj", "gate_up", "silu_mul", "down", "lm_head")
SRC = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench-results" / "full"
DOCS = ROOT / "docs"
PLOTS = DOCS / "benchmarks"


def load(rel: str) -> dict:
    return json.loads((SRC / rel).read_text())


def main() -> None:
    PLOTS.mkdir(parents=True, exist_ok=True)
    m = load("machine.json")
    host = m.get("host") or m["machine"]  # results written before hosts were recorded under "host"
    lines = [
        "# Benchmarks",
        "",
        "A full run of `scripts/run_benchmarks.sh` on one machine of the kind CI uses; the tables below are",
        "written from its JSON by `scripts/bench_report.py`. Every figure comes with its baseline from the",
        "same run. The exact commands (`scripts/run_benchmarks.sh`):",
        "",
        "```bash",
        *[ln for ln in (ROOT / "scripts" / "run_benchmarks.sh").read_text().splitlines() if not ln.startswith("#")],
        "```",
        "",
        "## Machine (`appliance bench machine`)",
        "",
        f"- {host['platform']}, {host['cpus']} CPUs, {m['threads']} torch threads, run {host['time']}",
        f"- CPU: {host.get('cpu') or 'unknown'}; {' '.join(host.get('cpu_isa', [])) or 'no AVX2'}",
        f"- memory bandwidth: copy {m['bandwidth']['copy_GBps']:.1f} GB/s, read {m['bandwidth']['read_GBps']:.1f} GB/s",
    ]
    for shape, g in m["gemm_gflops"].items():
        lines.append(f"- GEMM {shape}: " + ", ".join(f"{d} {v:.1f} GFLOP/s" for d, v in g.items()))
    lines += [
        "",
        "This CPU has native bf16 (AVX512-BF16/AMX): torch's bf16 matmuls are fast here; what `model.dtype=auto`"
        " picks is measured in \"dtype and backend per CPU class\" below."
        if host.get("cpu_fast_bf16") else
        "This CPU has no native bf16: torch's bf16 matmuls run about 100x slower than fp32 here; what"
        " `model.dtype=auto` picks is measured in \"dtype and backend per CPU class\" below.",
        "",
        "## Offline throughput (`appliance bench throughput --baseline hf --also ...`)",
        "",
        "SmolLM2-135M-Instruct, 100-token prompts, 128 output tokens, `ignore_eos`. `cpu` is the cpu profile",
        "(fp32 weights and KV, native kernels); `cpu_int8` is the same engine with `quantization=int8_wo",
        "cache.kv_cache_dtype=bfloat16` (the cpu_int8 profile). Hugging Face transformers runs the same fp32 weights and prompts in the same",
        "process: static batching (`generate()`, all prompts in one batch) and continuous batching",
        "(`generate_batch`). Ours and HF static: the median of 3 runs (`--repeat 3`; every run is in the JSON).",
        "",
        "| requests | cpu out tok/s | cpu_int8 out tok/s | HF static | HF continuous | cpu x HF static | cpu_int8 x HF static | cpu_int8 x HF continuous | cpu_int8 weights GB/s (% of machine) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in (1, 8, 32):
        t = load(f"throughput-{n}/throughput.json")
        a, h, q = t["appliance"], t["hf"], t["also"][INT8]
        cb = h.get("continuous", {}).get("output_tok_s")
        cb_cell = f"{cb:.1f}" if cb else "n/a"
        q_cb = f"{q['ratio_vs_hf_continuous']:.2f}" if "ratio_vs_hf_continuous" in q else "n/a"
        lines.append(f"| {n} | {a['output_tok_s']:.1f} | {q['output_tok_s']:.1f} | {h['static']['output_tok_s']:.1f} | "
                     f"{cb_cell} | {t['ratio_vs_hf_static']:.2f} | {q['ratio_vs_hf_static']:.2f} | {q_cb} | "
                     f"{q['weight_GBps']:.1f} ({100 * q['bandwidth_fraction']:.0f}%) |")
        shutil.copy(SRC / f"throughput-{n}/throughput.png", PLOTS / f"throughput-{n}.png")
    lines += ["", "![throughput at 32 requests](benchmarks/throughput-32.png)", "",
              "Where the native forward's time goes (seconds per phase, mean per run, from",
              "`native_phases_s` in the JSON):", "",
              "| run | " + " | ".join(PHASES) + " | total native | wall |",
              "|---|" + "---|" * (len(PHASES) + 2)]
    for n in (1, 32):
        t = load(f"throughput-{n}/throughput.json")
        for label, r in (("cpu", t["appliance"]), ("cpu_int8", t["also"][INT8])):
            ph = r.get("native_phases_s")
            if ph:
                lines.append(f"| {label}, {n} requests | " + " | ".join(f"{ph[k]:.2f}" for k in PHASES)
                             + f" | {sum(ph.values()):.2f} | {r['elapsed_s']:.2f} |")
    lines += ["", "## Online serving (`appliance bench serve`)", "",
              "Streaming `/v1/completions` against `appliance run` started by the bench on a loopback port; same",
              "prompt and output lengths. Latencies in ms.", "",
              "| profile | concurrency | requests | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | ITL p99 | E2E p50 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for prof in ("cpu", "cpu_int8"):
        for rel in (f"serve-{prof}-c1/serve.json", f"serve-{prof}-c8-32/serve.json"):
            sv = load(rel)
            for lv in sv["levels"]:
                lines.append(f"| {prof} | {lv['max_concurrency']} | {lv['completed']} | {lv['output_tok_s']:.1f} | "
                             f"{lv['ttft_ms']['p50']:.0f} | {lv['ttft_ms']['p99']:.0f} | {lv['tpot_ms']['p50']:.1f} | "
                             f"{lv['itl_ms']['p99']:.1f} | {lv['e2e_ms']['p50']:.0f} |")
    shutil.copy(SRC / "serve-cpu_int8-c8-32/serve.png", PLOTS / "serve.png")
    lines += ["", "## Latency (`appliance bench latency`)", "",
              "| profile | prefill tokens | ms | tok/s |", "|---|---|---|---|"]
    for prof in ("cpu", "cpu_int8"):
        lat = load(f"latency-{prof}/latency.json")
        lines += [f"| {prof} | {p['input_len']} | {p['ms']:.1f} | {p['tok_s']:.0f} |" for p in lat["prefill"]]
    lines += ["", "| profile | decode batch | ms/step | tok/s | weights GB/s (% of machine) |", "|---|---|---|---|---|"]
    for prof in ("cpu", "cpu_int8"):
        lat = load(f"latency-{prof}/latency.json")
        lines += [f"| {prof} | {d['batch_size']} | {d['ms_per_step']:.1f} | {d['tok_s']:.1f} | {d['weight_GBps']:.1f} "
                  f"({100 * d['bandwidth_fraction']:.0f}%) |" for d in lat["decode"]]
    shutil.copy(SRC / "latency-cpu_int8/latency.png", PLOTS / "latency.png")
    px = load("prefix.json")
    sm = px["summary"]
    lines += ["", "## Prefix caching (`appliance bench prefix`)", "",
              f"{px['num_prompts']} requests sharing a {px['prefix_len']}-token prefix plus {px['suffix_len']} own tokens:",
              "",
              f"- hit rate {sm['hit_rate']:.3f} against the block-aligned ideal {sm['ideal_hit_rate']:.3f} "
              f"({100 * sm['hit_rate_vs_ideal']:.0f}%)",
              f"- time to first token of requests 2..N: {px['on']['ttft_rest_mean_ms']:.0f} ms with caching, "
              f"{px['off']['ttft_rest_mean_ms']:.0f} ms without (x{sm['ttft_speedup']:.2f})",
              f"- cost at 0% hits: {px['on']['zero_hit_output_tok_s']:.1f} tok/s with caching on vs "
              f"{px['off']['zero_hit_output_tok_s']:.1f} off (ratio {sm['zero_hit_throughput_ratio']:.3f})"]
    shutil.copy(SRC / "prefix.png", PLOTS / "prefix.png")
    sc = load("scheduler.json")
    lines += ["", "## Engine core alone (`appliance bench scheduler`)", "",
              "Null model runner; µs per `schedule()` + `update_from_output()` during decode.", "",
              "| running | shared prefix | prefix hit rate | µs/step | µs/token |", "|---|---|---|---|---|"]
    lines += [f"| {p['num_running']} | {p['shared_prefix']} | {p['prefix_hit_rate']:.2f} | {p['decode_us_per_step']:.0f} "
              f"| {p['decode_us_per_token']:.1f} |" for p in sc["points"]]
    lines += ["", f"KV waste ratio for 1024 mixed-length requests (block 16): {sc['kv_waste']['kv_waste_ratio']:.4f}", ""]
    shutil.copy(SRC / "scheduler.png", PLOTS / "scheduler.png")
    notes = (DOCS / "benchmarks-notes.md")
    if notes.exists():
        lines += [notes.read_text()]
    (DOCS / "benchmarks.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {DOCS / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
