"""KV cache tensors on the host: zero-filled, writable, and resident only
where written."""

import gc
import os
import sys

import pytest
import torch

from appliance.worker.kv_memory import copy_kv_blocks, zeroed_kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_host_cache_is_zero_and_writable(dtype):
    t = zeroed_kv_cache((3, 2, 4, 2, 8), dtype, "cpu")
    gc.collect()  # the tensor alone keeps its memory mapped
    assert t.shape == (3, 2, 4, 2, 8) and t.dtype == dtype and t.is_contiguous()
    assert t.float().abs().sum() == 0 and t.data_ptr() % 4096 == 0
    t[1, 0] = 1.5
    assert t.float().sum() == 1.5 * 4 * 2 * 8
    assert zeroed_kv_cache((3, 2, 4, 2, 8), dtype, "cpu").float().sum() == 0  # each call its own memory


def test_an_empty_cache():
    assert zeroed_kv_cache((0, 2, 16, 1, 8), torch.float32, "cpu").numel() == 0


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_start_up_writes_none_of_the_budget():
    """512 MiB of cache: resident memory grows by what is written, not the budget."""
    before = _resident_bytes()
    t = zeroed_kv_cache((1024, 2, 16, 64, 64), torch.float32, "cpu")  # 512 MiB
    assert _resident_bytes() - before < 64 << 20
    t[:64].fill_(1.0)  # 32 MiB written
    grown = _resident_bytes() - before
    assert 32 << 20 <= grown < 96 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_forked_blocks_are_copied_in_every_kv_dtype(dtype):
    """Beam search's copies on write: each (src, dst) block's K and V, bit for bit, in every tensor (one that two
    layers share, as KV-cache groups do, too), every other block as it was."""
    shape = (2, 6, 4, 2, 8)  # [K/V, blocks, block_size, kv heads, head_dim]
    a = torch.randn(shape).to(dtype)
    b = torch.randn(shape).to(dtype)
    before_a, before_b = a.clone(), b.clone()
    copy_kv_blocks([a, b, a], [(1, 4), (2, 5)])
    for cache, before in ((a, before_a), (b, before_b)):
        raw, old = cache.view(torch.uint8), before.view(torch.uint8)
        assert torch.equal(raw[:, 4], old[:, 1]) and torch.equal(raw[:, 5], old[:, 2])
        assert torch.equal(raw[:, :4], old[:, :4])
