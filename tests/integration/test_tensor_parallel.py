"""Tensor and pipeline parallelism on CPU ranks (``parallel.executor=mp``,
shared-memory or gloo collectives): the same greedy tokens and logprobs as
one rank, KV heads split or replicated, layers split into stages (evenly
or as ``pp_layer_partition`` says), a shard of each tensor read per rank,
the server serving a layout, and a rank that dies or hangs ending the
engine within the timeout with no process left behind."""

import dataclasses
import os
import signal
import time

import httpx
import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.engine.interfaces import EngineDeadError
from appliance.models.arch import ModelArch
from appliance.models.layers.parallel import fused_shard_rows, padded_vocab, shard_arch, tensor_shard
from appliance.worker.placement import cpu_share, numa_nodes, parse_cpulist
from tests.integration.server_helpers import ServerProcess
from tests.model_helpers import TINY_VARIANTS, check_logprobs_close, greedy_top_logprobs, write_fp8_checkpoint

TINY = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05", "model.dtype=float32"]
PROMPTS = ["Hello there", "The capital of France is", "1 2 3 4 5", "Once upon a time, in a land far away",
           "a", "Tensor parallel ranks", "def f(x):\n    return", "zzz zzz zzz zzz zzz"]


def generate(overrides, prompts, max_tokens):
    llm = LLM(overrides=overrides)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1, ignore_eos=True)
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)], llm
    finally:
        close = getattr(llm.engine.runner, "close", None)
        if close is not None:
            close()


def assert_same(ours, ref):
    for a, b in zip(ours, ref):
        assert a.token_ids == b.token_ids
        assert [lp.token_id for lp in a.logprobs] == a.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


@pytest.fixture(scope="module")
def tiny_reference():
    return generate(TINY, PROMPTS, 24)[0]


@pytest.mark.parametrize("tp,pp,collectives", [
    (2, 1, "shm"), (4, 1, "shm"), (2, 1, "gloo"),  # 4 ranks over 2 KV heads: each KV head on two ranks
    (1, 2, "shm"), (2, 2, "shm"),  # two stages of one layer, alone or each over two ranks
    pytest.param(2, 2, "gloo", marks=pytest.mark.slow),
])
def test_tiny_model_tokens_equal_one_rank(tiny_reference, tp, pp, collectives):
    outs, llm = generate([*TINY, f"parallel.tensor_parallel_size={tp}", f"parallel.pipeline_parallel_size={pp}",
                          f"parallel.cpu_collectives={collectives}"], PROMPTS, 24)
    assert llm.deployment.layout.executor == "mp" and len(llm.engine.runner.pids) == tp * pp
    assert llm.engine.runner.collectives == collectives
    assert_same(outs, tiny_reference)


@pytest.mark.parametrize("variant,tp,pp", [
    ("gemma3", 2, 1), ("qwen2_window", 1, 2), ("olmo2", 4, 1), ("phi3", 2, 1), ("gpt_oss", 2, 1), ("llama4", 1, 2),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("gemma3", 1, 2), ("gemma2", 2, 1), ("gemma2", 1, 2), ("qwen2_window", 2, 1), ("granite", 2, 1),
        ("granite", 1, 2), ("olmo2", 2, 1), ("olmo2", 1, 2), ("phi3", 4, 1), ("gpt_oss", 1, 2), ("glm4_moe", 1, 2),
        ("qwen2_moe", 1, 2)]),
])
def test_layer_by_layer_models_over_ranks_equal_one_rank(variant, tp, pp):
    """Models with a full-attention and a sliding-window or chunked layer (two KV-cache groups), their windows
    outgrown (Llama 4's chunks ended, its stages one group each),
    Granite's multipliers, OLMo 2's q/k norms over all heads (a rank's share of them; with 4 ranks over 2 KV
    heads, each head on two) and Phi-3's fused q/k/v and gate/up tensors (a rank's rows of each part): each
    rank's groups over its KV heads, or each stage holding one layer (one group's)."""
    base = [*TINY, *TINY_VARIANTS[variant]]
    ref = generate(base, PROMPTS, 24)[0]
    outs, llm = generate([*base, f"parallel.tensor_parallel_size={tp}", f"parallel.pipeline_parallel_size={pp}"],
                         PROMPTS, 24)
    assert len(llm.engine.runner.pids) == tp * pp
    assert_same(outs, ref)


