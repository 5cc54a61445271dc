"""The native CPU kernels (kernels/csrc/cpu_ops.c) against torch references:
GEMMs over every tile remainder, paged attention on ragged mixed batches,
whole-model generation token for token against the torch_sdpa path, and a
clear refusal when the library cannot be built."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from appliance import LLM, SamplingParams
from appliance.kernels.cpu_native import CpuNativeBackend, NativeLinear
from appliance.kernels.registry import Selection
from appliance.models.quant import Int8WeightOnlyLinear
from tests.kernel_helpers import make_problem, reference
from tests.model_helpers import PROMPTS, TINY_VARIANTS


def _module(kind, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    if kind == "int8":
        m = Int8WeightOnlyLinear(w, b)
        return m, m.weight_int8.float() * m.scale[:, None], b
    lin = torch.nn.Linear(k, n, bias=bias)
    lin.weight.data, lin.bias = w, (torch.nn.Parameter(b) if bias else None)
    return lin, w, b


@pytest.mark.parametrize("kind", ["fp32", "int8"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 13, 100])
@pytest.mark.parametrize("n,k", [(7, 13), (12, 16), (50, 40), (33, 200), (9, 1000)])
def test_linear_matches_torch_over_every_remainder(kind, m, n, k):
    mod, w_ref, b = _module(kind, n, k, bias=(n % 2 == 1), seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = F.linear(x, w_ref, b)
    got = NativeLinear(mod)(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # accumulate=True adds into the output (the fused residual add)
    base = torch.randn(m, n)
    out = base.clone()
    NativeLinear(mod)(x, out=out, accumulate=True)
    torch.testing.assert_close(out, base + ref, rtol=1e-4, atol=1e-4)


def test_linear_reads_strided_rows():
    mod, w_ref, _ = _module("int8", 24, 64, bias=False, seed=3)
    wide = torch.randn(6, 96)
    x = wide[:, 16:80]  # row stride 96, not contiguous: the wrapper makes it so
    torch.testing.assert_close(NativeLinear(mod)(x), F.linear(x, w_ref), rtol=1e-4, atol=1e-4)


# (num_computed, query_len): fresh prefill, chunk after a prefix ending mid-block,
# decodes at a block boundary and inside a block, a chunk crossing several blocks, a 1-token prompt.
MIXED = [(0, 5), (7, 3), (16, 1), (21, 1), (3, 18), (0, 1)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 1), (6, 2), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_sdpa(num_heads, num_kv_heads, head_dim, block_size):
    common, q, k, v, cache = make_problem(MIXED, block_size, num_heads, num_kv_heads, head_dim)
    ref_out, ref_cache = reference(common, q, k, v, cache, num_heads, num_kv_heads, head_dim)
    b = CpuNativeBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (9, 3)])
def test_bf16_kv_cache_matches_sdpa_on_the_rounded_values(num_heads, num_kv_heads):
    common, q, k, v, cache = make_problem(MIXED, 16, num_heads, num_kv_heads, 64, seed=7)
    bf_cache = cache.to(torch.bfloat16)
    b = CpuNativeBackend(num_heads, num_kv_heads, 64, 0.125, kv_cache_dtype="bfloat16")
    out = b.forward(q, k, v, bf_cache, b.build_metadata(common))
    # The reference attends over exactly the values the bf16 cache holds (round to nearest even).
    kq, vq = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    ref_out, ref_cache = reference(common, q, kq, vq, bf_cache.float(), num_heads, num_kv_heads, 64)
    torch.testing.assert_close(bf_cache.float(), ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


def test_bf16_kv_cache_whole_model_matches_torch_path():
    overrides = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05", "cache.kv_cache_dtype=bfloat16"]
    p = SamplingParams(max_tokens=16, temperature=0, logprobs=3)
    ref_llm = LLM(overrides=overrides, selection=Selection(chosen="torch_sdpa"))
    assert ref_llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    ref = ref_llm.generate(PROMPTS, p, use_tqdm=False)
    nat_llm = LLM(overrides=overrides)
    assert nat_llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    nat = nat_llm.generate(PROMPTS, p, use_tqdm=False)
    fp32 = LLM(overrides=overrides[:-1]).generate(PROMPTS, p, use_tqdm=False)
    same_as_fp32 = 0
    for a, b, c in zip(ref, nat, fp32):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        same_as_fp32 += b.outputs[0].token_ids == c.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lb.logprob == pytest.approx(la.logprob, abs=1e-4)
    assert same_as_fp32 >= len(PROMPTS) - 2  # bf16 K/V rounding may flip a near tie


def test_long_context_softmax_is_stable():
    # 300 positions of large logits: the max-subtracted exp must not overflow.
    common, q, k, v, cache = make_problem([(290, 10), (0, 1)], 16, 4, 2, 64, seed=5)
    q = q * 30
    ref_out, _ = reference(common, q, k, v, cache, 4, 2, 64)
    b = CpuNativeBackend(4, 2, 64, 64 ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
@pytest.mark.parametrize("extra", [[], ["quantization=int8_wo"], ["scheduler.max_num_batched_tokens=16",
                                                                   "cache.block_size=4"]])
def test_whole_step_forward_matches_torch_path(variant, extra):
    overrides = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05"] + TINY_VARIANTS[variant] + extra
    p = SamplingParams(max_tokens=16, temperature=0, logprobs=3)
    ref = LLM(overrides=overrides, selection=Selection(chosen="torch_sdpa")).generate(PROMPTS, p, use_tqdm=False)
    nat_llm = LLM(overrides=overrides)
    assert nat_llm.engine.runner.backend.name == "cpu_native"
    nat = nat_llm.generate(PROMPTS, p, use_tqdm=False)
    for a, b in zip(ref, nat):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lb.logprob == pytest.approx(la.logprob, abs=1e-4)
            assert [t for t, _ in lb.top] == [t for t, _ in la.top]


def test_prebuilt_library_needs_no_compiler(tmp_path):
    import shutil

    from appliance.kernels.cpu_build import build_library, library_name

    shutil.copy(build_library(), tmp_path / library_name())
    code = "import appliance.kernels.cpu_native as m; print(m._LIB._name)"
    env = {"PATH": "/nonexistent", "CC": "/nonexistent/gcc", "APPLIANCE_KERNEL_DIR": str(tmp_path),
           "APPLIANCE_CACHE_DIR": str(tmp_path / "empty"), "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / library_name())


def test_refuses_clearly_when_the_compiler_is_missing(tmp_path):
    code = (
        "import appliance.kernels.registry as reg\n"
        "mod, err = reg.probe_importable('cpu_native')\n"
        "assert mod is None\n"
        "print(err)\n"
    )
    env = {"PATH": "/nonexistent", "CC": "/nonexistent/gcc", "APPLIANCE_CACHE_DIR": str(tmp_path),
           "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "building cpu_native kernels with /nonexistent/gcc failed" in r.stdout or "C compiler" in r.stdout


def test_out_of_vocabulary_ids_raise_instead_of_reading_past_the_table():
    llm = LLM(overrides=["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.01"])
    vocab = llm.resolved.cfg.model.vocab_size
    with pytest.raises(ValueError, match=f"token id {vocab} is outside the vocabulary"):
        llm.generate([[1, 2, vocab]], SamplingParams(max_tokens=2), use_tqdm=False)
