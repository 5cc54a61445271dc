"""`appliance bench gemm`: the native CPU kernels' GEMMs at a model's projection shapes.

For each projection of the configured model (qkv, o, gate|up, down) and each
row count (decode batches, prefill chunks), the native linear in the model's
weight dtype runs with the path the kernels pick on this CPU and, as the
same-run baseline, with AVX2 FMAs over weights widened to fp32 (the path of
AVX2-only CPUs: ``cpu_native.bf16_dot(False)`` and ``fma_rows(False)``). With
``quantization=int4_wo`` or ``int8_wo`` the weights are those formats (random,
quantized at the bench's start) and the baseline keeps the rows floating point
(``cpu_native.int8_rows(False)``: vdpbf16ps, or fp32 FMAs); each path's weights
are packed under its own switches (int8 ones as the int8 rows' k quads for the
default, ``cpu_native.int8_quads``). With ``--torch``
(float weights) torch's own ``F.linear`` runs the same weights too, its rows and
output in the weights' dtype (oneDNN where torch has it: AMX tiles on CPUs with
AMX), and each default row says its speed against it. A layer's weights
come from memory, not a cache: each projection is cycled through enough copies
to hold more bytes than ``--mib``. Reported: milliseconds a call, GFLOP/s,
weight bytes a second, and the fraction of the machine's roofline (peak int8,
bf16 or fp32 GEMM GFLOP/s and memory bandwidth, from ``bench machine``): each
row against the peak of what ran it (``peak_gflops_dtype``: bf16 where AMX
tiles take the rows, from ``cpu_native.amx_min_rows()``).

    appliance bench gemm model=tiny_random model.hidden_size=2048 model.intermediate_size=8192 \\
        model.num_heads=32 model.num_kv_heads=8 model.head_dim=64 model.dtype=bfloat16 --rows 1,8,32,256
"""

from __future__ import annotations

import argparse
import time

import torch

from appliance.bench.common import plot_lines, split_overrides, write_results
from appliance.config.quantization import QUANTIZATION_METHODS
from appliance.errors import ConfigError


def projections(cfg) -> dict[str, tuple[int, int]]:
    """(in features, out features) of each projection of one layer, as the native forward runs them."""
    m = cfg.model
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return {"qkv": (m.hidden_size, q + 2 * kv), "o": (q, m.hidden_size),
            "gate_up": (m.hidden_size, 2 * m.intermediate_size), "down": (m.intermediate_size, m.hidden_size)}


GROUP = 32  # the 4-bit weights' group
# Bytes a weight of each weight-only CPU format holds in memory (its bits, and its group's scale and min: int4's
# fp16 pair per group of 32 inputs; int8's scale per output channel, a rounding error).
WEIGHT_BYTES = {q.name: q.bits[0] / 8 + q.group_param_bits / (8 * GROUP) for q in QUANTIZATION_METHODS.values()
                if q.cpu_at_load and not q.activation_dtype}


def make_module(k: int, n: int, dtype: torch.dtype, method: str) -> torch.nn.Module:
    """A random [n, k] projection in the bench's weight format."""
    from appliance.models.quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear

    if method not in WEIGHT_BYTES:
        return torch.nn.Linear(k, n, bias=False).to(dtype)
    if QUANTIZATION_METHODS[method].bits[0] == 8:
        return Int8WeightOnlyLinear(torch.randn(n, k), None)
    return Int4WeightOnlyLinear(torch.randn(n, k), None, GROUP)


