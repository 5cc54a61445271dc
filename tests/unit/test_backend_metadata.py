"""Metadata builders of the CUDA-only backends, against hand-computed arrays,
and their kernels where CUDA is present."""

import pytest
import torch

from appliance.kernels.flash_attn_attention import build_fa3_metadata
from appliance.kernels.flashinfer_attention import FlashInferBackend, build_csr
from tests.kernel_helpers import make_problem


def _common():
    from appliance.kernels.base import CommonAttentionMetadata

    # Three requests, block size 4: seq lens 5 (2 pages), 4 (1 page, full), 9 (3 pages).
    bt = torch.tensor([[7, 3, 0], [5, 0, 0], [1, 2, 9]], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 5, 6, 9], dtype=torch.int32),
        seq_lens=torch.tensor([5, 4, 9], dtype=torch.int32),
        num_computed_tokens=torch.tensor([0, 3, 6], dtype=torch.int32),
        block_table=bt,
        slot_mapping=torch.tensor([28, 29, 30, 31, 12, 23, 37, 38, 39], dtype=torch.long),
        block_size=4, num_reqs=3, num_actual_tokens=9, max_query_len=5, max_seq_len=9,
        query_start_loc_cpu=[0, 5, 6, 9], seq_lens_cpu=[5, 4, 9],
    )


def test_flashinfer_csr_by_hand():
    qo, indptr, indices, last = build_csr(_common())
    assert qo.tolist() == [0, 5, 6, 9]
    assert indptr.tolist() == [0, 2, 3, 6]
    assert indices.tolist() == [7, 3, 5, 1, 2, 9]
    assert last.tolist() == [1, 4, 1]
    md = FlashInferBackend(4, 2, 64, 0.125).build_metadata(_common())
    assert md.paged_kv_indices.dtype == torch.int32 and md.paged_kv_indices.tolist() == [7, 3, 5, 1, 2, 9]


class _Wrapper:
    """Stands in for FlashInfer's BatchPrefillWithPagedKVCacheWrapper: records what a layer hands it."""

    def __init__(self):
        self.plans, self.runs = [], []

    def plan(self, *args, **kwargs):
        self.plans.append({**kwargs, "stashed_sinks": getattr(self, "_sinks", None)})

    def run(self, q, kv, **kwargs):
        self.runs.append(kwargs)
        return q


def test_flashinfer_gets_a_layers_sinks_as_fp32_per_head():
    common, q, k, v, cache = make_problem([(0, 5), (3, 1)], 16, 4, 2, 64, dtype=torch.bfloat16)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.bfloat16)
    for with_sinks in (False, True):
        b = FlashInferBackend(4, 2, 64, 0.125)
        b._shared.wrapper = wrapper = _Wrapper()
        md = b.build_metadata(common)
        for _ in range(2):  # two layers of one step: one plan
            b.forward(q, k, v, cache, md, sinks=sinks if with_sinks else None)
        assert len(wrapper.plans) == 1 and wrapper.plans[0]["stashed_sinks"] is (True if with_sinks else None)
        if not with_sinks:
            assert "sinks" not in wrapper.runs[0]
        else:  # fp32 per head; the plan was told, so FlashInfer's "auto" picks a kernel that takes them
            assert wrapper.runs[1]["sinks"].dtype == torch.float32 and torch.equal(wrapper.runs[1]["sinks"],
                                                                                  sinks.float())


def test_fa3_metadata_by_hand():
    md = build_fa3_metadata(_common())
    assert md.cu_seqlens_q.tolist() == [0, 5, 6, 9]
    assert md.cache_seqlens.tolist() == [5, 4, 9]
    assert md.page_table.tolist() == [[7, 3, 0], [5, 0, 0], [1, 2, 9]]
    assert md.max_seqlen_q == 5 and md.page_table.dtype == torch.int32


def test_kv_cache_dtypes():
    assert FlashInferBackend.cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert FlashInferBackend.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    from appliance.kernels.torch_sdpa import TorchSDPABackend
    from appliance.kernels.triton_attention import TritonAttentionBackend

    assert TorchSDPABackend.cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="the triton backend has no fp8_e5m2 KV cache"):
        TritonAttentionBackend.cache_dtype("fp8_e5m2", torch.float32)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runs only on CUDA")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flashinfer", "flash_attn3", "triton"])
