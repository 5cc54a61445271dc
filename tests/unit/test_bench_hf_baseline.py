"""The HF continuous-batching baseline's cache, sized for the bench's workload."""

import pytest

from appliance.bench.throughput import hf_cache_size


def test_every_request_fits_at_once_and_every_prompt_in_one_batch():
    pytest.importorskip("transformers", reason="the HF baseline needs transformers")
    kw = hf_cache_size([[1] * 100, [2] * 300, [3] * 8], 128)
    if not kw:
        pytest.skip("this transformers has no ContinuousBatchingConfig")
    cb = kw["continuous_batching_config"]
    page = cb.page_size
    need = [-(-(n + 128) // page) for n in (100, 300, 8)]
    assert cb.num_blocks == sum(need) + 1
    assert cb.max_batch_tokens == max(page, 408)
