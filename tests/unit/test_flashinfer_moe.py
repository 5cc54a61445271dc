"""FlashInfer's fused MoE (GPU profiles): its kernels cannot run here, so the
plumbing around them is held against ``reference``, FlashInfer's documented
contract in torch. A sparse layer's experts taken through the FlashInfer
branch (the kernel stood in for by the reference) give the grouped torch
path's sums, whole and as expert-parallel ranks' shares; the gate|up
halves are swapped once and the layer still runs an expert by hand; a swap
forgotten, or the ranks' shares misnamed, would not pass. On CPU tensors
the branch is never taken."""

import pytest
import torch

from appliance.kernels import flashinfer_moe
from appliance.kernels.flashinfer_moe import fused_experts, reference, up_first, usable
from appliance.models.layers.moe import FusedExperts, expert_range, route


def _experts(e, h, i, first=0, num_slots=None, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ex = FusedExperts(e, h, i, first, num_slots=num_slots)
    ex.w13.data = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    ex.w2.data = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    return ex


def _routed(tokens, experts, top_k, hidden, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    return (x, *route(torch.randn(tokens, experts, generator=g), top_k, True))


@pytest.fixture
def as_if_flashinfer(monkeypatch):
    """The FlashInfer branch taken on CPU tensors, its kernel the reference."""
    monkeypatch.setattr(flashinfer_moe, "usable", lambda x: True)
    monkeypatch.setattr(flashinfer_moe, "_kernel", lambda: reference)


def test_the_contract_wants_up_rows_first():
    ex = _experts(4, 32, 16)
    x, w, ids = _routed(7, 4, 2, 32)
    want = ex(x, w, ids)  # the grouped torch path: gate rows first
    got = reference(x, ids.to(torch.int32), w, up_first(ex.w13.data), ex.w2.data, x.dtype)
    assert torch.allclose(got, want, atol=1e-5)
    as_stored = reference(x, ids.to(torch.int32), w, ex.w13.data, ex.w2.data, x.dtype)
    assert not torch.allclose(as_stored, want, atol=1e-2)  # unswapped, the kernel computes another layer
    assert torch.equal(up_first(up_first(ex.w13.data)), ex.w13.data)


def test_a_layer_through_the_flashinfer_branch_equals_the_torch_path(as_if_flashinfer):
    ex = _experts(8, 32, 16)
    x, w, ids = _routed(11, 8, 2, 32)
    stored = ex.w13.data.clone()
    with torch.no_grad():
        want = FusedExperts.forward_per_token(ex, x, w, ids)  # the naive loop, before any swap
    assert torch.allclose(ex(x, w, ids), want, atol=1e-5)
    assert ex.up_first and torch.equal(ex.w13.data, up_first(stored))
    assert torch.allclose(ex(x, w, ids), want, atol=1e-5)  # swapped once, not back again
    assert torch.allclose(ex.expert(3, x[:2]), _experts(8, 32, 16).expert(3, x[:2]), atol=1e-6)


def test_expert_parallel_ranks_shares_add_up(as_if_flashinfer):
    whole = _experts(8, 32, 16)
    x, w, ids = _routed(9, 8, 2, 32, seed=3)
    want = whole.forward_per_token(x, w, ids)
    total = torch.zeros_like(x)
    for rank in range(4):
        first, end = expert_range(8, rank, 4)
        part = FusedExperts(end - first, 32, 16, first, num_slots=8)
        part.w13.data, part.w2.data = whole.w13.data[first:end].clone(), whole.w2.data[first:end].clone()
        total += part(x, w, ids)
    assert torch.allclose(total, want, atol=1e-5)


def test_uneven_shares_are_refused():
    ex = _experts(3, 32, 16, first=3, num_slots=8)
    x, w, ids = _routed(2, 8, 2, 32)
    with pytest.raises(ValueError, match="not one of even ranks' shares"):
        fused_experts(x, ex.w13.data, ex.w2.data, w, ids, ex.first, ex.num_slots, kernel=reference)


def test_bf16_experts_through_the_branch(as_if_flashinfer):
    ex = _experts(4, 64, 32, dtype=torch.bfloat16)
    x, w, ids = _routed(5, 4, 2, 64)
    x = x.bfloat16()
    want = ex.forward_per_token(x, w, ids).float()
    got = ex(x, w, ids)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want, atol=3e-2, rtol=3e-2)


def test_never_on_cpu_tensors():
    assert not usable(torch.zeros(2, 2, dtype=torch.bfloat16))
