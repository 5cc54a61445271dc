"""Every bench in a bounded form on the tiny model: results are well formed.
Never timings: only that the numbers exist, are positive and are consistent."""

import json
import math

import pytest

from appliance.worker.kv_nixl import nixl_api

TINY = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05"]


@pytest.fixture(scope="module")
def out(tmp_path_factory, cli):
    d = tmp_path_factory.mktemp("bench")
    r = cli("bench", "machine", "--size", "256", "--mib", "32", "--repeat", "1", "--out", str(d))
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def cli():
    from tests.conftest import run_cli

    return run_cli


def load(d, name):
    return json.loads((d / f"{name}.json").read_text())


def test_machine(out):
    m = load(out, "machine")
    assert m["peak_bandwidth_GBps"] > 0 and m["peak_gflops"]["fp32"] > 0 and m["peak_gflops"]["int8"] > 0
    assert (out / "machine.png").stat().st_size > 0
    from appliance.kernels import cpu_native

    variants = m["kernel_variants"]  # chosen from CPUID on this machine, whichever it is
    assert variants["cpu_native"] == "available"
    assert variants["bf16 GEMMs"].startswith("avx512f" if cpu_native.fma_rows() and cpu_native.avx512() else
                                             "avx512_bf16" if cpu_native.bf16_dot() else "avx2+fma")
    assert variants["int4 GEMMs over 6 rows"].startswith("avx512_bf16" if cpu_native.bf16_dot() else "avx2+fma")
    assert variants["int4 GEMV and GEMMs of 2-6 rows"].startswith("avx512f" if cpu_native.avx512() else "avx2+fma")
    assert variants["prefill attention tiles"].startswith("avx512f" if cpu_native.avx512() else "avx2+fma")
    assert variants["decode attention"].startswith("avx512f" if cpu_native.avx512() else "avx2+fma")
    assert variants["prefill attention tiles over a bf16 or fp8 cache"].startswith(
        ("amx" if cpu_native.amx() else "avx512_bf16") if cpu_native.bf16_attention() else "as below")
    assert variants["int4 and int8 weights' GEMMs over 6 rows"].startswith(
        "avx512_vnni" if cpu_native.int8_rows() else "float rows")
    assert variants["W8A8 int8 GEMV and GEMMs (quantization=w8a8_int8)"].startswith(
        "avx512_vnni" if cpu_native.vnni() else "avx2 (vpmaddwd")
    assert variants["GEMMs on AMX tiles"].startswith("amx" if cpu_native.amx() else "as above")


def test_gemm(out, cli):
    r = cli("bench", "gemm", "--rows", "1,16", "--mib", "1", "--repeat", "1", "--out", str(out), "model=tiny_random",
            "model.dtype=bfloat16", "--torch")
    assert r.returncode == 0, r.stderr
    g = load(out, "gemm")
    from appliance.kernels import cpu_native

    # tiny_random: hidden 64, 4 heads / 2 kv heads of 16, intermediate 128
    shapes = {(x["projection"], x["k"], x["n"]) for x in g["results"]}
    assert shapes == {("qkv", 64, 128), ("o", 64, 64), ("gate_up", 64, 256), ("down", 128, 64)}
    paths = {x["path"] for x in g["results"]}
    fast = cpu_native.bf16_dot() or (cpu_native.fma_rows() and cpu_native.avx512())
    assert paths == ({"default", "widened (AVX2)", "torch F.linear"} if fast else {"default", "torch F.linear"})
    by = {(x["projection"], x["rows"], x["path"]): x for x in g["results"]}
    for (name, rows, path), x in by.items():  # the default path's speed against torch's, same run
        if path == "default":
            assert x["speedup_over_torch"] == pytest.approx(by[name, rows, "torch F.linear"]["ms"] / x["ms"])
    machine = g["machine_peaks_gflops"]
    for x in g["results"]:
        assert x["ms"] > 0 and math.isclose(x["gflops"], 2 * x["rows"] * x["k"] * x["n"] / x["ms"] / 1e6, rel_tol=1e-9)
        assert x["share_of_peak_gflops"] == pytest.approx(x["gflops"] / machine[x["peak_gflops_dtype"]])
        assert x["share_of_bandwidth"] > 0
        tiles = cpu_native.amx() and x["path"] == "default" and x["rows"] >= cpu_native.amx_min_rows()
        torch_bf16 = x["path"] == "torch F.linear" and "bf16" in machine
        assert x["peak_gflops_dtype"] == ("bf16" if tiles or torch_bf16 else
                                          "fp32" if x["path"] == "torch F.linear" else g["machine_peak_gflops_dtype"])
    assert (out / "gemm.png").stat().st_size > 0


