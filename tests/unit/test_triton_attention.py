"""The Triton unified paged attention kernel against torch_sdpa, under the
Triton interpreter on CPU (TRITON_INTERPRET=1, set before any kernel module
is imported; it stays set, since Triton reads it again while it runs the
kernels, so tests that depend on it set or clear it themselves)."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import appliance.kernels.registry as reg  # noqa: E402
from appliance.config.compose import resolve  # noqa: E402
from appliance.kernels import triton_attention  # noqa: E402
from appliance.kernels.triton_attention import INTERPRET, TritonAttentionBackend  # noqa: E402
from tests.kernel_helpers import make_problem, reference, windowed_problem  # noqa: E402

assert INTERPRET, "appliance.kernels.triton_attention was imported before TRITON_INTERPRET=1 was set"

# (num_computed, query_len): a fresh prefill, a chunk after a prefix that ends mid-block,
# decodes at a block boundary and inside a block, a chunk crossing several blocks.
MIXED = [(0, 5), (7, 3), (16, 1), (21, 1), (3, 18)]
# Head sizes beyond test_mixed_batch_matches_sdpa's 64 and 128, one or more per padded size
# (HEAD_DIM_PAD 16, 32, 64, 128, 256), both ends of the capability's range included.
PADDED_HEAD_SIZES = [16, 24, 40, 48, 72, 80, 96, 136, 192, 256]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 1), (8, 1), (6, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_matches_sdpa(num_heads, num_kv_heads, head_dim):
    common, q, k, v, cache = make_problem(MIXED, 16, num_heads, num_kv_heads, head_dim)
    ref_out, ref_cache = reference(common, q, k, v, cache, num_heads, num_kv_heads, head_dim)
    b = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)  # the cache write is exact
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window,block_size", [(8, 16), (20, 16), (1, 16)])
def test_a_sliding_window_is_attended_and_nothing_before_it_is_read(window, block_size):
    specs = [(40, 1), (5, 1), (13, 6), (0, 23), (37, 9)]
    common, q, k, v, cache, expected = windowed_problem(specs, window, block_size, 4, 2, 16)
    b = TritonAttentionBackend(4, 2, 16, 16 ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 8])
def test_soft_capped_scores(window):
    specs = [(40, 1), (5, 1), (13, 6), (0, 23), (37, 9)]
    common, q, k, v, cache, expected = windowed_problem(specs, window, 16, 4, 2, 16, soft_cap=0.5)
    b = TritonAttentionBackend(4, 2, 16, 16 ** -0.5, soft_cap=0.5)
    torch.testing.assert_close(b.forward(q, k, v, cache, b.build_metadata(common)), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 8])
def test_attention_sinks(window):
    specs = [(40, 1), (5, 1), (13, 6), (0, 23), (37, 9)]
    sinks = torch.tensor([2.0, -1.0, 0.5, 8.0])
    common, q, k, v, cache, expected = windowed_problem(specs, window, 16, 4, 2, 16, sinks=sinks)
    b = TritonAttentionBackend(4, 2, 16, 16 ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common), sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("head_dim", PADDED_HEAD_SIZES)
def test_padded_head_sizes_match_sdpa(head_dim):
    # tiny_random's GQA shape (4 query heads on 2 KV heads); non-powers of two are padded and masked.
    common, q, k, v, cache = make_problem(MIXED, 16, 4, 2, head_dim, seed=head_dim)
    ref_out, ref_cache = reference(common, q, k, v, cache, 4, 2, head_dim)
    b = TritonAttentionBackend(4, 2, head_dim, head_dim ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [32, 64])
def test_larger_blocks_match_sdpa(block_size):
    # Prefixes that end inside the first block and past it, and a chunk that crosses a block boundary.
    specs = [(0, 7), (block_size - 1, 1), (block_size + 5, 3), (3, block_size)]
    common, q, k, v, cache = make_problem(specs, block_size, 4, 2, 16, seed=block_size)
    ref_out, ref_cache = reference(common, q, k, v, cache, 4, 2, 16)
    b = TritonAttentionBackend(4, 2, 16, 0.25)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [32, 64])
def test_blocks_read_in_smaller_tiles_match_sdpa(monkeypatch, block_size):
    # On a GPU a block too large for shared memory is read in tiles of 16 keys (registry.triton_kv_tile):
    # fp32 head dim 256 on sm_90 takes 16-key tiles, so each block is walked in 2 or 4 tiles here.
    monkeypatch.setattr(triton_attention, "shared_memory_target", lambda device: "9.0")
    specs = [(0, 7), (block_size - 1, 1), (block_size + 5, 3), (3, block_size)]
    common, q, k, v, cache = make_problem(specs, block_size, 2, 1, 256, seed=block_size)
    ref_out, ref_cache = reference(common, q, k, v, cache, 2, 1, 256)
    b = TritonAttentionBackend(2, 1, 256, 256 ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    assert set(b._tiles.values()) == {16}
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


def test_capability_head_sizes_and_block_sizes():
    cap = reg.BACKENDS["triton"]
    assert cap.head_sizes[0] == 16 and cap.head_sizes[-1] == 256
    assert set(PADDED_HEAD_SIZES) | {32, 64, 128} <= set(cap.head_sizes)
    assert not {8, 20, 264} & set(cap.head_sizes)
    assert [bs for bs in (8, 16, 24, 32, 48, 64, 128) if cap.supports_block_size(bs)] == [16, 32, 64, 128]


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("ON", True),
                                      ("0", False), ("", False), (None, False)])
def test_cpu_profile_accepts_triton_only_under_the_interpreter(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    cfg = resolve(["+profile=cpu", "model=tiny_random", "attention.backend=triton"]).cfg
    sel = reg.select_backend(cfg, "float32", check_import=True)
    if on:
        assert sel.chosen == "triton" and sel.rejected == []
    else:
        assert sel.chosen is None
        assert sel.rejected == [("triton", ["device kind cpu not in ['cuda', 'rocm'] "
                                            "(TRITON_INTERPRET=1 runs it on CPU, in the Triton interpreter)"])]


def test_interpreter_keeps_the_other_rules(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = resolve(["+profile=cpu", "model=tiny_random", "attention.backend=triton", "cache.block_size=24"]).cfg
    sel = reg.select_backend(cfg, "float32", check_import=False)
    assert sel.rejected == [("triton", ["block_size 24 is not a power of two and a multiple of 16"])]
    cfg = resolve(["+profile=mi300x_bf16", "model=tiny_random"], check=False).cfg
    assert reg.BACKENDS["triton"].validate(cfg, "bfloat16") == []  # GPU kinds are unaffected


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


def test_tiny_llama_through_triton_matches_sdpa_greedy(monkeypatch):
    from appliance import LLM, SamplingParams

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the cpu profile selects triton only under the interpreter
    overrides = ["+profile=cpu", "model=tiny_random", "model.dtype=float32", "cache.num_blocks=64",
                 "scheduler.max_num_batched_tokens=24"]
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "What is the capital of France?"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = LLM(overrides=overrides + ["attention.backend=torch_sdpa"])
    tri = LLM(overrides=overrides + ["attention.backend=triton"])
    assert type(tri.engine.runner.backend) is TritonAttentionBackend
    ref_out = ref.generate(prompts, params, use_tqdm=False)
    tri_out = tri.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tri_out] == [o.outputs[0].token_ids for o in ref_out]
