"""Mixture-of-experts models (Qwen3-MoE, Mixtral): token parity with
Hugging Face transformers through the torch and native paths, router ties,
grouped expert execution, int8/int4 experts, checkpoint facts and the
config rules."""

import json
import shutil

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.config.compose import resolve
from appliance.config.hf_facts import hf_facts
from appliance.config.plan import format_plan, make_plan
from appliance.config.sizes import parameter_counts, sparse_layers
from appliance.config.validate import validate
from appliance.models.loader import resolve_model_folder
from appliance.models.layers.moe import FusedExperts, dispatch_order, expert_range, route
from tests.kernel_helpers import float_rows
from tests.model_helpers import PROMPTS, check_logprobs_close, greedy_top_logprobs, hf_greedy, hf_greedy_top_logprobs

MAX_NEW = 12
BASE = ["+profile=cpu", "model=tiny_random_moe"]
MIXTRAL = ["model.architecture=MixtralForCausalLM", "model.mlp_only_layers=[]", "model.qk_norm=false",
           "model.intermediate_size=32"]
VARIANTS = {"qwen3_moe": [], "mixtral": MIXTRAL}


def _greedy(llm, prompts=PROMPTS):
    ids = [llm.tokenizer.encode(p) for p in prompts]
    outs = llm.generate(ids, SamplingParams(max_tokens=MAX_NEW, temperature=0), use_tqdm=False)
    return ids, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", ["cpu_native", "torch_sdpa"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("scenario", [[], ["scheduler.max_num_batched_tokens=16", "scheduler.max_num_seqs=4"]],
                         ids=["default", "chunked_prefill"])
def test_greedy_matches_hf_token_for_token(variant, backend, scenario):
    llm = LLM(overrides=BASE + VARIANTS[variant] + scenario + [f"attention.backend={backend}"])
    runner = llm.engine.runner
    assert runner.uses_native_forward == (backend == "cpu_native")
    assert [layer.sparse for layer in runner.model.model.layers] == ([True, False, True] if variant == "qwen3_moe"
                                                                     else [True] * 3)
    ids, got = _greedy(llm)
    for p_ids, g in zip(ids, got):
        assert g == hf_greedy(llm, p_ids, MAX_NEW)


@pytest.mark.parametrize("backend", ["cpu_native", "torch_sdpa"])
def test_bf16_greedy_is_close_to_hf_bf16(backend):
    llm = LLM(overrides=BASE + ["model.dtype=bfloat16", f"attention.backend={backend}"])
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    ours = greedy_top_logprobs(llm, ids, MAX_NEW, 5)
    ref = [hf_greedy_top_logprobs(llm, p, MAX_NEW, 5, torch.bfloat16) for p in ids]
    check_logprobs_close(ours, ref)
    assert llm.engine.runner.model.model.layers[0].mlp.gate.weight.dtype == torch.float32  # routers stay fp32


@pytest.fixture(scope="module")
def tied_router_folder(tmp_path_factory):
    """The tiny Qwen3-MoE with every router row of layer 0 equal: each token's
    eight probabilities tie, so which two experts it gets is the tie rule's."""
    from safetensors.torch import load_file, save_file

    src = resolve_model_folder(resolve(BASE).cfg.model)
    out = tmp_path_factory.mktemp("tied") / "model"
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    gate = tensors["model.layers.0.mlp.gate.weight"]
    tensors["model.layers.0.mlp.gate.weight"] = gate[:1].expand_as(gate).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("backend", ["cpu_native", "torch_sdpa"])
def test_router_ties_fall_as_in_hf(tied_router_folder, backend):
    llm = LLM(overrides=["+profile=cpu", "model=tiny_random_moe", f"model.path={tied_router_folder}",
                         f"attention.backend={backend}"])
    ids, got = _greedy(llm, PROMPTS[:4])
    for p_ids, g in zip(ids, got):
        assert g == hf_greedy(llm, p_ids, MAX_NEW)


