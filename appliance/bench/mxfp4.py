"""`appliance bench mxfp4`: gpt-oss's expert GEMMs with the weights kept as
MXFP4 against the same weights dequantized.

For each expert projection (gate|up: hidden -> 2 x intermediate, down:
intermediate -> hidden; gpt-oss-20b's and -120b's 2880 and 2880 unless
``--hidden`` / ``--inter`` say) and each row count (the tokens routed to one
expert in a step), the native MXFP4 GEMM (``kernels/cpu_mxfp4.py``: 4.25
bits a weight, decoded in registers) and the weights widened to bf16 per
call for torch's bf16 GEMM (what many bf16 rows run) go against torch's
``F.linear`` over the dequantized weights in bf16 and in fp32 (what a
dequantize-at-load deployment runs), the paths interleaved. Random codes and scales; each path
cycles through enough copies of its weights to hold more bytes than
``--mib``, so they come from memory. Reported: milliseconds a call, GFLOP/s,
weight bytes a second, and the fraction of the machine's roofline (``bench
machine``: peak fp32 GFLOP/s and memory bandwidth).

    appliance bench mxfp4 --rows 1,4,8,32
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from appliance.bench.common import plot_lines, write_results

# bytes a weight: kept MXFP4 through the native GEMM, or widened to bf16 natively per call then torch's bf16 GEMM
# (what bf16 rows past models.mxfp4.WIDEN_ROWS run); the dequantized weights through torch
PATHS = {"mxfp4 native": 17 / 32, "mxfp4 widened bf16": 17 / 32, "bf16 torch": 2.0, "fp32 torch": 4.0}


def _weights(k: int, n: int, copies: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    from appliance.models.mxfp4 import dequantize_mxfp4

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(copies):
        blocks = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 132, (n, k // 32), dtype=torch.uint8, generator=g)
        out.append((blocks, scales, dequantize_mxfp4(blocks, scales)))
    return out


def time_projection(k: int, n: int, rows: int, mib: int, repeat: int) -> dict[str, float]:
    """Best seconds a call per path, each cycling through its own copies of the weights."""
    from appliance.kernels.cpu_mxfp4 import mxfp4_linear, mxfp4_to_bf16

    x = torch.randn(rows, k)
    xb = x.bfloat16()
    calls = {}
    for path, nbytes in PATHS.items():
        copies = max(2, -(-mib * 2**20 // int(k * n * nbytes)))
        ws = _weights(k, n, copies, k + n)
        if path.startswith("mxfp4"):
            held = [(b, s) for b, s, _ in ws]
            calls[path] = (lambda i, held=held: mxfp4_linear(x, *held[i]), copies) if path == "mxfp4 native" else \
                (lambda i, held=held: F.linear(xb, mxfp4_to_bf16(*held[i])), copies)
        elif path == "bf16 torch":
            held_b = [w.bfloat16() for _, _, w in ws]
            calls[path] = (lambda i, held_b=held_b: F.linear(xb, held_b[i]), copies)
        else:
            held_f = [w for _, _, w in ws]
            calls[path] = (lambda i, held_f=held_f: F.linear(x, held_f[i]), copies)
    best: dict[str, float] = {}
    for _ in range(repeat):  # the paths interleaved, so all see the same machine
        for path, (call, copies) in calls.items():
            call(0)
            t = time.perf_counter()
            for i in range(copies):
                call(i)
            best[path] = min(best.get(path, float("inf")), (time.perf_counter() - t) / copies)
    return best


def run(hidden: int, inter: int, rows: list[int], mib: int, repeat: int, machine: dict) -> dict:
    peak, bandwidth = machine["peak_gflops"]["fp32"], machine["peak_bandwidth_GBps"]
    results = []
    for name, (k, n) in {"gate_up": (hidden, 2 * inter), "down": (inter, hidden)}.items():
        for m in rows:
            best = time_projection(k, n, m, mib, repeat)
            for path, seconds in best.items():
                gflops, weight_gbps = 2 * m * k * n / seconds / 1e9, k * n * PATHS[path] / seconds / 1e9
                results.append({"projection": name, "k": k, "n": n, "rows": m, "path": path, "ms": seconds * 1e3,
                                "gflops": gflops, "weight_GBps": weight_gbps, "share_of_peak_gflops": gflops / peak,
                                "share_of_bandwidth": weight_gbps / bandwidth,
                                "speedup_over_bf16": best["bf16 torch"] / seconds,
                                "speedup_over_fp32": best["fp32 torch"] / seconds})
    return {"hidden": hidden, "inter": inter, "rows": rows, "mib": mib, "machine_peak_gflops_fp32": peak,
            "machine_bandwidth_GBps": bandwidth, "results": results}


def main(argv: list[str]) -> int:
    from appliance.bench.machine import kernel_variants, load_or_measure

    p = argparse.ArgumentParser(prog="appliance bench mxfp4")
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--inter", type=int, default=2880, help="an expert's intermediate channels")
    p.add_argument("--rows", default="1,4,8,32", help="tokens routed to one expert in a step")
    p.add_argument("--mib", type=int, default=256, help="weight bytes each path cycles through")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default="bench-results")
    a = p.parse_args(argv)
    if a.hidden % 32 or a.inter % 32:
        p.error("MXFP4 groups are 32 inputs: --hidden and --inter must be multiples of 32")
    res = run(a.hidden, a.inter, [int(r) for r in a.rows.split(",")], a.mib, a.repeat, load_or_measure(a.out))
    res["kernel_variants"] = kernel_variants()
    path = write_results(a.out, "mxfp4", res)
    series: dict[str, tuple[list, list]] = {}
    for r in res["results"]:
        xs, ys = series.setdefault(f"{r['projection']} ({r['path']})", ([], []))
        xs.append(r["rows"])
        ys.append(r["ms"])
    png = plot_lines(a.out, "mxfp4", "gpt-oss expert GEMMs: ms a call by rows (MXFP4 kept vs dequantized)", "rows",
                     "ms", series, logx=True)
    for r in res["results"]:
        print(f"{r['projection']:>8} k={r['k']:<5} n={r['n']:<5} rows={r['rows']:<3} {r['path']:>12}: "
              f"{r['ms']:7.3f} ms {r['gflops']:6.1f} GFLOP/s ({100 * r['share_of_peak_gflops']:3.0f}% of fp32 peak) "
              f"{r['weight_GBps']:5.1f} GB/s of weights ({100 * r['share_of_bandwidth']:3.0f}%)  "
              f"{r['speedup_over_bf16']:.2f}x bf16, {r['speedup_over_fp32']:.2f}x fp32")
    print(f"wrote {path} and {png}")
    return 0
