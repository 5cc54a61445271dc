"""Sliding-window and soft-capped attention in the CPU backends: each query
attends to its last ``window`` positions only, and the blocks wholly before
them (given back by a sliding-window KV-cache group: the null block, or
another request's) are never read; soft-capped scores are
``soft_cap * tanh(score / soft_cap)`` (Gemma 2); attention sinks put each
head's learned logit in the softmax's denominator (gpt-oss)."""

import pytest
import torch

from appliance.kernels.torch_sdpa import TorchSDPABackend
from tests.kernel_helpers import windowed_problem

# (num_computed, query_len): decodes far past the window and inside it, a chunk that crosses the window's
# edge, a fresh prompt longer than the window, a chunk after a long prefix, a decode whose context cpu_native
# splits (merged after)
SPECS = [(40, 1), (5, 1), (13, 6), (0, 23), (37, 9), (600, 1)]


def backends():
    out = [TorchSDPABackend]
    try:
        from appliance.kernels.cpu_native import CpuNativeBackend
    except ImportError:  # no compiler or no AVX2 here: cpu_native is not selectable either
        return out
    return out + [CpuNativeBackend]


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("window,block_size", [(8, 4), (12, 16), (1, 4), (40, 8)])
def test_a_sliding_window_is_attended_and_nothing_before_it_is_read(backend, window, block_size):
    common, q, k, v, cache, expected = windowed_problem(SPECS, window, block_size, 4, 2, 16)
    b = backend(4, 2, 16, 16 ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("window", [None, 8])
def test_soft_capped_scores(backend, window):
    common, q, k, v, cache, expected = windowed_problem(SPECS, window, 4, 4, 2, 16, soft_cap=0.5)
    b = backend(4, 2, 16, 16 ** -0.5, soft_cap=0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    plain = backend(4, 2, 16, 16 ** -0.5)  # the cap changes the answer
    assert (plain.forward(q, k, v, cache, plain.build_metadata(common)) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("window", [None, 8])
def test_attention_sinks(backend, window):
    sinks = torch.tensor([2.0, -1.0, 0.5, 8.0])  # the last outweighs every score: its head's output shrinks
    common, q, k, v, cache, expected = windowed_problem(SPECS, window, 4, 4, 2, 16, sinks=sinks)
    b = backend(4, 2, 16, 16 ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common), sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert (b.forward(q, k, v, cache, b.build_metadata(common)) - expected).abs().max() > 1e-2


def _native_paths():
    """cpu_native's decode items: 8-lane (AVX2) always, 16-lane (AVX-512F) where the CPU has it."""
    try:
        from appliance.kernels.cpu_native import avx512
    except ImportError:  # no compiler or no AVX2 here: cpu_native is not selectable either
        return []
    return [False, pytest.param(True, marks=pytest.mark.skipif(not avx512(), reason="this CPU lacks AVX512F/BW"))]


@pytest.mark.parametrize("wide", _native_paths(), ids=lambda w: "avx512" if w else "avx2")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32_cache", "bf16_cache"])
def test_native_decode_items_on_each_path_and_cache(wide, cache_dtype):
    """A window, a cap and sinks together on both of cpu_native's decode-item paths (the 16-lane one takes a
    head size that is a multiple of 32) over an fp32 and a bf16 cache, against the same attention computed
    directly on the values the cache holds."""
    from appliance.kernels.cpu_native import CpuNativeBackend, avx512

    sinks = torch.tensor([1.0, -2.0, 0.5, 3.0])
    # K and V rounded as the cache stores them, so the expected output is over what the kernel reads
    common, q, k, v, cache, expected = windowed_problem(SPECS, 8, 4, 4, 2, 32, soft_cap=0.5, sinks=sinks,
                                                        round_to=cache_dtype)
    cache = cache.to(cache_dtype)
    before = avx512()
    avx512(wide)
    try:
        b = CpuNativeBackend(4, 2, 32, 32 ** -0.5, soft_cap=0.5)
        out = b.forward(q, k, v, cache, b.build_metadata(common), sinks=sinks)
    finally:
        avx512(before)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
