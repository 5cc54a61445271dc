"""Mixture-of-experts models over CPU ranks (``parallel.executor=mp``):
with tensor parallelism every rank holds a slice of each expert, with
expert parallelism (``parallel.enable_expert_parallel``) whole experts
split over the ranks; either way the same greedy tokens and logprobs as
one rank, for Qwen3-MoE and Mixtral."""

import functools

import pytest

from tests.integration.test_tensor_parallel import PROMPTS, assert_same, generate

TINY_MOE = ["+profile=cpu", "model=tiny_random_moe", "cache.kv_cache_memory_gib=0.05"]
MIXTRAL = ["model.architecture=MixtralForCausalLM", "model.mlp_only_layers=[]", "model.qk_norm=false",
           "model.intermediate_size=32"]


VARIANTS = {"qwen3_moe": TINY_MOE, "mixtral": TINY_MOE + MIXTRAL}


@functools.lru_cache(maxsize=None)
def one_rank(variant):
    return generate(VARIANTS[variant], PROMPTS, 16)[0]


# Mixtral differs from Qwen3-MoE in its checkpoint names and its all-sparse layers: tp2 and ep2 cover it (the
# bounded run ep2; sliced experts are the same code for both families)
@pytest.mark.parametrize("variant,tp,ep,pp", [("qwen3_moe", 2, False, 1), ("qwen3_moe", 2, True, 1),
                                              ("qwen3_moe", 4, True, 1), ("qwen3_moe", 2, True, 2),
                                              pytest.param("mixtral", 2, False, 1, marks=pytest.mark.slow),
                                              ("mixtral", 2, True, 1)],
                         ids=["qwen3_moe-tp2-sliced", "qwen3_moe-ep2", "qwen3_moe-ep4", "qwen3_moe-ep2-pp2",
                              "mixtral-tp2-sliced", "mixtral-ep2"])
def test_moe_ranks_give_the_tokens_of_one_rank(variant, tp, ep, pp):
    outs, llm = generate([*VARIANTS[variant], f"parallel.tensor_parallel_size={tp}",
                          f"parallel.pipeline_parallel_size={pp}", f"parallel.enable_expert_parallel={str(ep).lower()}"],
                         PROMPTS, 16)
    assert len(llm.engine.runner.pids) == tp * pp
    assert_same(outs, one_rank(variant))


def one_core_texts(overrides, prompts):
    """Greedy 16-token completions of one engine core in this process."""
    from appliance import LLM, SamplingParams

    one = LLM(overrides=overrides)
    return [o.outputs[0].text for o in one.generate(prompts, SamplingParams(max_tokens=16, temperature=0,
                                                                           ignore_eos=True), use_tqdm=False)]


