"""GPU check: every kernel the GPU profiles can select, against a reference.

Cases, in sections (``GPU_CHECK_SECTIONS=moe,gemm,attention,e2e,serve,compile``, all by default):
a sparse layer's experts through
the Triton fused MoE and FlashInfer's against the grouped torch path (``moe``); the
fp8 W8A8 GEMM (torch._scaled_mm), the Triton int4, grouped int8 and MXFP4 GEMMs and the
Marlin int4 GEMM against the dequantized bf16 GEMM (``gemm``); every attention
backend against torch_sdpa on realistic shapes (``attention``) and a short
generation on each (``e2e``); the GPU profile served over HTTP against the
CPU profile, with constrained and speculative requests, its decode speed at
batch 1 against the roofline and its KV plan against the device's memory
(``serve``: scripts/gpu_serve.py); the Triton kernels compiled ahead of time for
each GPU target with the tile the registry picks (``compile``, which needs no
GPU: tests/triton_compile.py).

Each case ends ``passed``, ``failed`` (out of tolerance, or it raised) or
``absent`` (what it needs is not here: no CUDA device, a package that does not
import; with the reason). gpu_check.json in $OUT (or ./gpu-results) is rewritten
after every case, so a run cut short still reports what ran. The exit status is
1 when any case failed. ``--cpu-rehearsal`` runs the same cases on a machine
without a GPU: the ones that need one are reported absent.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from appliance.kernels.registry import BACKENDS, load_backend, probe_provider  # noqa: E402
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


def kernel_case(name: str, kv_dtype: str, dtype=torch.bfloat16, D: int = 128, BS: int = 16) -> dict:
    from appliance.kernels.torch_sdpa import TorchSDPABackend

    attention_provider(name, str(dtype).removeprefix("torch."), kv_dtype)
    # 64 sequences at 2k context: 48 decodes and 16 prefill chunks of 128 after a 1920-token prefix.
    specs = [(2047, 1)] * 48 + [(1920, 128)] * 16
    H, KVH = 32, 4  # GQA 8
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
    attention_provider(name)
    try:
        from appliance import LLM, SamplingParams
        from appliance.kernels.registry import Selection
    except ImportError as e:
        raise Absent(f"the config stack does not import: {e}")
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
        raise Absent(f"the Marlin GEMM does not run here: {marlin_int4.unusable_reason(DEV)}")
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


def mxfp4_gemm_case(m: int, n: int = 5760, k: int = 2880) -> dict:
    """The Triton MXFP4 GEMM (gpt-oss's experts as stored; gate|up's shape) against the dequantized bf16 GEMM."""
    from appliance.kernels.triton_mxfp4 import mxfp4_gemm
    from appliance.models.mxfp4 import dequantize_mxfp4

    g = torch.Generator().manual_seed(m)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 124, (n, k // 32), generator=g, dtype=torch.uint8)
    w = dequantize_mxfp4(blocks, scales).to("cuda", torch.bfloat16)
    blocks, scales = blocks.cuda(), scales.cuda()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got, ref = mxfp4_gemm(x, blocks, scales), x @ w.t()
    err = (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    return {"gemm": "mxfp4", "m": m, "n": n, "k": k, "max_rel_err": err, "ok": err < 2e-2,
            "ms": time_ms(lambda: mxfp4_gemm(x, blocks, scales)), "bf16_ms": time_ms(lambda: x @ w.t())}


def moe_case(kernel: str, tokens: int, experts: int = 64, top_k: int = 8, hidden: int = 2048,
             inter: int = 768) -> dict:
    """One sparse layer's bf16 experts (Qwen3-30B-A3B's shape) through the
    Triton fused MoE or FlashInfer's, against the grouped torch path."""
    from appliance.kernels import flashinfer_moe
    from appliance.kernels.triton_moe import fused_experts
    from appliance.models.layers.moe import FusedExperts, route

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
            raise Absent(f"FlashInfer's fused MoE does not run here: {flashinfer_moe.unusable_reason(x)}")
        w31 = flashinfer_moe.up_first(ex.w13.data)

        def run():
            return flashinfer_moe.fused_experts(x, w31, ex.w2.data, weights, ids, 0, experts)
    else:
        def run():
            return fused_experts(x, ex.w13.data, ex.w2.data, weights, ids)
    got = run().float().cpu()
    if got.shape != ref.shape:
        raise AssertionError(f"shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
    err = (got - ref).abs().max().item() / ref.abs().max().item() if ref.numel() else 0.0
    return {"moe": kernel, "tokens": tokens, "experts": experts, "top_k": top_k, "hidden": hidden, "inter": inter,
            "max_rel_err": err, "ok": err < 3e-2, "ms": time_ms(run)}


class Absent(Exception):
    """What a case needs is not on this machine (the message says what and why)."""


class Report:
    """gpu_check.json: the machine, then one entry per case, rewritten after each."""

    def __init__(self, path: str, rehearsal: bool):
        self.path = path
        cuda = torch.cuda.is_available()
        self.data = {"device": torch.cuda.get_device_name(0) if cuda else "no CUDA device",
                     "torch": torch.__version__, "rehearsal": rehearsal, "cases": []}
        self.no_cuda = None if cuda else "no CUDA device" + (" (--cpu-rehearsal)" if rehearsal else "")

    def run(self, section: str, what: dict, fn, *args, needs_cuda: bool = True) -> None:
        entry = {"section": section, **what}
        t0 = time.perf_counter()
        try:
            if needs_cuda and self.no_cuda:
                raise Absent(self.no_cuda)
            result = fn(*args)
            ok = result.pop("ok")
            entry.update(result, status="passed" if ok else "failed")
        except Absent as e:
            entry.update(status="absent", reason=str(e))
        except Exception as e:
            entry.update(status="failed", error=repr(e), trace=traceback.format_exc()[-2000:])
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        self.data["cases"].append(entry)
        why = entry.get("reason") or entry.get("error") or "out of tolerance: " + json.dumps(
            {k: v for k, v in entry.items() if k not in what and k not in ("section", "status", "seconds")})[:300]
        print(f"{entry['status']:>7}  {section}  {json.dumps(what)}" + (f"  ({why})" if entry["status"] != "passed"
                                                                            else ""), flush=True)
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=2)

    def counts(self) -> dict[str, int]:
        out = {"passed": 0, "failed": 0, "absent": 0}
        for c in self.data["cases"]:
            out[c["status"]] += 1
        return out


