"""The Triton fused mixture-of-experts (the GPU profiles' sparse layers)
against the grouped torch path, under the Triton interpreter on CPU
(TRITON_INTERPRET=1, set before the kernel module is imported)."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from appliance.kernels.registry import triton_interpreter_on  # noqa: E402
from appliance.kernels.triton_moe import align_by_expert, fused_experts  # noqa: E402
from appliance.models.layers.moe import FusedExperts, expert_range, route  # noqa: E402

assert triton_interpreter_on()


def test_pairs_are_aligned_in_blocks_of_one_expert():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 1]])
    sorted_ids, block_experts = align_by_expert(ids, 0, 4, 4)
    p = ids.numel()
    assert block_experts.tolist() == [0, 1, 2, 3]
    assert sorted_ids.view(4, 4).tolist() == [[3, 6, p, p], [1, 2, 7, p], [5, p, p, p], [0, 4, p, p]]
    sorted_ids, block_experts = align_by_expert(ids, 2, 2, 2)  # a rank holding experts 2 and 3
    assert block_experts.tolist() == [0, 1] and sorted_ids.tolist() == [5, p, 0, 4]


def _experts(e, h, i, first=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    ex = FusedExperts(e, h, i, first)
    ex.w13.data = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    ex.w2.data = torch.randn(e, h, i, generator=g) / i ** 0.5
    return ex


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(1, 8, 2, 64, 32), (13, 8, 2, 64, 48),
                                                                (40, 16, 4, 96, 64), (5, 4, 4, 32, 32)])
def test_fused_experts_equal_the_grouped_torch_path(tokens, experts, top_k, hidden, inter):
    g = torch.Generator().manual_seed(tokens)
    ex = _experts(experts, hidden, inter)
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, True)
    got = fused_experts(x, ex.w13, ex.w2, weights, ids)
    assert torch.allclose(got, ex(x, weights, ids), atol=1e-5, rtol=1e-5)


def test_a_ranks_experts_only():
    g = torch.Generator().manual_seed(1)
    whole = _experts(8, 64, 32)
    x = torch.randn(9, 64, generator=g)
    weights, ids = route(torch.randn(9, 8, generator=g), 2, True)
    total = torch.zeros_like(x)
    for rank in range(2):
        first, end = expert_range(8, rank, 2)
        total += fused_experts(x, whole.w13[first:end], whole.w2[first:end], weights, ids, first)
    assert torch.allclose(total, whole(x, weights, ids), atol=1e-5, rtol=1e-5)


def test_a_rank_no_row_was_routed_to_returns_no_rows():
    """Under expert parallelism a small decode batch may route nothing to a rank."""
    ex = _experts(8, 64, 32)
    x = torch.zeros(0, 64)
    got = fused_experts(x, ex.w13, ex.w2, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert got.shape == (0, 64) and got.dtype == x.dtype


def test_bf16_inputs_stay_close():
    g = torch.Generator().manual_seed(2)
    ex = _experts(8, 64, 32)
    x = torch.randn(6, 64, generator=g)
    weights, ids = route(torch.randn(6, 8, generator=g), 2, True)
    got = fused_experts(x.bfloat16(), ex.w13.bfloat16(), ex.w2.bfloat16(), weights, ids).float()
    ref = ex(x, weights, ids)
    assert (got - ref).norm() / ref.norm() < 2e-2


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_a_model_through_the_kernel_gives_hfs_tokens(monkeypatch, variant):
    """The tiny Qwen3-MoE and Mixtral on the torch path with every sparse
    layer's experts run by the kernel, as on a GPU: greedy, token for token
    against Hugging Face's model."""
    from appliance import LLM
    from appliance.kernels import triton_moe
    from tests.model_helpers import hf_greedy
    from tests.unit.test_moe import BASE, MAX_NEW, VARIANTS, _greedy

    rows = []

    def through_the_kernel(self, x, weights, ids):
        rows.append(x.shape[0])
        return triton_moe.fused_experts(x, self.w13, self.w2, weights, ids, self.first)

    monkeypatch.setattr(FusedExperts, "forward", through_the_kernel)
    llm = LLM(overrides=BASE + VARIANTS[variant] + ["attention.backend=torch_sdpa"])
    ids, got = _greedy(llm)
    assert rows and max(rows) > 1  # prefills and decodes went through it
    for p_ids, g in zip(ids, got):
        assert g == hf_greedy(llm, p_ids, MAX_NEW)