@pytest.mark.parametrize("variant,experts", [("glm4_moe", "sliced"), ("glm4_moe", "whole"), ("glm4_moe", "balanced"),
                                             ("qwen2_moe", "sliced"), ("qwen2_moe", "whole")])
def test_shared_experts_over_ranks_equal_one_rank(variant, experts):
    """GLM-4.5's DeepSeek-V3 routing and Qwen2-MoE's gated shared expert over two ranks: the router on both, each
    rank's slice of every expert or its whole experts (moved by the load balancer every 5 steps, 2 redundant
    slots), and its rows of the shared expert (a width of its own, split as the dense MLP's is)."""
    base = [*TINY, *TINY_VARIANTS[variant]]
    ref = generate(base, PROMPTS, 24)[0]
    eplb = ["parallel.eplb.enabled=true", "parallel.eplb.num_redundant_experts=2", "parallel.eplb.step_interval=5",
            "parallel.eplb.window_size=5"] if experts == "balanced" else []
    outs, llm = generate([*base, "parallel.tensor_parallel_size=2",
                          f"parallel.enable_expert_parallel={experts != 'sliced'}", *eplb], PROMPTS, 24)
    assert len(llm.engine.runner.pids) == 2
    assert_same(outs, ref)
    assert (llm.engine.last_stats.eplb_rebalances > 0) == (experts == "balanced")


def test_gpt_oss_experts_split_whole_over_ranks_equal_one_rank():
    """Expert parallelism over one engine core's two ranks: each holds two of gpt-oss's four experts whole, with
    their biases, and its heads and sinks; the router on both."""
    base = [*TINY, *TINY_VARIANTS["gpt_oss"]]
    ref = generate(base, PROMPTS, 24)[0]
    outs, llm = generate([*base, "parallel.tensor_parallel_size=2", "parallel.enable_expert_parallel=true"],
                         PROMPTS, 24)
    assert len(llm.engine.runner.pids) == 2
    assert_same(outs, ref)


def test_bf16_ranks_stay_close_to_one_rank():
    """bf16 on every CPU (native or emulated): two ranks against one under the closeness rule."""
    bf16 = [*TINY[:-1], "model.dtype=bfloat16"]
    prompt_ids = [[1, 2, 3, 4], [7, 100, 42], [300, 5, 5, 5, 9]]

    def run(overrides):
        llm = LLM(overrides=overrides)
        try:
            return greedy_top_logprobs(llm, prompt_ids, 16, 5)
        finally:
            getattr(llm.engine.runner, "close", lambda: None)()

    check_logprobs_close(run([*bf16, "parallel=tp2"]), run(bf16), "tp2", "one rank")


SMOL = ["+profile=cpu", "quantization=none", "model.dtype=float32", "cache.kv_cache_memory_gib=0.2",
        "model.max_model_len=1024"]


@pytest.fixture(scope="module")
def smollm2_reference():
    return generate(SMOL, PROMPTS[:4], 16)[0]


@pytest.mark.parametrize("layout", [
    ["parallel=tp3"],  # 9 heads and 3 KV heads over three ranks (the shipped tp3 option)
    ["parallel=pp2", "parallel.pp_layer_partition=[13,17]"],  # 30 layers over two stages, split unevenly
])
def test_smollm2_tokens_equal_one_rank(smollm2_reference, layout):
    """SmolLM2-135M, fp32: the same greedy tokens and logprobs as one rank."""
    outs, _ = generate([*SMOL, *layout], PROMPTS[:4], 16)
    assert_same(outs, smollm2_reference)