def assert_one_cores_answers(server, ref, alone):
    """A dp2_ep server with the load balancer answers as one core did
    (``ref``: ``PROMPTS``' texts): a request pinned to each core of
    ``alone`` (the other idle, joining the exchanges), then every prompt at
    once; both cores rebalanced. Returns the metrics' text."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.integration.server_helpers import metric
    from tests.integration.test_data_parallel import complete

    for rank in alone:
        r = complete(server.url, PROMPTS[1], headers={"X-Data-Parallel-Rank": str(rank)})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref[1]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: complete(server.url, p), PROMPTS))
    assert [a.json()["choices"][0]["text"] for a in answers] == ref
    text = httpx.get(f"{server.url}/metrics").text
    assert all(metric(text, "appliance:eplb_rebalances_total", engine=str(e)) > 0 for e in (0, 1))
    return text


def kill_a_core(server, which, prompt):
    """SIGKILL one of a lock-step server's engine cores; the answer to
    ``prompt`` once every core was replaced (within two minutes)."""
    import os
    import signal
    import time

    from tests.integration.test_data_parallel import complete

    pids = server.core_pids()
    os.kill(pids[which], signal.SIGKILL)
    deadline = time.time() + 120
    while True:
        r = complete(server.url, prompt)
        if r.status_code == 200 and set(server.core_pids()).isdisjoint(pids):
            return r
        assert time.time() < deadline, "the engine cores did not come back"
        time.sleep(0.5)


def test_two_engine_cores_split_the_experts():
    """parallel=dp2_ep: each core has its own requests and half the experts
    (with load balancing moving them between the cores); the cores step
    together (an idle one joins the exchanges), answers equal one core's,
    and a killed core brings both back on a fresh segment."""
    import httpx

    from tests.integration.server_helpers import ServerProcess, metric

    ref = one_core_texts(TINY_MOE, PROMPTS)
    # with load balancing every 5 forwards: the weights move between the cores as they serve
    s = ServerProcess(*TINY_MOE[1:], "parallel=dp2_ep", "server.core_restart_backoff_s=0.5",
                      "parallel.eplb.enabled=true", "parallel.eplb.num_redundant_experts=2",
                      "parallel.eplb.step_interval=5", "parallel.eplb.window_size=5")
    try:
        text = assert_one_cores_answers(s, ref, alone=(0, 1))
        assert all(metric(text, "appliance:time_to_first_token_seconds_count", engine=str(e)) > 0 for e in (0, 1))
        assert 0 < metric(text, "appliance:eplb_balancedness", engine="0") <= 1

        r = kill_a_core(s, 0, PROMPTS[2])  # the other core cannot go on alone: both restart
        assert r.json()["choices"][0]["text"] == ref[2]
        assert "restarting every engine core" in s.output()
        text = httpx.get(f"{s.url}/metrics").text
        assert all(metric(text, "appliance:engine_restarts_total", engine=str(e)) == 1 for e in (0, 1))
    finally:
        s.stop()


@pytest.fixture(scope="module")
def skewed_router_folder(tmp_path_factory):
    """The tiny Qwen3-MoE whose routers favour experts 0 and 1 (the other rows
    zero: their ties fall to experts 5 and 6), so at ep4 rank 0 holds the two
    hottest experts and rank 1 none of the four that take tokens."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from appliance.config.compose import resolve
    from appliance.models.loader import resolve_model_folder

    src = resolve_model_folder(resolve(TINY_MOE).cfg.model)
    out = tmp_path_factory.mktemp("skewed") / "model"
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(".mlp.gate.weight"):
            skewed = torch.zeros_like(t)
            skewed[:2] = 3.0 * t[:2]
            tensors[name] = skewed
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_eplb_evens_the_load_and_keeps_the_tokens(skewed_router_folder):
    """ep4 with 4 redundant slots: without a rebalance the ranks' loads are
    uneven; rebalancing every 10 forwards replicates the hot experts and
    spreads them, moving their weights between the ranks, and the tokens
    and logprobs stay those of the unbalanced model."""
    base = [*TINY_MOE, f"model.path={skewed_router_folder}", "parallel.tensor_parallel_size=4",
            "parallel.enable_expert_parallel=true"]
    eplb = ["parallel.eplb.enabled=true", "parallel.eplb.num_redundant_experts=4"]
    prompts = PROMPTS[:4]
    plain, _ = generate(base, prompts, 24)
    runs = {}
    for interval in (1000, 10):
        outs, llm = generate([*base, *eplb, f"parallel.eplb.step_interval={interval}",
                              f"parallel.eplb.window_size={interval}"], prompts, 24)
        assert_same(outs, plain)
        runs[interval] = llm.engine.last_stats
    unbalanced, balanced = runs[1000], runs[10]
    assert unbalanced.eplb_rebalances == 0 and balanced.eplb_rebalances == 2
    assert sum(unbalanced.expert_load[i] for i in (0, 1, 5, 6)) == sum(unbalanced.expert_load)  # the skew holds
    assert unbalanced.eplb_balancedness < 0.75 < 0.9 < balanced.eplb_balancedness
    assert balanced.eplb_slot_load_ratios == [] or max(balanced.eplb_slot_load_ratios) > 1.5  # reported once