def time_linear(k: int, n: int, rows: int, dtype: torch.dtype, mib: int, repeat: int, paths: list,
                method: str = "none") -> dict:
    """Best seconds a call of a [rows, k] x [k, n] product, per path in ``paths``: the int8_rows setting for
    4- and 8-bit weights (``method``); for float weights, on: the paths this CPU picks, off: the widened
    AVX2 one (bf16_dot and fma_rows off), "torch": torch's F.linear on rows in the weights' dtype."""
    from appliance.kernels.cpu_native import NativeLinear, bf16_dot, fma_rows, int8_rows

    switches = [int8_rows] if method in WEIGHT_BYTES else [bf16_dot, fma_rows]
    before = [switch() for switch in switches]
    nbytes = WEIGHT_BYTES.get(method, dtype.itemsize)
    copies = max(2, -(-mib * 2**20 // int(k * n * nbytes)))
    modules = [make_module(k, n, dtype, method) for _ in range(copies)]
    x, out = torch.randn(rows, k), torch.empty(rows, n)
    xt = x.to(dtype)

    def switched(on) -> None:
        for switch, default in zip(switches, before):
            switch(on is True and default)

    def packed(on) -> list:  # packed under the path's switches: int8 weights take the int8 rows' quads for them
        switched(on)
        return [NativeLinear(mod) for mod in modules]

    def torch_linear(i):
        torch.nn.functional.linear(xt, modules[i].weight)

    def native(on):
        return lambda i: linears[on][i](x, out)

    best: dict = {}
    try:
        linears = {on: packed(on) for on in paths if on != "torch"}
        for _ in range(repeat):  # the paths interleaved, so all see the same machine
            for on in paths:
                switched(on)
                call = torch_linear if on == "torch" else native(on)
                call(0)
                t = time.perf_counter()
                for i in range(copies):
                    call(i)
                best[on] = min(best.get(on, float("inf")), (time.perf_counter() - t) / copies)
    finally:
        for switch, default in zip(switches, before):
            switch(default)
    return best


def run(cfg, rows: list[int], mib: int, repeat: int, machine: dict, against_torch: bool = False) -> dict:
    from appliance.kernels.cpu_native import amx, amx_min_rows, avx512, bf16_dot, fma_rows, int8_rows

    method = cfg.quantization.method
    if method not in ("none", *WEIGHT_BYTES):
        raise ConfigError(f"bench gemm times float, int8_wo and int4_wo weights, not quantization={method}")
    if against_torch and method != "none":
        raise ConfigError(f"bench gemm --torch times float weights (torch has no GEMM of quantization={method})")
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" and method == "none" else torch.float32
    quantized = method in WEIGHT_BYTES
    peaks = machine["peak_gflops"]
    fma = dtype == torch.bfloat16 and fma_rows() and avx512()  # bf16 weights in fp32 FMAs, ahead of vdpbf16ps
    peak_name = "int8" if quantized and int8_rows() and "int8" in peaks else \
        "bf16" if (dtype == torch.bfloat16 or quantized) and "bf16" in peaks and bf16_dot() and not fma else "fp32"
    peak, bandwidth = peaks[peak_name], machine["peak_bandwidth_GBps"]  # below the AMX tiles' row count
    off = "int8_rows off" if quantized else "widened (AVX2)"
    paths: list = [True, False] if (int8_rows() if quantized else dtype == torch.bfloat16 and (bf16_dot() or fma)) \
        else [False]
    if against_torch:
        paths.append("torch")
    nbytes = WEIGHT_BYTES.get(method, dtype.itemsize)
    tiles_from = amx_min_rows(grouped=QUANTIZATION_METHODS[method].scales == "group")

    def peak_of(on, m: int) -> str:
        """The peak a path's row runs against: torch's in its dtype; AMX tiles' (bf16) from their row count
        where vdpbf16ps is on (the widened baseline turns it off), else the path below the tiles'."""
        if on == "torch":
            return "bf16" if dtype == torch.bfloat16 and "bf16" in peaks else "fp32"
        tiles = amx() and bf16_dot() and (on is True or quantized) and (quantized or dtype == torch.bfloat16)
        return "bf16" if tiles and m >= tiles_from and "bf16" in peaks else peak_name

    results = []
    for name, (k, n) in projections(cfg).items():
        for m in rows:
            best = time_linear(k, n, m, dtype, mib, repeat, paths, method)
            mine = True in best  # the default path: the one this CPU picks, or the only native one
            for on, seconds in best.items():
                gflops = 2 * m * k * n / seconds / 1e9
                weight_gbps = k * n * nbytes / seconds / 1e9
                ran_on = peak_of(on, m)
                results.append({"projection": name, "k": k, "n": n, "rows": m,
                                "path": "torch F.linear" if on == "torch" else "default" if on is mine else off,
                                "ms": seconds * 1e3, "gflops": gflops, "weight_GBps": weight_gbps,
                                "peak_gflops_dtype": ran_on, "share_of_peak_gflops": gflops / peaks[ran_on],
                                "share_of_bandwidth": weight_gbps / bandwidth})
                if on is mine and mine is True:
                    results[-1]["speedup_over_baseline"] = best[False] / best[True]
                if on is mine and "torch" in best:
                    results[-1]["speedup_over_torch"] = best["torch"] / best[mine]
    return {"dtype": str(dtype).removeprefix("torch."), "weights": method if quantized else str(dtype).removeprefix(
        "torch."), "baseline": off, "rows": rows, "mib": mib, "machine_peak_gflops": peak,
            "machine_peak_gflops_dtype": peak_name, "machine_peaks_gflops": peaks, "machine_bandwidth_GBps": bandwidth,
            "results": results}


def main(argv: list[str]) -> int:
    from appliance.bench.machine import kernel_variants, load_or_measure
    from appliance.config.compose import resolve

    p = argparse.ArgumentParser(prog="appliance bench gemm")
    p.add_argument("--rows", default="1,8,16,32,64,256", help="row counts (decode batches, prefill chunks)")
    p.add_argument("--mib", type=int, default=512, help="weight bytes each projection cycles through")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--torch", action="store_true", help="also time torch's F.linear on the same float weights")
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    cfg = resolve(["+profile=cpu", *overrides]).cfg
    rows = [int(r) for r in a.rows.split(",")]
    res = run(cfg, rows, a.mib, a.repeat, load_or_measure(a.out), against_torch=a.torch)
    res["kernel_variants"] = kernel_variants()
    path = write_results(a.out, "gemm", res)
    series: dict[str, tuple[list, list]] = {}
    for r in res["results"]:
        xs, ys = series.setdefault(f"{r['projection']} ({r['path']})", ([], []))
        xs.append(r["rows"])
        ys.append(r["gflops"])
    png = plot_lines(a.out, "gemm", f"native {res['weights']} GEMMs: GFLOP/s by rows "
                     f"(machine peak {res['machine_peak_gflops']:.0f})", "rows", "GFLOP/s", series, logx=True)
    for r in res["results"]:
        extra = f"  {r['speedup_over_baseline']:.2f}x {res['baseline']}" if "speedup_over_baseline" in r else ""
        extra += f"  {r['speedup_over_torch']:.2f}x torch" if "speedup_over_torch" in r else ""
        print(f"{r['projection']:>8} k={r['k']:<6} n={r['n']:<6} rows={r['rows']:<4} {r['path']:>13}: "
              f"{r['ms']:8.3f} ms {r['gflops']:7.1f} GFLOP/s ({100 * r['share_of_peak_gflops']:3.0f}% of the "
              f"{r['peak_gflops_dtype']} peak) "
              f"{r['weight_GBps']:6.1f} GB/s of weights ({100 * r['share_of_bandwidth']:3.0f}%){extra}")
    print(f"wrote {path} and {png}")
    return 0