def test_mxfp4(out, cli):
    r = cli("bench", "mxfp4", "--hidden", "64", "--inter", "96", "--rows", "1,16", "--mib", "1", "--repeat", "1",
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    g = load(out, "mxfp4")
    by = {(x["projection"], x["rows"], x["path"]): x for x in g["results"]}
    assert {(x["projection"], x["k"], x["n"]) for x in g["results"]} == {("gate_up", 64, 192), ("down", 96, 64)}
    assert {p for _, _, p in by} == {"mxfp4 native", "mxfp4 widened bf16", "bf16 torch", "fp32 torch"}
    for (name, rows, path), x in by.items():  # each path against the dequantized ones, same run
        assert x["speedup_over_bf16"] == pytest.approx(by[name, rows, "bf16 torch"]["ms"] / x["ms"])
        bytes_per_weight = {"bf16 torch": 2, "fp32 torch": 4}.get(path, 17 / 32)
        assert x["weight_GBps"] == pytest.approx(x["k"] * x["n"] * bytes_per_weight / x["ms"] / 1e6)
        assert x["share_of_peak_gflops"] == pytest.approx(x["gflops"] / g["machine_peak_gflops_fp32"])
    assert (out / "mxfp4.png").stat().st_size > 0
    assert cli("bench", "mxfp4", "--hidden", "60", "--out", str(out)).returncode != 0  # not whole groups


def test_gemm_of_int4_weights_against_float_rows(out, cli):
    r = cli("bench", "gemm", "--rows", "1,8", "--mib", "1", "--repeat", "1", "--out", str(out), "model=tiny_random",
            "quantization=int4_wo")
    assert r.returncode == 0, r.stderr
    g = load(out, "gemm")
    from appliance.kernels import cpu_native

    assert g["weights"] == "int4_wo" and g["baseline"] == "int8_rows off"
    assert g["machine_peak_gflops_dtype"] == ("int8" if cpu_native.int8_rows() else
                                              "bf16" if cpu_native.bf16_dot() else "fp32")
    assert {x["path"] for x in g["results"]} == ({"default", "int8_rows off"} if cpu_native.int8_rows() else
                                                {"default"})
    assert all(x["weight_GBps"] == pytest.approx(x["k"] * x["n"] * (0.5 + 4 / 32) / x["ms"] / 1e6)
               for x in g["results"])
    r = cli("bench", "gemm", "--out", str(out), "model=tiny_random", "quantization=awq", "quantization.group_size=32")
    assert r.returncode != 0 and "not quantization=awq" in r.stderr
    r = cli("bench", "gemm", "--out", str(out), "model=tiny_random", "quantization=int4_wo", "--torch")
    assert r.returncode != 0 and "--torch times float weights" in r.stderr


def test_throughput_with_hf_baseline(out, cli):
    r = cli("bench", "throughput", "--num-prompts", "3", "--input-len-range", "8,24", "--output-len", "6",
            "--baseline", "hf", "--also", "quantization=int8_wo", "--repeat", "2", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    t = load(out, "throughput")
    ours = t["appliance"]
    assert ours["output_tokens"] == 18 and ours["output_tok_s"] > 0 and ours["steps"] >= 6
    assert ours["attention_backend"] == "cpu_native"
    assert set(ours["native_phases_s"]) >= {"qkv", "attention", "lm_head"}
    assert len(ours["runs_elapsed_s"]) == 2 and ours["elapsed_s"] in ours["runs_elapsed_s"]
    assert len(t["hf"]["static"]["runs_elapsed_s"]) == 2
    assert sum(ours["native_phases_s"].values()) <= max(ours["runs_elapsed_s"])
    q = t["also"]["quantization=int8_wo"]
    assert q["output_tokens"] == 18 and q["config_hash"] != t["config_hash"]
    assert q["ratio_vs_hf_static"] == pytest.approx(q["output_tok_s"] / t["hf"]["static"]["output_tok_s"])
    assert 0 < ours["bandwidth_fraction"] and 0 < ours["gemm_peak_fraction"]
    assert all(8 <= n <= 24 for n in t["input_lens"])
    assert t["hf"]["static"]["output_tokens"] == 18
    assert t["ratio_vs_hf_static"] == pytest.approx(ours["output_tok_s"] / t["hf"]["static"]["output_tok_s"])


def test_latency(out, cli):
    r = cli("bench", "latency", "--input-lens", "8,32", "--batch-sizes", "1,2", "--decode-steps", "2",
            "--repeat", "1", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    lat = load(out, "latency")
    assert [p["input_len"] for p in lat["prefill"]] == [8, 32]
    assert [d["batch_size"] for d in lat["decode"]] == [1, 2] and all(d["ms_per_step"] > 0 for d in lat["decode"])


def test_long_context(out, cli):
    r = cli("bench", "long-context", "--contexts", "120,40", "--streams", "1,2", "--steps", "2", "--out", str(out),
            "--also", "cache.kv_cache_dtype=fp8_e4m3", *TINY, "cache.kv_cache_dtype=bfloat16")
    assert r.returncode == 0, r.stderr
    lc = load(out, "long_context")
    first, fp8 = lc["deployments"]["appliance"], lc["deployments"]["cache.kv_cache_dtype=fp8_e4m3"]
    # tiny_random: 2 layers, 2 kv heads of 16, K and V: 256 bytes a token in bf16, 128 in fp8
    assert (first["kv_cache_dtype"], first["kv_bytes_per_token"]) == ("bfloat16", 2 * 2 * 16 * 2 * 2)
    assert (fp8["kv_cache_dtype"], fp8["kv_bytes_per_token"]) == ("float8_e4m3fn", 2 * 2 * 16 * 2)
    for run in (first, fp8):
        rows = run["rows"]
        assert [(x["context"], x["streams"]) for x in rows] == [(40, 1), (40, 2), (120, 1), (120, 2)]
        for x in rows:
            assert x["itl_ms"] > 0 and math.isclose(x["decode_tok_s"], x["streams"] / x["itl_ms"] * 1e3)
            assert math.isclose(x["prefill_tok_s"], x["context"] / x["prefill_s"])
        # the KV read rate: the extra bytes a step reads at the longer context over its extra time
        for longer, shorter in ((rows[2], rows[0]), (rows[3], rows[1])):
            if "kv_GBps" in longer:
                extra = longer["streams"] * 80 * run["kv_bytes_per_token"]
                assert math.isclose(longer["kv_GBps"], extra / (longer["itl_ms"] - shorter["itl_ms"]) * 1e3 / 1e9)
    for x, base in zip(fp8["rows"], first["rows"]):
        assert math.isclose(x["itl_vs_first"], x["itl_ms"] / base["itl_ms"])
    assert (out / "long_context.png").stat().st_size > 0


def test_long_context_over_http(out, cli):
    r = cli("bench", "long-context", "--served", "--label", "tiny", "--contexts", "120,40", "--streams", "1,2",
            "--steps", "3", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    run = load(out, "long_context-tiny")["deployments"]["tiny"]
    # tiny_random's fp32 KV: 2 layers, 2 kv heads of 16, K and V: 512 bytes a token, as the appliance plans it
    assert run["kv_bytes_per_token"] == 2 * 2 * 16 * 2 * 4 and run["model"] and run["url"].startswith("http://")
    rows = run["rows"]
    assert [(x["context"], x["streams"]) for x in rows] == [(40, 1), (40, 2), (120, 1), (120, 2)]
    for x in rows:
        assert x["itl_ms"] > 0 and math.isclose(x["decode_tok_s"], x["streams"] / x["itl_ms"] * 1e3)
        assert math.isclose(x["prefill_tok_s"], x["context"] / x["prefill_s"]) and x["ttft_max_ms"] > 0
    assert (out / "long_context-tiny.png").stat().st_size > 0
    r = cli("bench", "long-context", "--served", "--also", "cache.kv_cache_dtype=fp8_e4m3", "--out", str(out), *TINY)
    assert r.returncode == 2 and "one server" in r.stderr


def test_prefix(out, cli):
    r = cli("bench", "prefix", "--num-prompts", "3", "--prefix-len", "40", "--suffix-len", "5", "--output-len", "2",
            "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    s = load(out, "prefix")
    # 40 shared tokens = 2 full blocks of 16 for requests 2 and 3, out of 45 tokens each
    assert s["summary"]["ideal_hit_rate"] == pytest.approx(2 * 32 / (3 * 45))
    assert s["on"]["hit_rate"] == pytest.approx(s["summary"]["ideal_hit_rate"])
    assert s["off"]["hit_rate"] == 0


def test_offload(out, cli):
    r = cli("bench", "offload", "--prefix-len", "64", "--question-len", "4", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    runs = load(out, "offload")["runs"]
    assert runs["cold"]["cached_tokens"] == 0
    # 64 shared tokens = 4 full blocks of 16, from the pool, the tier, and the tier after a restart
    for name in ("block pool hit", "tier, pool cleared", "tier, after a restart"):
        assert runs[name]["cached_tokens"] == 64, name
    assert (out / "offload.png").stat().st_size > 0


def test_pd(out, cli):
    r = cli("bench", "pd", "--prompt-len", "40", "--repeat", "1", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    res = load(out, "pd")
    assert res["fetched_tokens"] == 39  # all of the prompt but its last token
    assert set(res["median_ms"]) == {"colocated", "producer", "consumer"}
    assert set(res["fetch_gb_s"]) == {"p2p"}
    assert (out / "pd.png").stat().st_size > 0


@pytest.mark.skipif(nixl_api() is None, reason="NIXL is not installed (pip install nixl-cu12)")
def test_pd_compares_the_connectors(out, cli):
    r = cli("bench", "pd", "--prompt-len", "40", "--repeat", "1", "--connectors", "p2p,nixl", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    res = load(out, "pd")
    assert res["fetched_tokens"] == 39
    assert set(res["median_ms"]) == {"colocated", "p2p producer", "p2p consumer", "nixl producer", "nixl consumer"}
    assert res["consumer_nixl_vs_p2p"] > 0


def test_serve_starts_its_own_server(out, cli):
    r = cli("bench", "serve", "--max-concurrency", "1,3", "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
            "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    s = load(out, "serve")
    assert [lv["max_concurrency"] for lv in s["levels"]] == [1, 3]
    for lv in s["levels"]:
        assert lv["completed"] == 3 and lv["failed"] == 0 and lv["output_tok_s"] > 0
        assert set(lv["ttft_ms"]) == {"mean", "p50", "p90", "p99"} and lv["tpot_ms"]["mean"] > 0


def test_apis_compares_messages_and_responses_with_chat(out, cli):
    r = cli("bench", "apis", "--max-concurrency", "1,2", "--num-prompts", "2", "--input-words", "6", "--output-len", "4",
            "--rounds", "1", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stdout + r.stderr
    res = load(out, "apis")
    by = {(lv["api"], lv["max_concurrency"]): lv for lv in res["levels"]}
    assert set(by) == {(api, c) for api in ("chat", "messages", "responses") for c in (1, 2)}
    for (_, c), lv in by.items():
        assert lv["completed"] == 2 and lv["failed"] == 0 and lv["output_tok_s"] > 0
        assert lv["vs_chat"] == pytest.approx(lv["output_tok_s"] / by[("chat", c)]["output_tok_s"])
        # greedy, the same prompts: every API generates the same tokens
        assert lv["output_tokens"] == by[("chat", c)]["output_tokens"]
    assert (out / "apis.png").stat().st_size > 0


def test_mix_starts_its_own_server(out, cli):
    r = cli("bench", "mix", "--clients", "2", "--duration", "6", "--scale", "0.05", "--verify", "3",
            "--out", str(out), *TINY)
    assert r.returncode == 0, r.stdout + r.stderr
    res = load(out, "mix")
    t = res["totals"]
    assert res["continuous_usage"] is True and t["errors"] == 0 and t["requests"] >= 2
    assert t["requests"] == sum(k["requests"] for k in res["by_kind"].values())
    assert t["prompt_tokens"] == sum(k["prompt_tokens"] for k in res["by_kind"].values()) > 0
    assert all(k["prompt_tokens_unknown"] == 0 for k in res["by_kind"].values())  # cut streams counted too
    assert t["generated_tok_s"] == pytest.approx(t["generated_tokens"] / t["elapsed_s"])
    assert res["json_schema"]["kept_to_schema"] <= res["json_schema"]["finished"]
    assert 0 < res["verify"]["checked"] <= 3 and res["verify"]["equal"] <= res["verify"]["checked"]
    assert (out / "mix.png").stat().st_size > 0


def test_beams_against_samples_and_hf(out, cli):
    r = cli("bench", "beams", *TINY, "cache.block_size=4", "--beams", "2,3", "--num-prompts", "2", "--input-len", "6",
            "--output-len", "5", "--repeat", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    res = load(out, "beams")
    assert set(res["widths"]) == {"2", "3"}
    for n, w in res["widths"].items():
        tokens = 2 * int(n) * 5  # every sequence decodes --output-len tokens
        assert w["beam"]["tokens"] == w["sample"]["tokens"] == w["hf"]["tokens"] == tokens
        assert w["beam"]["kv_blocks_copied"] > 0 and w["sample"]["kv_blocks_copied"] == 0  # forks mid-block
        assert len(w["beam"]["runs_elapsed_s"]) == 2 and w["beam"]["elapsed_s"] in w["beam"]["runs_elapsed_s"]
        assert w["ratio_vs_hf"] == pytest.approx(w["beam"]["tok_s"] / w["hf"]["tok_s"])
        assert w["beam_vs_sample"] == pytest.approx(w["beam"]["tok_s"] / w["sample"]["tok_s"])
        assert 0 < w["beam"]["bandwidth_fraction"] and w["beam"]["steps"] >= 5
    assert (out / "beams.png").stat().st_size > 0


def test_spec(out, cli):
    r = cli("bench", "spec", *TINY, "--output-len", "12", "--concurrency", "1,2", "--repeat", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    res = load(out, "spec")
    assert set(res["runs"]) == {f"{w} c={c}" for w in ("extractive", "free_form") for c in (1, 2)}
    for both in res["runs"].values():
        assert both["plain"]["output_tokens"] == both["spec"]["output_tokens"] > 0  # greedy: the same tokens
        assert len(both["plain"]["repeats_output_tok_s"]) == len(both["spec"]["repeats_output_tok_s"]) == 2
        assert both["speedup"] > 0 and "drafts" not in both["plain"]
    assert (out / "spec.png").stat().st_size > 0


def test_structured(out, cli):
    r = cli("bench", "structured", *TINY, "--max-tokens", "12", "--concurrency", "1,2", "--num-prompts", "2",
            "--repeat", "1", "--compiles", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    res = load(out, "structured")
    assert set(res["runs"]) == {"c=1", "c=2"} and res["target"]["met"] is None  # no 8-concurrent level
    for both in res["runs"].values():
        for name in ("plain", "json"):
            run = both[name]
            assert run["requests"] == 2 and 0 < run["output_tokens"] <= 2 * 12 and run["output_tok_s"] > 0
            assert run["mean_output_len"] == pytest.approx(run["output_tokens"] / 2) and run["ms_per_output_token"] > 0
            assert run["grammar_compiles_during_run"] == 0  # the schema was compiled before the timed runs
            assert 1 <= run["max_running"] <= 2
        assert both["json"]["valid_json"] <= both["json"]["ended_by_grammar"] <= 2
        assert both["ratio"] == pytest.approx(both["json"]["output_tok_s"] / both["plain"]["output_tok_s"])
    comp = res["compile"]
    assert len(comp["cold"]["all_ms"]) == len(comp["cold_compile_thread"]["all_ms"]) == 2
    assert comp["cold"]["median_ms"] > 0 and comp["cached"]["max_ms"] >= 0 and comp["cached_recompiles"] == 0
    assert len(res["first_compile_ms"]) == 1
    assert res["host"]["cpu_isa"] is not None and (out / "structured.png").stat().st_size > 0


def test_parallel(out, cli):
    r = cli("bench", "parallel", *TINY, "--layouts", "pp2 (shm)", "--num-prompts", "2", "--output-len", "4",
            "--iters", "100", "--out", str(out))
    assert r.returncode == 0, r.stderr
    res = load(out, "parallel")
    runs = res["runs"]
    assert set(runs) == {"1 rank (native forward)", "1 rank (torch layer path)", "pp2 (shm)", "1 core (served)",
                         "dp2 (served)"}
    assert all(run["output_tok_s"] > 0 for run in runs.values())
    pp = runs["pp2 (shm)"]
    assert pp["ranks"] == 2 and pp["executor"] == "mp" and pp["collectives"] == "shm"
    assert pp["collectives_per_step"] == 2 and 0 < pp["comm_ms_per_step"] < pp["ms_per_step"] + pp["comm_ms_per_step"]
    assert pp["rest_ms_per_step"] == pytest.approx(pp["ms_per_step"] - pp["comm_ms_per_step"])
    assert runs["dp2 (served)"]["ok"] == 2 and runs["dp2 (served)"]["vs_one_core_served"] > 0
    assert set(res["all_reduce_latency_us"]) == {"shm/2", "gloo/2"}
    assert all(v > 0 for v in res["all_reduce_latency_us"].values())
    assert res["host"]["cpu"] and (out / "parallel.png").stat().st_size > 0


def test_moe(out, cli):
    r = cli("bench", "moe", "model.hidden_size=64", "model.moe_intermediate_size=32", "model.intermediate_size=32",
            "model.head_dim=16", "model.num_layers=2", "--num-prompts", "2", "--input-len", "8", "--output-len", "6",
            "--eplb-interval", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    res = load(out, "moe")
    runs = res["runs"]
    assert set(runs) == {"native forward (grouped)", "torch path (grouped)", "torch path (per-token loop)",
                         "ep2 (torch path)", "ep2 + eplb every 2 forwards"}
    assert all(run["output_tok_s"] > 0 and run["achieved_gflop_s"] > 0 for run in runs.values())
    eplb = runs["ep2 + eplb every 2 forwards"]["eplb"]
    assert eplb["rebalances"] >= 2 and eplb["rebalance_s"] > 0 and 0 < eplb["balancedness"] <= 1
    assert runs["ep2 (torch path)"]["eplb"] is None
    assert runs["native forward (grouped)"]["native_forward"] and runs["native forward (grouped)"]["native_phase_s"]
    assert runs["torch path (per-token loop)"]["vs_per_token_loop"] == 1.0
    assert res["experts"]["num_experts"] == 8 and res["peak_gflop_s"] > 0
    assert (out / "moe.png").stat().st_size > 0


def test_perplexity(out, cli, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The lamp was trimmed and the glass was cleaned. " * 12)
    r = cli("bench", "perplexity", "--text", str(text), "--window", "40", "--out", str(out),
            "--also", "cache.kv_cache_dtype=bfloat16", *TINY, "model.dtype=float32")
    assert r.returncode == 0, r.stderr
    res = load(out, "perplexity")
    ref, bf16 = res["reference"], res["also"]["cache.kv_cache_dtype=bfloat16"]
    from appliance.bench.perplexity import windows

    cut = windows(list(range(ref["text_tokens"])), 40)
    assert ref["tokens_scored"] == bf16["tokens_scored"] == sum(len(w) - 1 for w in cut)
    assert ref["perplexity"] > 1 and ref["mean_nll"] == pytest.approx(math.log(ref["perplexity"]))
    assert ref["kv_cache_dtype"] == "float32" and bf16["kv_cache_dtype"] == "bfloat16"
    assert bf16["delta_perplexity_pct"] == pytest.approx(100 * (bf16["perplexity"] / ref["perplexity"] - 1))
    assert (out / "perplexity.png").stat().st_size > 0
