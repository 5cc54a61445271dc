"""The checksums KV blocks carry between engines: one digest whether the
blocks were gathered into a message or are read where they lie, any
changed byte a different digest, and NaN or infinity found in every cache
dtype as that dtype reads its bytes."""

import pytest
import torch

from appliance.worker.kv_checksum import cached_layers, gathered_layers, has_nonfinite, layers_digest, layers_problem
from appliance.worker.kv_checksum import gather_blocks

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def _caches(dtype, layers=3, blocks=12):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, blocks, 4, 2, 8, generator=g).to(dtype) for _ in range(layers)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gathered_and_cached_blocks_have_one_digest(dtype):
    caches, ids = _caches(dtype), [7, 2, 9, 3]
    data = gather_blocks(caches, ids)
    digest = layers_digest(gathered_layers(data))
    assert layers_digest(cached_layers(caches, ids)) == digest
    assert layers_problem(cached_layers(caches, ids), dtype, digest) is None
    assert layers_digest(cached_layers(caches, [2, 7, 9, 3])) != digest  # the blocks' order counts
    data.view(-1)[len(data.view(-1)) // 3] ^= 1
    assert layers_problem(gathered_layers(data), dtype, digest) == "blocks that do not match their checksum"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_nan_and_infinity_is_found(dtype):
    finite = torch.randn(2, 5, 4, 2, 8).to(dtype)
    assert not has_nonfinite(finite.view(torch.uint8), dtype)
    codes = torch.arange(256, dtype=torch.uint8) if dtype.itemsize == 1 else None
    if codes is not None:  # each code on its own: nonfinite exactly where the dtype reads one
        for code in codes.tolist():
            bad = finite.clone().view(torch.uint8)
            bad.view(-1)[11] = code
            assert has_nonfinite(bad, dtype) == (not torch.isfinite(torch.tensor([code], dtype=torch.uint8)
                                                                    .view(dtype).float()).item()), code
        return
    for value in (float("nan"), float("inf"), float("-inf")):
        bad = finite.clone()
        bad.view(-1)[37] = value
        assert has_nonfinite(bad.view(torch.uint8), dtype)
        assert layers_problem(gathered_layers(bad.view(torch.uint8)), dtype,
                              layers_digest(gathered_layers(bad.view(torch.uint8)))) == \
            "blocks holding NaN or infinite values"