@pytest.fixture(scope="module")
def tiny_quantized_checkpoints(tmp_path_factory):
    """The tiny model written as AWQ, GPTQ and 8-bit GPTQ checkpoints (groups of 32), and as fp8 ones
    (per-tensor scales, and per 32 x 32 block)."""
    from appliance.config.compose import resolve
    from appliance.models.int4_checkpoints import write_checkpoint
    from appliance.models.loader import resolve_model_folder

    root = tmp_path_factory.mktemp("tp-int4")
    plain = resolve_model_folder(resolve(TINY, check=False).cfg.model)
    folders = {}  # variant -> (folder, method)
    for method, bits in (("awq", 4), ("gptq", 4), ("gptq", 8)):
        folders[f"{method}{bits}"] = root / f"{method}{bits}", method
        write_checkpoint(plain, root / f"{method}{bits}", method, bits, 32)
    folders["fp8"] = root / "fp8", "fp8"
    write_fp8_checkpoint(plain, root / "fp8")
    folders["fp8-block"] = root / "fp8-block", "fp8"
    write_fp8_checkpoint(plain, root / "fp8-block", block=32)
    return folders


@pytest.mark.parametrize("variant,layout", [
    ("awq4", ["parallel=tp2"]), pytest.param("gptq4", ["parallel=tp2"], marks=pytest.mark.slow),
    ("gptq8", ["parallel=tp2"]), ("fp8", ["parallel=tp2"]),
    ("fp8-block", ["parallel=tp2"]),
    ("awq4", ["parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2"]),
])
def test_quantized_checkpoints_split_over_ranks_equal_one_rank(tiny_quantized_checkpoints, variant, layout,
                                                              monkeypatch):
    """An AWQ, GPTQ or fp8 checkpoint's weights cut per rank (q heads and MLP
    rows by output, o_proj and down_proj by inputs, in whole groups) and per stage:
    the tokens and logprobs of the same checkpoint on one rank's torch layer
    path. The ranks' native linears keep fp32 rows on every CPU here
    (APPLIANCE_CPU_BF16_DOT=0 and APPLIANCE_CPU_INT8_ROWS=0, which the rank
    processes inherit): where the CPU has AVX512-BF16 or VNNI they would
    otherwise take batched int4 and grouped int8 rows through bf16 or int8
    dot products, which round the activations past this comparison's
    tolerance (the bf16 closeness rule covers that path)."""
    monkeypatch.setenv("APPLIANCE_CPU_BF16_DOT", "0")
    monkeypatch.setenv("APPLIANCE_CPU_INT8_ROWS", "0")
    folder, method = tiny_quantized_checkpoints[variant]
    model = [*TINY, f"model.path={folder}"]
    ref, _ = generate([*model, "attention.backend=torch_sdpa"], PROMPTS[:4], 16)
    outs, llm = generate([*model, *layout], PROMPTS[:4], 16)
    assert llm.resolved.cfg.quantization.method == method
    assert_same(outs, ref)


def test_a_draft_model_on_every_rank_keeps_the_targets_tokens(tiny_reference):
    """speculative=draft_model at tp2: each rank holds the whole draft and
    drafts alike; greedy output stays the target's."""
    draft = ["speculative=draft_model", "speculative.draft_model=tiny_random_draft",
             "speculative.num_speculative_tokens=3", "speculative.disable_by_batch_size=null"]
    outs, llm = generate([*TINY, *draft, "parallel=tp2"], PROMPTS[:4], 24)
    assert [o.token_ids for o in outs] == [o.token_ids for o in tiny_reference[:4]]
    assert llm.engine.stats().spec_drafts > 0


@pytest.mark.parametrize("spec", [
    ["speculative=ngram"],
    ["speculative=draft_model", "speculative.draft_model=tiny_random_draft", "speculative.num_speculative_tokens=3"],
], ids=["ngram", "draft_model"])
def test_speculation_over_pipeline_stages_keeps_the_targets_tokens(tiny_reference, spec):
    """Speculative decoding at tp2 x pp2: the last stage's ranks, which
    sample, propose the same drafts (the n-gram lookup over the same tokens,
    or a whole draft model on each), the stages verify them in one
    pipelined forward, and greedy output stays the target's."""
    outs, llm = generate([*TINY, *spec, "speculative.disable_by_batch_size=null", "parallel.tensor_parallel_size=2",
                          "parallel.pipeline_parallel_size=2"], PROMPTS[:4], 24)
    assert len(llm.engine.runner.pids) == 4
    assert [o.token_ids for o in outs] == [o.token_ids for o in tiny_reference[:4]]
    assert llm.engine.stats().spec_drafts > 0


