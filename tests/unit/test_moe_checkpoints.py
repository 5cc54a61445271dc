"""AWQ and GPTQ mixture-of-experts checkpoints (every expert's projections
quantized, routers float, as Qwen3-MoE GPTQ/AWQ releases are): each
expert's gate|up and down load as linears of the checkpoint's own blocks,
near that expert's float weights (and no other's), and the native forward
generates what the torch layer path does from the same blocks."""

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.config.compose import resolve
from appliance.models.loader import resolve_model_folder

TINY_MOE = ["+profile=cpu", "model=tiny_random_moe", "cache.kv_cache_memory_gib=0.02", "model.dtype=float32"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from appliance.models.int4_checkpoints import write_checkpoint

    plain = resolve_model_folder(resolve(TINY_MOE).cfg.model)
    root = tmp_path_factory.mktemp("moe-int4")
    out = {}
    for method, bits in (("awq", 4), ("gptq", 4), ("gptq", 8)):
        out[f"{method}{bits}"] = root / f"{method}{bits}"
        write_checkpoint(plain, out[f"{method}{bits}"], method, bits, 32)
    return plain, out


@pytest.mark.parametrize("variant", ["awq4", "gptq4", "gptq8"])
def test_experts_load_as_their_blocks_and_run_natively(checkpoints, variant):
    from safetensors.torch import load_file

    from appliance.kernels import cpu_native
    from appliance.models.quant import GroupedInt8Linear, Int4WeightOnlyLinear, dequantize_int4

    plain, folders = checkpoints
    float_weights = load_file(str(plain / "model.safetensors"))
    model = [*TINY_MOE, f"model.path={folders[variant]}"]
    torch_path = LLM(overrides=[*model, "attention.backend=torch_sdpa"])
    runner = torch_path.engine.runner
    assert not runner.uses_native_forward
    for i, layer in enumerate(runner.model.model.layers):
        if not layer.sparse:
            continue
        experts = layer.mlp.experts
        assert experts.quantized == variant[:-1]
        for e in experts.slot_experts:
            gate_up, down = experts.projections(e)
            assert isinstance(gate_up, GroupedInt8Linear if variant == "gptq8" else Int4WeightOnlyLinear)
            pre = f"model.layers.{i}.mlp.experts."
            for lin, want in [(gate_up, torch.cat([float_weights[f"{pre}{e}.gate_proj.weight"],
                                                   float_weights[f"{pre}{e}.up_proj.weight"]])),
                              (down, float_weights[f"{pre}{e}.down_proj.weight"])]:
                got = dequantize_int4(getattr(lin, lin.weight_attr), lin.q_scale, lin.q_min)
                other = float_weights[f"{pre}{(e + 1) % 8}.down_proj.weight"] if lin is down else None
                assert (got - want).norm() / want.norm() < 0.1, (variant, i, e)  # its own expert, rounded
                if other is not None:
                    assert (got - other).norm() / other.norm() > 0.5  # not a neighbour's
    prompts = [[5, 77, 301, 12, 9], [400, 2, 2, 2, 2, 2, 17, 250], [1, 300]]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    ref = [o.outputs[0] for o in torch_path.generate(prompts, params, use_tqdm=False)]
    bf16 = cpu_native.bf16_dot()
    cpu_native.bf16_dot(False)  # fp32 rows in the native GEMMs, as the torch path computes them
    try:
        native = LLM(overrides=model)
        assert native.engine.runner.uses_native_forward
        outs = [o.outputs[0] for o in native.generate(prompts, params, use_tqdm=False)]
    finally:
        cpu_native.bf16_dot(bf16)
    for a, b in zip(outs, ref):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


def test_checkpoint_experts_split_over_ranks_are_refused(checkpoints):
    from appliance.errors import ConfigError

    with pytest.raises(ConfigError, match="expert blocks split over ranks are not built yet"):
        LLM(overrides=[*TINY_MOE, f"model.path={checkpoints[1]['gptq4']}", "parallel=tp2"])
