"""Mixture-of-experts models over CPU ranks (``parallel.executor=mp``):
with tensor parallelism every rank holds a slice of each expert, with
expert parallelism (``parallel.enable_expert_parallel``) whole experts
split over the ranks; either way the same greedy tokens and logprobs as
one rank, for Qwen3-MoE and Mixtral."""

import pytest

from tests.integration.test_tensor_parallel import PROMPTS, assert_same, generate

TINY_MOE = ["+profile=cpu", "model=tiny_random_moe", "cache.kv_cache_memory_gib=0.05"]
MIXTRAL = ["model.architecture=MixtralForCausalLM", "model.mlp_only_layers=[]", "model.qk_norm=false",
           "model.intermediate_size=32"]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def variant(request):
    overrides = TINY_MOE + (MIXTRAL if request.param == "mixtral" else [])
    return overrides, generate(overrides, PROMPTS, 16)[0]


@pytest.mark.parametrize("tp,ep,pp", [(2, False, 1), (2, True, 1), (4, True, 1), (2, True, 2)],
                         ids=["tp2-sliced", "ep2", "ep4", "ep2-pp2"])
def test_moe_ranks_give_the_tokens_of_one_rank(variant, tp, ep, pp):
    overrides, reference = variant
    outs, llm = generate([*overrides, f"parallel.tensor_parallel_size={tp}", f"parallel.pipeline_parallel_size={pp}",
                          f"parallel.enable_expert_parallel={str(ep).lower()}"], PROMPTS, 16)
    assert len(llm.engine.runner.pids) == tp * pp
    assert_same(outs, reference)