@pytest.mark.parametrize("method", ["int8_wo", "w8a8_int8", "int4_wo"])
def test_quantized_experts_native_matches_torch_path(method):
    group = ["quantization.group_size=32"] if method == "int4_wo" else []
    runs = {}
    for backend in ("cpu_native", "torch_sdpa"):
        llm = LLM(overrides=BASE + [f"quantization={method}", f"attention.backend={backend}"] + group)
        experts = llm.engine.runner.model.model.layers[0].mlp.experts
        assert experts.quantized == method and experts.w13.numel() == 0  # float experts freed
        ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        with float_rows():  # weight-only experts: fp32 rows in the native GEMMs, as in the torch path
            runs[backend] = greedy_top_logprobs(llm, ids, MAX_NEW, 5)
    check_logprobs_close(runs["cpu_native"], runs["torch_sdpa"], "native", "torch")


def test_route_renormalizes_the_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    w, ids = route(logits, 2, renormalize=True)
    assert ids.tolist() == [[0, 1], [2, 0]] or ids[1, 0] == 2
    assert torch.allclose(w.sum(-1), torch.ones(2))
    raw, _ = route(logits, 2, renormalize=False)
    assert torch.allclose(raw, torch.softmax(logits, -1).topk(2).values)


def test_dispatch_order_groups_pairs_by_expert_stably():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 1]])
    tokens, positions, counts = dispatch_order(ids, 0, 4)
    assert counts == [2, 3, 1, 2]
    assert tokens.tolist() == [1, 3, 0, 1, 3, 2, 0, 2]
    assert ids.reshape(-1)[positions].tolist() == [0, 0, 1, 1, 1, 2, 3, 3]
    tokens, _, counts = dispatch_order(ids, 2, 2)  # a rank holding experts 2 and 3
    assert counts == [1, 2] and tokens.tolist() == [2, 0, 2]


def test_grouped_experts_equal_the_per_token_loop_and_split_over_ranks():
    torch.manual_seed(0)
    whole = FusedExperts(8, 32, 16)
    torch.nn.init.normal_(whole.w13)
    torch.nn.init.normal_(whole.w2)
    x = torch.randn(20, 32)
    w, ids = route(torch.randn(20, 8), 2, True)
    grouped = whole(x, w, ids)
    assert torch.allclose(grouped, whole.forward_per_token(x, w, ids), atol=1e-4)
    parts = []
    for rank in range(2):  # expert parallelism: each rank's experts, their sums added
        first, end = expert_range(8, rank, 2)
        part = FusedExperts(end - first, 32, 16, first)
        part.w13.data, part.w2.data = whole.w13.data[first:end], whole.w2.data[first:end]
        parts.append(part(x, w, ids))
    assert torch.allclose(parts[0] + parts[1], grouped, atol=1e-5)


def test_checkpoint_facts_of_qwen3_moe_and_mixtral():
    qwen = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 64,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
            "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    facts = {f.key: f.value for f in hf_facts(qwen)[0]}
    assert (facts["num_experts"], facts["num_experts_per_tok"], facts["moe_intermediate_size"]) == (8, 2, 32)
    assert facts["norm_topk_prob"] and facts["decoder_sparse_step"] == 2 and facts["mlp_only_layers"] == [3]
    assert facts["qk_norm"]
    mixtral = {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
               "intermediate_size": 32, "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 64,
               "num_local_experts": 4, "num_experts_per_tok": 2}
    facts = {f.key: f.value for f in hf_facts(mixtral)[0]}
    assert (facts["num_experts"], facts["moe_intermediate_size"], facts["norm_topk_prob"]) == (4, 32, True)
    dense = {f.key: f.value for f in hf_facts({**mixtral, "architectures": ["LlamaForCausalLM"]})[0]}
    assert dense["num_experts"] == 0 and dense["mlp_only_layers"] == []
    assert hf_facts({**qwen, "moe_intermediate_size": None})[1] == ["config.json has no moe_intermediate_size"]


