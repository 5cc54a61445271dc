"""`appliance bench machine`: this machine's roofline.

Memory bandwidth (a large copy, counting bytes read + written, and a large
read) and GEMM GFLOP/s per dtype (int8: torch's int8 products, tera-ops
counted as FLOPs), square and at the model's decode and prefill shapes. Every other bench reports its figures as fractions of
these (read from ``<out>/machine.json`` when present, else measured).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from appliance.bench.common import plot_bars, write_results


def _best(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bandwidth(mib: int = 512, repeat: int = 5) -> dict:
    n = mib * 1024 * 1024 // 4
    a = torch.ones(n, dtype=torch.float32)
    b = torch.empty_like(a)
    t_copy = _best(lambda: b.copy_(a), repeat)
    t_read = _best(lambda: a.sum(), repeat)
    nbytes = a.numel() * 4
    return {"copy_GBps": 2 * nbytes / t_copy / 1e9, "read_GBps": nbytes / t_read / 1e9, "bytes": nbytes}


def gemm(m: int, n: int, k: int, dtype: torch.dtype, repeat: int = 5) -> float:
    """GFLOP/s of torch's [m, k] x [k, n] product (int8: torch._int_mm's int32 sums, tera-ops as FLOPs)."""
    if dtype == torch.int8:
        a, b = torch.randint(-127, 128, (m, k), dtype=torch.int8), torch.randint(-127, 128, (k, n), dtype=torch.int8)
        t = _best(lambda: torch._int_mm(a, b), repeat)
    else:
        a = torch.randn(m, k).to(dtype)
        b = torch.randn(k, n).to(dtype)
        t = _best(lambda: torch.mm(a, b), repeat)
    return 2 * m * n * k / t / 1e9


def run(size: int = 2048, mib: int = 512, repeat: int = 5, hidden: int = 576, inter: int = 1536) -> dict:
    shapes = {f"square_{size}": (size, size, size), "decode_mlp": (1, inter, hidden), "batch32_mlp": (32, inter, hidden),
              "prefill_mlp": (512, inter, hidden)}
    from appliance.config.detect import cpu_has_fast_bf16

    dtypes = {"fp32": torch.float32}
    if torch.cuda.is_available() or cpu_has_fast_bf16():
        dtypes["bf16"] = torch.bfloat16  # emulated bf16 on other CPUs is 100x slower: not a peak worth timing
    dtypes["int8"] = torch.int8  # the int8 rows of 4- and 8-bit weights and W8A8 (VNNI, AMX-INT8 where present)
    gemms = {}
    for name, (m, n, k) in tqdm(shapes.items(), desc="bench machine: GEMM"):
        gemms[name] = {d: gemm(m, n, k, dt, repeat) for d, dt in dtypes.items()}
    bw = bandwidth(mib, repeat)
    return {"threads": torch.get_num_threads(), "kernel_variants": kernel_variants(), "bandwidth": bw,
            "gemm_gflops": gemms,
            "peak_bandwidth_GBps": max(bw["copy_GBps"], bw["read_GBps"]),
            "peak_gflops": {d: max(g[d] for g in gemms.values()) for d in dtypes}}


def kernel_variants() -> dict[str, str]:
    """Which native CPU kernel variant this CPU gets for each job (chosen at
    run time from CPUID), or why the native kernels are not available."""
    try:
        from appliance.kernels import cpu_native
    except Exception as e:  # no compiler, no AVX2: torch_sdpa serves instead
        return {"cpu_native": f"unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"}
    return {"cpu_native": "available",
            "fp32/int8/bf16 GEMV and small GEMMs": "avx2+fma",
            "bf16 GEMMs": "avx512f (fp32 FMAs, the weights widened in registers, the rows fp32)"
            if cpu_native.fma_rows() and cpu_native.avx512() else "avx512_bf16 (vdpbf16ps)" if cpu_native.bf16_dot()
            else "avx2+fma (widened to fp32)",
            "int4 GEMMs over 6 rows": "avx512_bf16 (vdpbf16ps)" if cpu_native.bf16_dot()
            else "avx2+fma (widened to fp32)",
            "int4 GEMV and GEMMs of 2-6 rows": "avx512f (16 channels a register, up to 4 rows a pass)"
            if cpu_native.avx512() else "avx2+fma (GEMV; 2-6 rows widened to fp32)",
            "W8A8 int8 GEMV and GEMMs (quantization=w8a8_int8)": "avx512_vnni (vpdpbusd, 6 rows by 64 channels)"
            if cpu_native.vnni() else "avx2 (vpmaddwd, 4 rows by 16 channels)",
            "int4 and int8 weights' GEMMs over 6 rows": "avx512_vnni (the rows in int8 per group, vpdpbusd, 6 rows "
            "by 32 channels)" if cpu_native.int8_rows() else "float rows, as bf16 weights' above",
            "prefill attention tiles over a bf16 or fp8 cache": "amx (tdpbf16ps, head sizes a multiple of 32)"
            if cpu_native.bf16_attention() and cpu_native.amx() else "avx512_bf16 (vdpbf16ps)"
            if cpu_native.bf16_attention() else "as below",
            "prefill attention tiles": "avx512f (16 keys a register)" if cpu_native.avx512() else "avx2+fma",
            "decode attention": "avx512f (16 lanes, head sizes a multiple of 32; the context's rows prefetched "
            "into L2)" if cpu_native.avx512() else "avx2+fma (the context's rows prefetched into L2)",
            "GEMMs on AMX tiles": f"amx (tdpbf16ps: bf16 and int8 weights from {cpu_native.amx_min_rows()} rows, "
            f"int4 from {cpu_native.amx_min_rows(grouped=True)}; tdpbssd: W8A8 from "
            f"{cpu_native.amx_min_rows(int8=True)}; 32 rows by 32 channels)"
            if cpu_native.amx() else "as above (no AMX tiles on this CPU)"}


def load_or_measure(out_dir: str) -> dict:
    """The machine roofline from a previous `bench machine` in ``out_dir``, or a quick measurement."""
    import json

    path = Path(out_dir) / "machine.json"
    if path.exists():
        return json.loads(path.read_text())
    return run(size=1024, mib=256, repeat=3)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench machine")
    p.add_argument("--size", type=int, default=2048, help="square GEMM size")
    p.add_argument("--mib", type=int, default=512, help="bandwidth buffer size")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default="bench-results")
    a = p.parse_args(argv)
    res = run(a.size, a.mib, a.repeat)
    path = write_results(a.out, "machine", res)
    png = plot_bars(a.out, "machine", "GEMM GFLOP/s by shape and dtype",
                    {f"{s} {d}": v for s, g in res["gemm_gflops"].items() for d, v in g.items()}, "GFLOP/s")
    bw = res["bandwidth"]
    print(f"memory bandwidth: copy {bw['copy_GBps']:.1f} GB/s, read {bw['read_GBps']:.1f} GB/s ({res['threads']} threads)")
    for s, g in res["gemm_gflops"].items():
        print(f"GEMM {s:>14}: " + ", ".join(f"{d} {v:.1f} GFLOP/s" for d, v in g.items()))
    for job, variant in res["kernel_variants"].items():
        print(f"native kernels, {job}: {variant}")
    print(f"wrote {path} and {png}")
    return 0