def test_beams_over_stages_equal_one_rank():
    """Beam search at pp2: each stage copies the forks' blocks before its layers write, over pipelined steps
    (two in flight); the beams are one rank's."""
    small = [*TINY, "cache.block_size=4"]  # forks mid-block: copies
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=10)
    ref = [[o.token_ids for o in out.outputs] for out in LLM(overrides=small).generate(PROMPTS[:3], params,
                                                                                        use_tqdm=False)]
    llm = LLM(overrides=[*small, "parallel.pipeline_parallel_size=2"])
    try:
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    finally:
        llm.engine.runner.close()
    assert [[o.token_ids for o in out.outputs] for out in outs] == ref


def test_smollm2_gguf_blocks_split_over_three_ranks_equal_one_rank(monkeypatch):
    """The Q4_1 file's own blocks (quantization=gguf) cut over tp3, against one rank's torch layer path;
    fp32 rows in the ranks' int4 GEMMs on every CPU (see the quantized checkpoints' test)."""
    monkeypatch.setenv("APPLIANCE_CPU_BF16_DOT", "0")
    monkeypatch.setenv("APPLIANCE_CPU_INT8_ROWS", "0")
    gguf = [*SMOL, "quantization=gguf"]
    ref, _ = generate([*gguf, "attention.backend=torch_sdpa"], PROMPTS[:2], 8)
    outs, _ = generate([*gguf, "parallel=tp3"], PROMPTS[:2], 8)
    assert_same(outs, ref)


def test_one_rank_in_a_worker_process(tiny_reference):
    outs, llm = generate([*TINY, "parallel.executor=mp"], PROMPTS[:2], 24)
    assert len(llm.engine.runner.pids) == 1
    assert [o.token_ids for o in outs] == [o.token_ids for o in tiny_reference[:2]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_rank_that_dies_ends_the_engine_and_leaves_no_process():
    llm = LLM(overrides=[*TINY, "parallel=tp2", "parallel.step_timeout_s=20"])
    pids = llm.engine.runner.pids
    llm.engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True))
    llm.engine.step()
    os.kill(pids[1], signal.SIGKILL)
    t = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1"):
        for _ in range(500):
            llm.engine.step()
    assert time.monotonic() - t < 20
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_a_hung_rank_ends_the_engine_at_the_timeout():
    llm = LLM(overrides=[*TINY, "parallel=tp2", "parallel.step_timeout_s=3"])
    pids = llm.engine.runner.pids
    os.kill(pids[0], signal.SIGSTOP)  # rank 1 waits in a collective for a rank that never comes
    try:
        llm.engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        t = time.monotonic()
        with pytest.raises(EngineDeadError, match="step_timeout_s=3"):
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
        assert 2.5 < time.monotonic() - t < 15
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


@pytest.mark.parametrize("layout", ["parallel=tp2", "parallel=pp2"])
def test_served_layout_answers_as_one_rank(tiny_reference, layout):
    s = ServerProcess(*TINY[1:], layout)
    try:
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0,
                                                        "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tiny_reference[1].text
    finally:
        s.stop()


# -- the pieces ------------------------------------------------------------------------
def _projections(arch):
    """The linears of a model of ``arch``, as the loaders find them (built on the meta device: no weights)."""
    from appliance.models.layers.linear import Projections
    from appliance.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        return Projections(LlamaForCausalLM(arch, backend=None))