def test_a_moe_checkpoint_folder_resolves_its_facts(tmp_path):
    src = resolve_model_folder(resolve(BASE).cfg.model)
    cfg = resolve(["+profile=cpu", f"model.path={src}"]).cfg  # the default model option, overwritten by the folder
    m = cfg.model
    assert (m.architecture, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (
        "Qwen3MoeForCausalLM", 8, 2, 32)
    assert list(m.mlp_only_layers) == [1] and sparse_layers(m) == [0, 2]


def test_sparse_layers_and_parameter_counts():
    cfg = resolve(["+profile=cpu", "model=qwen3_30b_a3b"], check=False).cfg
    counts = parameter_counts(cfg.model)
    assert counts["total"] / 1e9 == pytest.approx(30.53, rel=0.01)
    assert counts["active"] / 1e9 == pytest.approx(3.35, rel=0.01)  # "A3B"
    m = resolve(BASE + ["model.decoder_sparse_step=2", "model.mlp_only_layers=[]"]).cfg.model
    assert sparse_layers(m) == [1]


def test_plan_shows_experts_per_rank_and_reads_only_the_active_ones():
    base = ["+profile=h100_bf16", "model=qwen3_30b_a3b"]
    one = make_plan(resolve(base).cfg)
    assert one.experts["experts_per_rank"] == 128 and one.experts["expert_parallel_size"] == 1
    assert one.decode_roofline_tok_s > 5 * 3350e9 / one.weight_bytes_per_device  # a token reads 8 of 128 experts
    ep = make_plan(resolve(base + ["parallel=dp8_ep"]).cfg)
    assert ep.experts["experts_per_rank"] == 16 and ep.experts["expert_parallel_size"] == 8
    assert ep.experts["expert_bytes_per_rank"] == one.experts["expert_bytes_per_rank"] // 8
    assert ep.weight_bytes_per_device < one.weight_bytes_per_device / 4
    redundant = make_plan(resolve(base + ["parallel=dp8_ep", "parallel.eplb.enabled=true",
                                          "parallel.eplb.num_redundant_experts=8"]).cfg)
    assert redundant.experts["redundant_experts"] == 8 and redundant.experts["experts_per_rank"] == 17  # 136 slots
    assert redundant.experts["expert_bytes_per_rank"] == one.experts["expert_bytes_per_rank"] * 17 // 128
    assert ", 8 redundant;" in format_plan(redundant)


@pytest.mark.parametrize("override,message", [
    ("model=tiny_random model.num_experts_per_tok=2", "has no effect on a dense model"),
    ("model=tiny_random parallel=dp2 parallel.enable_expert_parallel=true", "needs a mixture-of-experts model"),
    ("model=tiny_random_moe model.num_experts_per_tok=9", "must be in 1..8"),
    ("model=tiny_random_moe model.architecture=LlamaForCausalLM", "which is dense"),
    ("model=tiny_random_moe model.mlp_only_layers=[5]", "outside 0..2"),
    ("model=tiny_random_moe model.architecture=MixtralForCausalLM model.qk_norm=false",
     "must equal model.intermediate_size"),
    ("model=tiny_random_moe parallel=tp3 parallel.enable_expert_parallel=true", "do not split evenly"),
    ("model=tiny_random_moe parallel=tp3", "moe_intermediate_size=32 is not divisible"),
    ("model=tiny_random_moe parallel.eplb.enabled=true", "set parallel.enable_expert_parallel=true"),
    ("model=tiny_random_moe parallel.eplb.num_redundant_experts=2", "has no effect with parallel.eplb.enabled=false"),
])
def test_moe_config_problems(override, message):
    cfg = resolve(["+profile=cpu", *override.split()], check=False).cfg
    assert any(message in p for p in validate(cfg)), validate(cfg)


def test_tiny_moe_checkpoint_is_in_hub_layout():
    folder = resolve_model_folder(resolve(BASE + MIXTRAL).cfg.model)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names  # Mixtral's names load as ours
    assert json.loads((folder / "config.json").read_text())["num_local_experts"] == 8


@pytest.mark.parametrize("ep", [False, True], ids=["tp-slices", "ep-whole-experts"])
def test_a_rank_reads_only_its_experts_or_its_slice_of_each(ep):
    """Rank 1 of 2: with expert parallelism experts 4..7 whole, else every
    expert's second half of the intermediate rows; never another's tensors."""
    from safetensors import safe_open

    from appliance.kernels.torch_sdpa import TorchSDPABackend
    from appliance.models.layers.parallel import TensorParallel
    from appliance.models.loader import load_model
    from appliance.models.layers.moe import ExpertParallel

    m = resolve(BASE).cfg.model
    tp = TensorParallel(1, 2, comm=None)
    model, _, folder = load_model(m, TorchSDPABackend(2, 1, 16, 0.25, "auto"), torch.float32, tp=tp,
                                  ep=ExpertParallel(1, 2, comm=None) if ep else None)
    experts = model.model.layers[0].mlp.experts
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        def ckpt(e, part):
            return f.get_tensor(f"model.layers.0.mlp.experts.{e}.{part}.weight")

        if ep:
            assert (experts.first, experts.num_local, experts.inter) == (4, 4, 32)
            for e in range(4):
                assert torch.equal(experts.w13[e], torch.cat([ckpt(4 + e, "gate_proj"), ckpt(4 + e, "up_proj")]))
                assert torch.equal(experts.w2[e], ckpt(4 + e, "down_proj"))
        else:
            assert (experts.first, experts.num_local, experts.inter) == (0, 8, 16)
            for e in range(8):
                assert torch.equal(experts.w13[e], torch.cat([ckpt(e, "gate_proj")[16:], ckpt(e, "up_proj")[16:]]))
                assert torch.equal(experts.w2[e], ckpt(e, "down_proj")[:, 16:])
        assert torch.equal(model.model.layers[0].mlp.gate.weight, f.get_tensor("model.layers.0.mlp.gate.weight"))


def _dispatching_rank(rank, port, q):
    import pickle
    from types import SimpleNamespace

    import torch.distributed as dist

    from appliance.models.layers.moe import ExpertParallel, SparseMoe
    from appliance.worker.rank_group import TorchDistributedComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    arch = SimpleNamespace(num_experts_per_tok=2, norm_topk_prob=True, num_experts=8, num_physical_experts=None,
                           hidden_size=16, moe_intermediate_size=8, scoring_func="softmax", n_group=1, topk_group=1,
                           routed_scaling_factor=1.0, shared_expert_intermediate_size=0, shared_expert_gate=False)
    g = torch.Generator().manual_seed(0)
    gate, w13, w2 = torch.randn(8, 16, generator=g), torch.randn(8, 16, 16, generator=g), torch.randn(8, 16, 8, generator=g)
    rows = [torch.randn(n, 16, generator=g) for n in (5, 3)]  # each core's own rows
    full = SparseMoe(arch)
    ranked = SparseMoe(arch, ep=ExpertParallel(rank, 2, TorchDistributedComm(2), replicated=False))
    for layer in (full, ranked):
        first, n = layer.experts.first, layer.experts.num_local
        layer.gate.weight.data.copy_(gate)
        layer.experts.w13.data.copy_(w13[first:first + n])
        layer.experts.w2.data.copy_(w2[first:first + n])
    assert ranked.ep.dispatches
    mine = rows[rank]
    out = [ranked.dispatch(mine), ranked.gather(mine), ranked.exchange(torch.empty(0, 16)), full(mine)]
    q.put((rank, pickle.dumps(out)))
    dist.destroy_process_group()


def test_all_to_all_dispatch_gives_each_core_its_rows_experts():
    """Two cores' ranks over gloo, four experts each, each core its own rows:
    sending each (token, expert) pair to the rank holding the expert and
    back (``SparseMoe.dispatch``) gives what one rank holding every expert
    computes for those rows, as the gathering exchange does; a core with no
    rows takes part and gets none."""
    import multiprocessing as mp
    import pickle

    from appliance.worker.rank_group import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    q = ctx.Queue()
    procs = [ctx.Process(target=_dispatching_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict((r, pickle.loads(b)) for r, b in (q.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
    for rank in (0, 1):
        dispatched, gathered, idle, want = results[rank]
        assert torch.allclose(dispatched, want, atol=1e-5) and torch.allclose(gathered, want, atol=1e-5)
        assert idle.shape == (0, 16)
