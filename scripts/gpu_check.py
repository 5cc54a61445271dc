"""GPU check: every attention backend that imports against torch_sdpa on
realistic shapes, plus a short end-to-end generation on each, the fp8
W8A8 GEMM (torch._scaled_mm) against its reference path, the Triton
int4 and grouped int8 GEMMs and the Marlin int4 GEMM (sgl-kernel) against
the dequantized bf16 GEMM, and a
sparse layer's experts through the Triton fused MoE and FlashInfer's
fused MoE (where it runs) against the grouped torch path.

Writes gpu_check.json (and prints a summary) into $OUT (or ./gpu-results).
Needs only torch (+ triton, flashinfer, FA3 where installed); the end-to-end
part also needs the config stack (hydra-core, omegaconf) and is skipped
with a reason when it is missing.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from appliance.kernels.registry import BACKENDS, load_backend, probe_importable  # noqa: E402
from tests.kernel_helpers import make_problem  # noqa: E402

OUT = os.environ.get("OUT") or "gpu-results"
DEV = torch.device("cuda")


def to_dev(common):
    return type(common)(**{f: (getattr(common, f).to(DEV) if torch.is_tensor(getattr(common, f)) else getattr(common, f))
                           for f in common.__dataclass_fields__})


def time_ms(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_case(name: str, kv_dtype: str, dtype=torch.bfloat16) -> dict:
    from appliance.kernels.torch_sdpa import TorchSDPABackend

    # 64 sequences at 2k context: 48 decodes and 16 prefill chunks of 128 after a 1920-token prefix.
    specs = [(2047, 1)] * 48 + [(1920, 128)] * 16
    H, KVH, D, BS = 32, 4, 128, 16  # GQA 8
    common, q, k, v, cache = make_problem(specs, BS, H, KVH, D, dtype=torch.float32, seed=0)
    common = to_dev(common)
    q, k, v = (t.to(DEV, dtype) for t in (q, k, v))
    cache = cache.to(DEV, dtype)
    fp8 = kv_dtype != "auto"
    if fp8:
        cache = cache.to(torch.float8_e4m3fn)
        ref_cache = cache.to(dtype)
        k_ref, v_ref = k.to(torch.float8_e4m3fn).to(dtype), v.to(torch.float8_e4m3fn).to(dtype)
    else:
        ref_cache, k_ref, v_ref = cache.clone(), k, v
    ref = TorchSDPABackend(H, KVH, D, D ** -0.5)
    ref_out = ref.forward(q.float(), k_ref.float(), v_ref.float(), ref_cache.float(), ref.build_metadata(common))
    b = load_backend(name)(H, KVH, D, D ** -0.5, kv_dtype)
    md = b.build_metadata(common)
    out = b.forward(q, k, v, cache, md)
    torch.cuda.synchronize()
    err = (out.float() - ref_out).abs().max().item()
    ms = time_ms(lambda: b.forward(q, k, v, cache, b.build_metadata(common)))
    kv_bytes = sum(s for s, _ in specs) * 2 * KVH * D * cache.element_size()
    return {"backend": name, "kv_cache_dtype": kv_dtype, "max_abs_err": err, "ms": ms,
            "kv_read_GBps": kv_bytes / (ms * 1e-3) / 1e9, "ok": err < (0.1 if fp8 else 0.03)}


def e2e_case(name: str) -> dict:
    try:
        from appliance import LLM, SamplingParams
        from appliance.kernels.registry import Selection
    except ImportError as e:
        return {"backend": name, "skipped": f"config stack missing: {e}"}
    overrides = ["+profile=h200_fp8", "model=tiny_random", "quantization=none", "cache.kv_cache_dtype=auto",
                 "model.dtype=bfloat16", "model.hidden_size=256", "model.num_heads=4", "model.num_kv_heads=2",
                 "model.head_dim=64", "model.intermediate_size=512", "cache.num_blocks=512"]
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "What is the capital of France?"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    t0 = time.perf_counter()
    ref = LLM(overrides=overrides, selection=Selection(chosen="torch_sdpa")).generate(prompts, params, use_tqdm=False)
    got = LLM(overrides=overrides, selection=Selection(chosen=name)).generate(prompts, params, use_tqdm=False)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, got))
    # a random tiny model's logits are near ties: compare the steps before the first divergence, by log-probability
    agreed, worst = [], 0.0
    for a, b in zip(ref, got):
        steps = 0
        for ta, tb, la, lb in zip(a.outputs[0].token_ids, b.outputs[0].token_ids, a.outputs[0].logprobs,
                                  b.outputs[0].logprobs):
            if ta != tb:
                break
            worst = max(worst, abs(la.logprob - lb.logprob))
            steps += 1
        agreed.append(steps)
    return {"backend": name, "prompts": len(prompts), "identical_to_sdpa": same, "steps_agreed": agreed,
            "max_abs_logprob_diff_until_divergence": worst, "ok": worst < 0.1,
            "seconds": time.perf_counter() - t0}


def fp8_gemm_case(m: int, n: int = 4096, k: int = 4096) -> dict:
    """W8A8 through torch._scaled_mm (row-wise scales) against the reference
    path (the same fp8 weights and activations dequantized, one bf16 GEMM)."""
    from appliance.models.fp8 import Fp8Linear, quantize_per_channel_fp8

    g = torch.Generator(device="cuda").manual_seed(m)
    w = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    q, scale = quantize_per_channel_fp8(w)
    lin = Fp8Linear(q, scale, None, activations=True)
    got = lin(x)
    ref = lin.cpu()(x.cpu()).to("cuda")  # the reference path runs off the GPU
    lin.to("cuda")
    err = (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    return {"gemm": "fp8 W8A8", "m": m, "n": n, "k": k, "max_rel_err": err, "ok": err < 2e-2,
            "ms": time_ms(lambda: lin(x)), "bf16_ms": time_ms(lambda: x @ w.to(torch.bfloat16).t())}


def int4_gemm_case(m: int, n: int = 4096, k: int = 4096, group: int = 128) -> dict:
    """The Triton int4 GEMM against the dequantized bf16 GEMM."""
    from appliance.kernels.triton_int4 import int4_gemm, pack_int4_rows
    from appliance.models.quant import dequantize_int4, quantize_groups_int4

    g = torch.Generator().manual_seed(m)
    q, d, mn = quantize_groups_int4(torch.randn(n, k, generator=g) / k ** 0.5, group)
    w = dequantize_int4(q, d, mn).to("cuda", torch.bfloat16)
    rows, d, mn = pack_int4_rows(q).cuda(), d.cuda(), mn.cuda()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got, ref = int4_gemm(x, rows, d, mn), x @ w.t()
    err = (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    return {"gemm": "int4", "m": m, "n": n, "k": k, "group": group, "max_rel_err": err, "ok": err < 2e-2,
            "ms": time_ms(lambda: int4_gemm(x, rows, d, mn)), "bf16_ms": time_ms(lambda: x @ w.t())}


def marlin_gemm_case(m: int, n: int = 4096, k: int = 4096, group: int = 128) -> dict:
    """An AWQ/GPTQ-style int4 linear (integer zero points) on the Marlin GEMM
    (sgl-kernel) against the dequantized bf16 GEMM."""
    from appliance.kernels import marlin_int4
    from appliance.models.int4_checkpoints import quantize_zero_point
    from appliance.models.quant import Int4WeightOnlyLinear

    if not marlin_int4.usable(DEV, torch.bfloat16):
        raise RuntimeError("the Marlin GEMM does not run here (sgl_kernel not importable, or before SM80)")
    g = torch.Generator().manual_seed(m)
    q, z, s = quantize_zero_point(torch.randn(n, k, generator=g) / k ** 0.5, group)
    d = s.float()
    lin = Int4WeightOnlyLinear(None, None, blocks=(q, d, -(d * z.float())))
    w = lin.dequantized().to("cuda", torch.bfloat16)
    lin.prepare_for(DEV, torch.bfloat16)
    if lin.marlin_words is None:
        raise RuntimeError("the Marlin GEMM did not take the blocks")
    lin.to(DEV)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got, ref = lin(x), x @ w.t()
    err = (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    return {"gemm": "int4 Marlin", "m": m, "n": n, "k": k, "group": group, "max_rel_err": err, "ok": err < 2e-2,
            "ms": time_ms(lambda: lin(x)), "bf16_ms": time_ms(lambda: x @ w.t())}


def int8_gemm_case(m: int, n: int = 4096, k: int = 4096, group: int = 16) -> dict:
    """The Triton grouped int8 GEMM (GGUF Q8_0/Q5_K/Q6_K, GPTQ 8-bit; groups of 16 as Q6_K's) against the
    dequantized bf16 GEMM."""
    from appliance.kernels.triton_int4 import int8_gemm
    from appliance.models.quant import dequantize_int4

    g = torch.Generator().manual_seed(m)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    d = torch.rand(n, k // group, generator=g) / (64 * k ** 0.5)
    mn = torch.randn(n, k // group, generator=g) / (64 * k ** 0.5)
    w = dequantize_int4(q, d, mn).to("cuda", torch.bfloat16)
    q, d, mn = q.cuda(), d.cuda(), mn.cuda()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got, ref = int8_gemm(x, q, d, mn), x @ w.t()
    err = (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    return {"gemm": "int8 grouped", "m": m, "n": n, "k": k, "group": group, "max_rel_err": err, "ok": err < 2e-2,
            "ms": time_ms(lambda: int8_gemm(x, q, d, mn)), "bf16_ms": time_ms(lambda: x @ w.t())}


def moe_case(kernel: str, tokens: int, experts: int = 64, top_k: int = 8, hidden: int = 2048,
             inter: int = 768) -> dict:
    """One sparse layer's bf16 experts (Qwen3-30B-A3B's shape) through the
    Triton fused MoE or FlashInfer's, against the grouped torch path."""
    from appliance.kernels import flashinfer_moe
    from appliance.kernels.triton_moe import fused_experts
    from appliance.models.moe import FusedExperts, route

    g = torch.Generator().manual_seed(tokens)
    ex = FusedExperts(experts, hidden, inter).to("cuda")
    ex.w13.data = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to("cuda", torch.bfloat16)
    ex.w2.data = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=g).to("cuda", torch.bfloat16)
    weights, ids = route(torch.randn(tokens, experts, generator=g).cuda(), top_k, True)
    cpu = FusedExperts(experts, hidden, inter)
    cpu.w13.data, cpu.w2.data = ex.w13.data.float().cpu(), ex.w2.data.float().cpu()
    ref = cpu(x.float().cpu(), weights.cpu(), ids.cpu())  # the grouped torch path, fp32
    if kernel == "flashinfer":
        if not flashinfer_moe.usable(x):
            raise RuntimeError("FlashInfer's fused MoE does not run here (not importable, or another arch)")
        w31 = flashinfer_moe.up_first(ex.w13.data)

        def run():
            return flashinfer_moe.fused_experts(x, w31, ex.w2.data, weights, ids, 0, experts)
    else:
        def run():
            return fused_experts(x, ex.w13.data, ex.w2.data, weights, ids)
    got = run().float().cpu()
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    return {"moe": kernel, "tokens": tokens, "experts": experts, "top_k": top_k, "hidden": hidden, "inter": inter,
            "max_rel_err": err, "ok": err < 3e-2, "ms": time_ms(run)}


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "kernels": [], "e2e": [],
              "gemms": [], "moe": [], "not_importable": {}}

    def save() -> None:  # after each section: a run cut short at its time limit still reports what ran
        with open(os.path.join(OUT, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=2)

    for kernel in ("triton", "flashinfer"):
        for tokens in (1, 64, 1024):
            try:
                report["moe"].append(moe_case(kernel, tokens))
            except Exception as e:
                report["moe"].append({"moe": kernel, "tokens": tokens, "error": repr(e),
                                      "trace": traceback.format_exc()[-2000:]})
    save()
    for case, name in ((fp8_gemm_case, "fp8 W8A8"), (int4_gemm_case, "int4"), (marlin_gemm_case, "int4 Marlin"),
                       (int8_gemm_case, "int8 grouped")):
        for m in (1, 16, 100, 2048):
            try:
                report["gemms"].append(case(m))
            except Exception as e:
                report["gemms"].append({"gemm": name, "m": m, "error": repr(e), "trace": traceback.format_exc()[-2000:]})
    save()
    for name in ("triton", "flashinfer", "flash_attn3"):
        provider, err = probe_importable(name)
        if provider is None:
            report["not_importable"][name] = err
            continue
        for kv in BACKENDS[name].kv_dtypes:
            if kv == "fp8_e5m2":
                continue
            try:
                report["kernels"].append(kernel_case(name, kv))
            except Exception as e:
                report["kernels"].append({"backend": name, "kv_cache_dtype": kv, "error": repr(e),
                                          "trace": traceback.format_exc()[-2000:]})
        try:
            report["e2e"].append(e2e_case(name))
        except Exception as e:
            report["e2e"].append({"backend": name, "error": repr(e), "trace": traceback.format_exc()[-2000:]})
        save()
    print(json.dumps(report, indent=2))
    return 0 if all(k.get("ok") for k in report["kernels"] + report["gemms"] + report["moe"]) else 1


if __name__ == "__main__":
    sys.exit(main())