def test_engine_cores_split_the_experts_over_gloo():
    """parallel=dp2_ep with parallel.cpu_collectives=gloo: the cores meet over
    torch.distributed (as GPU cores do over NCCL) instead of shared memory."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.server_helpers import ServerProcess
    from tests.integration.test_data_parallel import complete

    ref = one_core_texts(TINY_MOE, PROMPTS[:4])
    s = ServerProcess(*TINY_MOE[1:], "parallel=dp2_ep", "parallel.cpu_collectives=gloo")
    try:
        r = complete(s.url, PROMPTS[0], headers={"X-Data-Parallel-Rank": "1"})  # core 0 idle, joining in
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref[0]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: complete(s.url, p), PROMPTS[:4]))
        assert [a.json()["choices"][0]["text"] for a in answers] == ref
    finally:
        s.stop()


@pytest.mark.parametrize("tp,pp,collectives", [(2, 1, "shm"), (2, 1, "gloo"),
                                                pytest.param(1, 1, "gloo", marks=pytest.mark.slow),
                                                pytest.param(1, 2, "shm", marks=pytest.mark.slow),
                                                pytest.param(2, 2, "gloo", marks=pytest.mark.slow)],
                         ids=["tp2-shm", "tp2-gloo", "one-rank-in-a-worker-gloo", "pp2-shm", "tp2-pp2-gloo"])
def test_engine_cores_of_worker_ranks_split_the_experts(tp, pp, collectives):
    """dp2 x tp2 with expert parallelism: four ranks of two cores hold two
    experts each (three with the load balancer's redundant slots, which it
    moves between every core's ranks); each core attends over its two ranks
    to its own requests, and an idle core's ranks join the exchanges; the
    answers are one core's. The same with each core's one rank in a worker
    process (parallel.executor=mp), and with two pipeline stages in each
    core (each stage's ranks split that stage's layers' experts with the
    other cores' ranks of that stage; a step goes through both stages
    before the next, so the cores' steps pair up). Over shared memory a
    killed core brings both back, their ranks on fresh segments."""
    from tests.integration.server_helpers import ServerProcess

    ref = one_core_texts(TINY_MOE, PROMPTS)
    s = ServerProcess(*TINY_MOE[1:], "parallel=dp2_ep", f"parallel.tensor_parallel_size={tp}",
                      f"parallel.pipeline_parallel_size={pp}", "parallel.executor=mp",
                      f"parallel.cpu_collectives={collectives}",
                      "server.core_restart_backoff_s=0.5", "parallel.eplb.enabled=true",
                      "parallel.eplb.num_redundant_experts=4", "parallel.eplb.step_interval=5",
                      "parallel.eplb.window_size=5")
    try:
        assert f"tp={tp} pp={pp} dp=2 ep={2 * tp}" in s.output()
        assert_one_cores_answers(s, ref, alone=(1,))  # core 0's ranks idle, joining in
        if collectives == "gloo":
            return
        r = kill_a_core(s, 1, PROMPTS[2])  # its ranks die with it; the other core's cannot go on alone
        assert r.json()["choices"][0]["text"] == ref[2]
        assert "restarting every engine core" in s.output()
    finally:
        s.stop()


def test_eplb_rebalances_each_pipeline_stage():
    """ep2 x pp2 with the load balancer: each stage balances its own sparse
    layers over its ranks (the last stage's figures are reported), and the
    tokens stay one rank's."""
    outs, llm = generate([*TINY_MOE, "parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2",
                          "parallel.enable_expert_parallel=true", "parallel.eplb.enabled=true",
                          "parallel.eplb.num_redundant_experts=2", "parallel.eplb.step_interval=5",
                          "parallel.eplb.window_size=5"], PROMPTS, 16)
    assert_same(outs, one_rank("qwen3_moe"))
    stats = llm.engine.last_stats
    assert stats.eplb_rebalances > 0 and 0 < stats.eplb_balancedness <= 1


@pytest.mark.parametrize("quantization", [pytest.param("int8_wo", marks=pytest.mark.slow), "int4_wo"])
def test_eplb_moves_quantized_experts(skewed_router_folder, quantization):
    """ep2 with the load balancer over weight-only int8 or int4 experts: a
    rebalance moves each slot's quantized weights, scales and mins, and the
    tokens and logprobs stay those of the same model never rebalanced."""
    base = [*TINY_MOE, f"model.path={skewed_router_folder}", "parallel.tensor_parallel_size=2",
            "parallel.enable_expert_parallel=true", f"quantization={quantization}", "parallel.eplb.enabled=true",
            "parallel.eplb.num_redundant_experts=2"]
    runs = {}
    for interval in (1000, 5):
        outs, llm = generate([*base, f"parallel.eplb.step_interval={interval}",
                              f"parallel.eplb.window_size={interval}"], PROMPTS[:4], 16)
        runs[interval] = (outs, llm.engine.last_stats)
    (plain, unbalanced), (outs, balanced) = runs[1000], runs[5]
    assert unbalanced.eplb_rebalances == 0 and balanced.eplb_rebalances > 0
    assert_same(outs, plain)
    assert balanced.eplb_balancedness > unbalanced.eplb_balancedness


@pytest.fixture(scope="module")
def quantized_moe(tmp_path_factory):
    """The tiny Qwen3-MoE as a GPTQ checkpoint in groups of 16 (a tp2 slice of
    an expert's 32 rows splits whole groups), an fp8 one in [16, 16] blocks,
    and a qwen3moe GGUF of 4- and 8-bit blocks (groups of 32: whole experts only)."""
    from appliance.config.compose import resolve
    from appliance.models.int4_checkpoints import write_checkpoint
    from appliance.models.loader import resolve_model_folder
    from tests.model_helpers import write_fp8_checkpoint
    from tests.unit.test_gguf_moe import AT_WIDTH, write_qwen3moe_gguf

    plain = resolve_model_folder(resolve(TINY_MOE).cfg.model)
    root = tmp_path_factory.mktemp("moe-quantized")
    write_checkpoint(plain, root / "gptq", "gptq", 4, 16)
    write_fp8_checkpoint(plain, root / "fp8", block=16)
    write_qwen3moe_gguf(plain, root / "moe.gguf", AT_WIDTH)
    return {"gptq": root / "gptq", "fp8": root / "fp8", "gguf": root / "moe.gguf"}


@pytest.mark.parametrize("variant,ep", [("gptq", False), ("gptq", True), ("fp8", False), ("fp8", True),
                                        ("gguf", True)],
                         ids=["gptq-tp2-sliced", "gptq-ep2", "fp8-tp2-sliced", "fp8-ep2", "gguf-ep2"])
def test_checkpoint_experts_over_ranks_give_one_ranks_tokens(quantized_moe, variant, ep, monkeypatch):
    """A quantized checkpoint's experts over two ranks: each rank's slice of
    every expert's blocks or scales, or (expert parallelism) its whole
    experts; the tokens and logprobs of one rank's torch layer path (fp32
    rows in the native GEMMs, as in test_tensor_parallel)."""
    monkeypatch.setenv("APPLIANCE_CPU_BF16_DOT", "0")
    monkeypatch.setenv("APPLIANCE_CPU_INT8_ROWS", "0")
    model = [*TINY_MOE, f"model.path={quantized_moe[variant]}", "model.dtype=float32"]
    prompts = [[5, 77, 301, 12, 9], [400, 2, 2, 2, 2, 2, 17, 250], [1, 300], [33, 44, 55, 66]]
    ref, _ = generate([*model, "attention.backend=torch_sdpa"], prompts, 12)
    outs, llm = generate([*model, "parallel.tensor_parallel_size=2",
                          f"parallel.enable_expert_parallel={str(ep).lower()}"], prompts, 12)
    assert llm.resolved.cfg.quantization.method == variant
    assert_same(outs, ref)


def assert_same_up_to_a_tie(served, ref, tokenizer, tol=1e-3):
    """A served completion's tokens (``logprobs``: its tokens and their
    logprobs) are the reference's, logprobs within ``tol``, up to a step
    where the reference's top two candidates tie within ``tol`` (batches of
    other rows sum in another order) and the served one took the second."""
    for i, (token, logprob) in enumerate(zip(served["tokens"], served["token_logprobs"])):
        lp = ref.logprobs[i]
        if token != tokenizer.decode([lp.token_id]):
            second = [(t, v) for t, v in lp.top if t != lp.token_id]
            assert second and token == tokenizer.decode([second[0][0]]), (i, token)
            assert lp.logprob - second[0][1] < tol and abs(logprob - lp.logprob) < tol, (i, lp)
            return
        assert abs(logprob - lp.logprob) < tol, (i, logprob, lp.logprob)
    assert len(served["tokens"]) == len(ref.token_ids)


@pytest.mark.parametrize("variant", ["gptq", pytest.param("fp8", marks=pytest.mark.slow), "gguf"])
def test_checkpoint_experts_over_engine_cores_give_one_cores_answers(quantized_moe, variant, monkeypatch):
    """parallel=dp2_ep serving a quantized checkpoint: each core loads its
    own experts as the file stores them (GPTQ blocks, fp8 values and
    scales, GGUF blocks at their width); the GPTQ cores' load balancer
    moves those blocks between them while serving; every answer is one
    core's torch layer path's (fp32 rows in the native GEMMs on both
    sides), up to a tie."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from appliance import LLM, SamplingParams
    from appliance.config.compose import resolve
    from tests.integration.server_helpers import ServerProcess, metric
    from tests.integration.test_data_parallel import complete

    monkeypatch.setenv("APPLIANCE_CPU_BF16_DOT", "0")  # read by the engine here and by the server's cores
    monkeypatch.setenv("APPLIANCE_CPU_INT8_ROWS", "0")
    model = [*TINY_MOE, f"model.path={quantized_moe[variant]}", "model.dtype=float32"]
    eplb = ["parallel.eplb.enabled=true", "parallel.eplb.num_redundant_experts=2", "parallel.eplb.step_interval=5",
            "parallel.eplb.window_size=5"] if variant == "gptq" else []
    assert resolve([*model, "parallel=dp2_ep"]).cfg.quantization.method == variant
    prompts = [[5, 77, 301, 12, 9], [400, 2, 2, 2, 2, 2, 17, 250], [1, 300], [33, 44, 55, 66]]
    one = LLM(overrides=[*model, "attention.backend=torch_sdpa"])  # the torch layer path, as the cores run
    ref = [o.outputs[0] for o in one.generate(prompts, SamplingParams(max_tokens=16, temperature=0, logprobs=2,
                                                                      ignore_eos=True), use_tqdm=False)]
    tokenizer = one.tokenizer
    del one
    s = ServerProcess(*model[1:], "parallel=dp2_ep", *eplb)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: complete(s.url, p, logprobs=1), prompts))
        # fp8 activations round to 3 mantissa bits per token: a value another batching moves across a
        # rounding step moves a whole step
        tol = 2e-2 if variant == "fp8" else 1e-3
        for answer, want in zip(answers, ref):
            assert_same_up_to_a_tie(answer.json()["choices"][0]["logprobs"], want, tokenizer, tol)
        if eplb:
            text = httpx.get(f"{s.url}/metrics").text
            assert all(metric(text, "appliance:eplb_rebalances_total", engine=str(e)) > 0 for e in (0, 1))
    finally:
        s.stop()
