"""The Triton unified paged attention kernel against torch_sdpa, under the
Triton interpreter on CPU (TRITON_INTERPRET=1, set before any kernel module
is imported)."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from appliance.kernels.triton_attention import TritonAttentionBackend  # noqa: E402
from tests.kernel_helpers import make_problem, reference  # noqa: E402

# (num_computed, query_len): a fresh prefill, a chunk after a prefix that ends mid-block,
# decodes at a block boundary and inside a block, a chunk crossing several blocks.
MIXED = [(0, 5), (7, 3), (16, 1), (21, 1), (3, 18)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 1), (8, 1), (6, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_matches_sdpa(num_heads, num_kv_heads, head_dim):
    common, q, k, v, cache = make_problem(MIXED, 16, num_heads, num_kv_heads, head_dim)
    ref_out, ref_cache = reference(common, q, k, v, cache, num_heads, num_kv_heads, head_dim)
    b = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)  # the cache write is exact
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


def test_bf16_inputs_upcast_in_interpreter():
    common, q, k, v, cache = make_problem(MIXED[:3], 16, 4, 1, 64, dtype=torch.bfloat16, seed=1)
    ref_out, _ = reference(common, q, k, v, cache, 4, 1, 64)
    b = TritonAttentionBackend(4, 1, 64, 64 ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-2)


def test_fp8_kv_cache_dequantized_in_kernel():
    common, q, k, v, cache = make_problem([(0, 4), (9, 1), (20, 3)], 16, 4, 1, 64, seed=2)
    fp8_cache = cache.to(torch.float8_e4m3fn)
    b = TritonAttentionBackend(4, 1, 64, 64 ** -0.5, kv_cache_dtype="fp8_e4m3")
    out = b.forward(q, k, v, fp8_cache, b.build_metadata(common))
    assert fp8_cache.dtype == torch.float8_e4m3fn
    # The reference attends over exactly the values the fp8 cache holds.
    kq = k.to(torch.float8_e4m3fn).float()
    vq = v.to(torch.float8_e4m3fn).float()
    ref_out, ref_cache = reference(common, q, kq, vq, fp8_cache.float(), 4, 1, 64)
    torch.testing.assert_close(fp8_cache.float(), ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


def test_tiles_cover_every_query_token():
    b = TritonAttentionBackend(8, 1, 64, 0.125)
    common, *_ = make_problem([(0, 9), (5, 1), (0, 4)], 16, 8, 1, 64)
    md = b.build_metadata(common)
    covered = []
    for r, q0 in zip(md.tile_req.tolist(), md.tile_q.tolist()):
        qlen = common.query_start_loc_cpu[r + 1] - common.query_start_loc_cpu[r]
        covered += [(r, i) for i in range(q0, min(q0 + md.block_q, qlen))]
    assert sorted(covered) == [(0, i) for i in range(9)] + [(1, 0)] + [(2, i) for i in range(4)]


def test_tiny_llama_through_triton_matches_sdpa_greedy():
    from appliance import LLM, SamplingParams
    from appliance.kernels.registry import Selection

    overrides = ["+profile=cpu", "model=tiny_random", "cache.num_blocks=64", "scheduler.max_num_batched_tokens=24"]
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "What is the capital of France?"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = LLM(overrides=overrides).generate(prompts, params, use_tqdm=False)
    tri = LLM(overrides=overrides, selection=Selection(chosen="triton")).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tri] == [o.outputs[0].token_ids for o in ref]