def test_cuda_kernels_match_sdpa(name):
    from appliance.kernels.registry import load_backend, probe_provider
    from tests.kernel_helpers import reference

    if probe_provider(name)[0] is None:
        pytest.skip(f"{name} not importable here")
    common, q, k, v, cache = make_problem([(0, 37), (50, 1), (16, 9)], 16, 8, 2, 128, dtype=torch.bfloat16)
    ref, _ = reference(common, q, k, v, cache, 8, 2, 128)
    dev = torch.device("cuda")
    common = type(common)(**{f: (getattr(common, f).to(dev) if torch.is_tensor(getattr(common, f)) else getattr(common, f))
                             for f in common.__dataclass_fields__})
    b = load_backend(name)(8, 2, 128, 128 ** -0.5)
    out = b.forward(q.to(dev), k.to(dev), v.to(dev), cache.to(dev), b.build_metadata(common))
    torch.testing.assert_close(out.float().cpu(), ref, rtol=3e-2, atol=3e-2)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flashinfer", "triton"])
@pytest.mark.parametrize("window", [None, 8])
def test_cuda_kernels_take_sinks(name, window):
    """gpt-oss's attention (a sink logit per head in each softmax, sliding or not) on the GPU backends that
    take it, against the direct computation."""
    from appliance.kernels.registry import load_backend, probe_provider
    from tests.kernel_helpers import windowed_problem

    if probe_provider(name, model_needs=("sinks",))[0] is None:
        pytest.skip(f"{name} with sinks not importable here")
    sinks = torch.tensor([2.0, -1.0, 0.5, 8.0, 0.0, 1.0, -3.0, 4.0])
    common, q, k, v, cache, expected = windowed_problem([(0, 37), (50, 1), (16, 9)], window, 16, 8, 2, 64,
                                                        sinks=sinks)
    dev = torch.device("cuda")
    common = type(common)(**{f: (getattr(common, f).to(dev) if torch.is_tensor(getattr(common, f)) else getattr(common, f))
                             for f in common.__dataclass_fields__})
    b = load_backend(name)(8, 2, 64, 64 ** -0.5)
    out = b.forward(*(t.to(dev, torch.bfloat16) for t in (q, k, v, cache)), b.build_metadata(common),
                    sinks=sinks.to(dev))
    torch.testing.assert_close(out.float().cpu(), expected, rtol=3e-2, atol=3e-2)


def test_torch_sdpa_makes_its_masks_where_the_batch_is():
    """The reference backend's decode and prefill masks are made on the
    device of the batch's tensors (here ``meta``: a tensor made on the CPU
    by default fails), as a GPU run needs."""
    from appliance.kernels.torch_sdpa import TorchSDPABackend

    common, q, k, v, cache = make_problem([(30, 1), (20, 1), (16, 8), (0, 5)], 16, 4, 2, 8)
    meta = torch.device("meta")
    common = type(common)(**{f: (getattr(common, f).to(meta) if torch.is_tensor(getattr(common, f))
                                 else getattr(common, f)) for f in common.__dataclass_fields__})
    backend = TorchSDPABackend(4, 2, 8, 8 ** -0.5)
    out = backend.forward(q.to(meta), k.to(meta), v.to(meta), cache.to(meta), backend.build_metadata(common))
    assert out.device == meta and out.shape == q.shape


# not flashinfer: it reads the block table back to the host to build its page lists (build_csr), which a
# meta tensor cannot do (on a GPU a copy each step); the H200 check runs its builder where it is installed
@pytest.mark.parametrize("name", ["triton", "flash_attn3", "torch_sdpa"])
def test_metadata_is_built_where_the_batch_is(name):
    """A backend's per-step metadata lands on the batch's device (``meta`` here: a tensor a builder made
    on the CPU by default would show), as a GPU step needs; the kernel packages are not needed for it."""
    from appliance.kernels.registry import load_backend

    common = _common()
    meta = torch.device("meta")
    common = type(common)(**{f: (getattr(common, f).to(meta) if torch.is_tensor(getattr(common, f))
                                 else getattr(common, f)) for f in common.__dataclass_fields__})
    md = load_backend(name)(4, 2, 64, 0.125).build_metadata(common)
    tensors = [v for v in vars(md).values() if torch.is_tensor(v)]
    assert tensors or name == "torch_sdpa"
    assert all(t.device == meta for t in tensors), [(k, v.device) for k, v in vars(md).items() if torch.is_tensor(v)]