def attention_provider(name: str, dtype: str = "bfloat16", kv_cache_dtype: str = "auto") -> str:
    provider, err = probe_provider(name, dtype, kv_cache_dtype)
    if provider is None:
        raise Absent(f"{name} does not import: {err}")
    return provider


def main(argv: list[str]) -> int:
    rehearsal = "--cpu-rehearsal" in argv
    sections = os.environ.get("GPU_CHECK_SECTIONS", "moe,gemm,attention,e2e,serve,compile").split(",")
    os.makedirs(OUT, exist_ok=True)
    report = Report(os.path.join(OUT, "gpu_check.json"), rehearsal)
    if "moe" in sections:
        for kernel in ("triton", "flashinfer"):
            for tokens in (0, 1, 64, 1024):
                report.run("moe", {"kernel": kernel, "tokens": tokens}, moe_case, kernel, tokens)
    if "gemm" in sections:
        for case, name in ((fp8_gemm_case, "fp8 W8A8"), (int4_gemm_case, "int4"), (marlin_gemm_case, "int4 Marlin"),
                           (int8_gemm_case, "int8 grouped"), (mxfp4_gemm_case, "mxfp4")):
            for m in (1, 16, 100, 2048):
                report.run("gemm", {"gemm": name, "m": m}, case, m)
    for name in ("triton", "flashinfer", "flash_attn3"):
        if "attention" in sections:
            for kv in BACKENDS[name].kv_dtypes:
                if kv != "fp8_e5m2":
                    report.run("attention", {"backend": name, "kv_cache_dtype": kv}, kernel_case, name, kv)
            if name == "triton":  # blocks larger than a tile of shared memory: read in several tiles
                for head_dim, block_size, dtype in ((128, 256, torch.bfloat16), (256, 256, torch.bfloat16),
                                                    (128, 256, torch.float32)):
                    report.run("attention", {"backend": name, "kv_cache_dtype": "auto", "head_dim": head_dim,
                                             "block_size": block_size, "dtype": str(dtype)},
                               kernel_case, name, "auto", dtype, head_dim, block_size)
        if "e2e" in sections:
            report.run("e2e", {"backend": name}, e2e_case, name)
    if "serve" in sections:
        import gpu_serve

        servers = gpu_serve.Servers()
        try:
            for what, fn in gpu_serve.serve_cases(servers):
                report.run("serve", what, fn)
        finally:
            servers.close()
    if "compile" in sections:
        from tests.triton_compile import compile_cases
        for what, fn in compile_cases():
            report.run("compile", what, fn, needs_cuda=False)
    counts = report.counts()
    print(f"gpu_check: {counts['passed']} passed, {counts['failed']} failed, {counts['absent']} absent "
          f"(on {report.data['device']}; {report.path})")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