def test_each_rank_reads_its_rows_and_columns():
    arch = ModelArch("LlamaForCausalLM", 2, 64, 128, 4, 2, 16, 500, 1024, 1e4, 1e-5, True)
    lin = _projections(arch)
    assert padded_vocab(500, 2) == 512 and shard_arch(arch, 2).vocab_size == 256
    local = shard_arch(arch, 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (1, 1, 32)
    layer = "model.layers.1."
    assert tensor_shard(arch, 1, 2, layer + "self_attn.q_proj.weight", lin) == (0, 32, 64)
    assert tensor_shard(arch, 1, 2, layer + "self_attn.k_proj.weight", lin) == (0, 16, 32)
    # KV head 1, shared by ranks 2 and 3
    assert tensor_shard(arch, 3, 4, layer + "self_attn.v_proj.weight", lin) == (0, 16, 32)
    assert tensor_shard(arch, 2, 4, layer + "self_attn.v_proj.weight", lin) == (0, 16, 32)
    assert tensor_shard(arch, 1, 4, layer + "self_attn.k_proj.weight", lin) == (0, 0, 16)
    assert tensor_shard(arch, 1, 2, layer + "self_attn.o_proj.weight", lin) == (1, 32, 64)
    assert tensor_shard(arch, 1, 2, layer + "mlp.up_proj.weight", lin) == (0, 64, 128)
    assert tensor_shard(arch, 0, 2, layer + "mlp.down_proj.weight", lin) == (1, 0, 64)
    assert tensor_shard(arch, 1, 2, "model.embed_tokens.weight", lin) == (0, 256, 512)  # past 500: zero rows
    assert tensor_shard(arch, 1, 2, layer + "input_layernorm.weight", lin) is None
    # a fused projection (Phi-3's): each part's rows of the rank, in order; not one range
    assert fused_shard_rows(arch, 1, 2, layer + "self_attn.qkv_proj.weight", lin) == [
        (32, 64), (64 + 16, 64 + 32), (96 + 16, 96 + 32)]
    assert fused_shard_rows(arch, 3, 4, layer + "mlp.gate_up_proj.weight", lin) == [(96, 128), (128 + 96, 128 + 128)]
    assert fused_shard_rows(arch, 1, 2, layer + "self_attn.q_proj.weight", lin) is None
    with pytest.raises(ValueError, match="fused projection's rows of one tensor-parallel rank are cut for "
                                         "unquantized weights only"):
        tensor_shard(arch, 1, 2, layer + "self_attn.qkv_proj.weight", lin)


def test_quantized_blocks_are_cut_as_their_dense_weights():
    """shard_blocks: each rank's blocks dequantize to its tensor_shard of the
    whole dequantized weight; an LM head's rows past the vocabulary are zero;
    act-order row-parallel blocks and groups cut by a rank are refused."""
    from appliance.models.int4_checkpoints import quantize_zero_point
    from appliance.models.layers.parallel import shard_blocks
    from appliance.models.quant import dequantize_int4

    def quantize_groups_int4(w, group):  # blocks (q, d, m) of a zero-point grid, any group size
        q, z, sc = quantize_zero_point(w, group)
        return q, sc.float(), -(sc.float() * z.float())

    arch = ModelArch("LlamaForCausalLM", 2, 64, 128, 4, 2, 16, 500, 1024, 1e4, 1e-5, False)
    lin = _projections(arch)
    g = torch.Generator().manual_seed(0)
    layer = "model.layers.0."
    shapes = {layer + "self_attn.q_proj.weight": (64, 64), layer + "self_attn.k_proj.weight": (32, 64),
              layer + "self_attn.o_proj.weight": (64, 64), layer + "mlp.down_proj.weight": (64, 128),
              "lm_head.weight": (500, 64)}
    blocks = {n: quantize_groups_int4(torch.randn(*shape, generator=g), 16) for n, shape in shapes.items()}
    for tp in (2, 4):
        for rank in range(tp):
            ours = shard_blocks(arch, rank, tp, blocks, lin)
            for name, b in blocks.items():
                dim, start, stop = tensor_shard(arch, rank, tp, name, lin)
                whole = dequantize_int4(*b)
                if name == "lm_head.weight":
                    whole = torch.cat([whole, torch.zeros(padded_vocab(500, tp) - 500, 64)])
                want = whole[start:stop] if dim == 0 else whole[:, start:stop]
                assert torch.equal(dequantize_int4(*ours[name][:3]), want), (name, tp, rank)
    perm = torch.randperm(64, generator=g)
    act_order = {layer + "self_attn.o_proj.weight": (*blocks[layer + "self_attn.o_proj.weight"], perm)}
    with pytest.raises(ValueError, match="act-order"):
        shard_blocks(arch, 0, 2, act_order, lin)
    coarse = {layer + "mlp.down_proj.weight": quantize_groups_int4(torch.randn(64, 128, generator=g), 128)}
    with pytest.raises(ValueError, match="cut its groups of 128"):
        shard_blocks(arch, 0, 2, coarse, lin)
    q_act = {layer + "self_attn.q_proj.weight": (*blocks[layer + "self_attn.q_proj.weight"], perm)}
    assert torch.equal(shard_blocks(arch, 1, 2, q_act, lin)[layer + "self_attn.q_proj.weight"][3], perm)  # inputs whole


def test_stages_split_the_layers_and_read_their_own_tensors():
    from appliance.config.sizes import pipeline_partition
    from appliance.models.layers.parallel import PipelineParallel
    from appliance.models.llama import LlamaForCausalLM
    from appliance.kernels.torch_sdpa import TorchSDPABackend

    assert pipeline_partition(30, 4) == [7, 8, 8, 7]  # the remainder to the stages before the last
    assert pipeline_partition(30, 2) == [15, 15] and pipeline_partition(7, 3) == [2, 3, 2]
    assert pipeline_partition(30, 2, [13, 17]) == [13, 17]
    arch = ModelArch("LlamaForCausalLM", 4, 64, 128, 4, 2, 16, 500, 1024, 1e4, 1e-5, True)
    backend = TorchSDPABackend(4, 2, 16, 0.25, "auto")
    first = LlamaForCausalLM(arch, backend, pp=PipelineParallel(0, 2, 0, 1))
    last = LlamaForCausalLM(arch, backend, pp=PipelineParallel(1, 2, 1, 4))
    assert (len(first.model.layers), len(last.model.layers)) == (1, 3)
    assert first.local_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert first.local_name("model.layers.1.mlp.up_proj.weight") is None
    assert last.local_name("model.layers.3.self_attn.o_proj.weight") == "model.layers.2.self_attn.o_proj.weight"
    assert first.local_name("model.norm.weight") is None and last.local_name("model.norm.weight")
    # tied: the last stage keeps the embedding for its LM head; a middle stage would hold neither
    assert first.local_name("model.embed_tokens.weight") and last.local_name("model.embed_tokens.weight")
    untied = LlamaForCausalLM(dataclasses.replace(arch, tie_word_embeddings=False), backend,
                              pp=PipelineParallel(1, 2, 1, 4))
    assert untied.local_name("model.embed_tokens.weight") is None and untied.local_name("lm_head.weight")


def test_ranks_split_the_cores(tmp_path):
    assert [cpu_share(r, 2, [0, 1, 2, 3, 4]) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [cpu_share(r, 3, [0, 1]) for r in range(3)] == [[0, 1]] * 3  # more ranks than cores: they share
    # two sockets, cores interleaved between them as many hosts number them
    for node, cpulist in enumerate(["0-3,8-11", "4-7,12-15"]):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    (tmp_path / "possible").write_text("0-1\n")  # not a node
    allowed = list(range(16))
    nodes = numa_nodes(allowed, str(tmp_path))
    assert nodes == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert [cpu_share(r, 2, allowed, nodes) for r in range(2)] == nodes  # a rank per node
    assert cpu_share(3, 4, allowed, nodes) == [12, 13, 14, 15]  # two per node: node 1's second half
    assert cpu_share(1, 3, allowed, nodes) == [6, 7, 8, 9, 10]  # 3 ranks do not divide 2 nodes: contiguous
    assert numa_nodes([0, 1], str(tmp_path)) == [[0, 1]] and numa_nodes([5], str(tmp_path / "none")) == [[5]]
    assert parse_cpulist("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    assert torch.get_num_threads() >= 1
