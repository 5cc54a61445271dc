"""The side-by-side report of `bench serve` runs (scripts/bench_vs_llamacpp.sh):
ratios are same-level, same-run, against the baseline's file."""

import json

from appliance.bench.compare import compare, main


def serve_json(label: str, levels: dict[int, tuple[float, float]]) -> dict:
    return {"bench": f"serve-{label}", "host": {"cpu": "Test CPU", "cpus": 2, "cpu_isa": ["avx2", "fma"]},
            "server": label, "input_len": 100, "output_len": 128,
            "levels": [{"max_concurrency": c, "output_tok_s": tok, "ttft_ms": {"p50": ttft}, "failed": 0}
                       for c, (tok, ttft) in levels.items()]}


def test_ratios_are_per_level_against_the_baseline(tmp_path):
    (tmp_path / "serve-llama.cpp.json").write_text(json.dumps(serve_json("llama.cpp", {1: (80.0, 360.0),
                                                                                      32: (140.0, 900.0)})))
    (tmp_path / "serve-appliance-cpu.json").write_text(json.dumps(serve_json("appliance-cpu", {1: (160.0, 90.0),
                                                                                              8: (500.0, 300.0),
                                                                                              32: (700.0, 450.0)})))
    result = compare(tmp_path, "llama.cpp", ["appliance-cpu"])
    rows = {r["max_concurrency"]: r for r in result["rows"]}
    assert set(rows) == {1, 32}  # a level the baseline did not run has no ratio
    assert rows[1]["tok_s_ratio"] == 2.0 and rows[1]["ttft_ratio"] == 0.25
    assert rows[32]["tok_s_ratio"] == 5.0 and rows[32]["ttft_ratio"] == 0.5
    assert result["host"]["cpu"] == "Test CPU"
    assert main([str(tmp_path), "llama.cpp", "appliance-cpu"]) == 0
    md = (tmp_path / "compare.md").read_text()
    assert "| appliance-cpu | 1 | 160.0 | 80.0 | 2.00x |" in md and "avx2 fma" in md


def test_runs_of_one_server_merge_and_the_prompt_alone_compares(tmp_path):
    from appliance.bench.compare import merge

    def write(label, levels, mixed=None):
        run = serve_json(label, levels)
        if mixed is not None:
            run["mixed_load"] = mixed
        (tmp_path / f"serve-{label}.json").write_text(json.dumps(run))

    alone = lambda ms, itl: {"streams": 0, "long_prompt_len": 4500, "output_len": 2048,  # noqa: E731
                             "long_prompt_ttft_ms": ms, "long_prompt_itl_p50_ms": itl,
                             "stream_itl_p50_ms_before": None, "worst_stream_gap_ms": 0.0,
                             "worst_gap_over_itl": None, "stream_tokens_during_prefill": 0}
    for label, ms, tok, itl in (("vllm", 30000.0, 50.0, 90.0), ("appliance-bf16", 20000.0, 80.0, 60.0)):
        # vllm's run is its prompt alone (as LONG_ONLY=1 keeps it): no mixed load
        write(label, {8: (tok, 500.0)}, alone(ms, itl) if label == "vllm" else None)
        write(f"{label}-c1", {1: (tok / 5, 100.0)})
        write(f"{label}-alone", {}, alone(ms, itl))
        merged = merge(tmp_path, label, [f"{label}-c1", f"{label}-alone"])
        assert [lv["max_concurrency"] for lv in merged["levels"]] == [1, 8]
        assert merged["prefill_alone"]["long_prompt_ttft_ms"] == ms
    result = compare(tmp_path, "vllm", ["appliance-bf16"])
    assert {r["max_concurrency"]: r["tok_s_ratio"] for r in result["rows"]} == {1: 1.6, 8: 1.6}
    [base, ours] = result["prefill_alone"]
    assert base["speedup_over_baseline"] == 1.0 and ours["speedup_over_baseline"] == 1.5
    assert ours["prompt_tok_s"] == 225.0
    assert ours["itl_ms"] == 60.0 and ours["itl_speedup_over_baseline"] == 1.5  # its decode at 4,500 tokens
    assert result["mixed_load"] == []  # a prompt alone is no mixed load
    assert main([str(tmp_path), "vllm", "appliance-bf16"]) == 0
    assert "| appliance-bf16 | 4500 | 20000 | 225 | 1.50x | 60.0 | 1.50x |" in (tmp_path / "compare.md").read_text()


def test_the_request_mix_compares_where_servers_ran_it(tmp_path):
    def mix(requests, prompt, generated):
        return {"clients": 8, "duration_s": 240.0, "verify": {"checked": 16, "equal": 16},
                "totals": {"requests": requests, "prompt_tokens": prompt, "generated_tokens": generated, "errors": 0}}

    for label in ("vllm", "appliance-default", "appliance-bf16"):
        (tmp_path / f"serve-{label}.json").write_text(json.dumps(serve_json(label, {8: (100.0, 500.0)})))
    (tmp_path / "mix-vllm.json").write_text(json.dumps(mix(800, 200_000, 16_000)))
    (tmp_path / "mix-appliance-default.json").write_text(json.dumps(mix(1000, 260_000, 20_000)))
    result = compare(tmp_path, "vllm", ["appliance-default", "appliance-bf16"])  # bf16 ran no mix
    rows = {m["server"]: m for m in result["request_mix"]}
    assert set(rows) == {"vllm", "appliance-default"}
    assert rows["appliance-default"]["ratio"] == {"requests": 1.25, "prompt_tokens": 1.3, "generated_tokens": 1.25}
    assert main([str(tmp_path), "vllm", "appliance-default", "appliance-bf16"]) == 0
    md = (tmp_path / "compare.md").read_text()
    assert "| appliance-default | 8 x 240 | 1000 (1.25x) | 260000 (1.30x) | 20000 (1.25x) | 0 | 16 of 16 |" in md


def test_decode_at_long_context_compares_where_servers_ran_it(tmp_path):
    def long_context(label, rows):
        return {"host": {"cpu": "Test CPU", "cpus": 2, "cpu_isa": ["avx2"]},
                "deployments": {label: {"server": label, "kv_bytes_per_token": 23040, "rows": [
                    {"context": c, "streams": s, "prefill_tok_s": pf, "itl_ms": itl, "decode_tok_s": s / itl * 1e3,
                     "ttft_max_ms": 30.0, **({"kv_GBps": 25.0} if c > 512 else {})}
                    for c, s, pf, itl in rows]}}}

    # only `bench long-context` ran in this sitting: no serve runs to compare
    (tmp_path / "long_context-vllm.json").write_text(json.dumps(long_context("vllm", [
        (512, 1, 1000.0, 20.0), (512, 4, 1000.0, 30.0), (6000, 1, 500.0, 40.0), (6000, 4, 500.0, 90.0)])))
    (tmp_path / "long_context-appliance-default.json").write_text(json.dumps(long_context("appliance-default", [
        (6000, 4, 750.0, 45.0), (512, 1, 1250.0, 5.0), (6000, 1, 750.0, 10.0), (2000, 1, 900.0, 7.0)])))
    result = compare(tmp_path, "vllm", ["appliance-default"])
    assert result["rows"] == [] and result["host"]["cpu"] == "Test CPU"
    rows = {(m["server"], m["context"], m["streams"]): m for m in result["long_context"]}
    ours = rows["appliance-default", 6000, 1]
    assert ours["decode_speedup"] == 4.0 and ours["prefill_speedup"] == 1.5 and ours["itl_over_shortest"] == 2.0
    assert rows["appliance-default", 6000, 4]["decode_speedup"] == 2.0
    # four streams ran at no shorter context: the 6,000 one is their shortest
    assert rows["appliance-default", 6000, 4]["itl_over_shortest"] == 1.0
    assert rows["appliance-default", 2000, 1]["decode_speedup"] is None  # the baseline ran no such context
    assert rows["vllm", 6000, 1]["decode_speedup"] == 1.0 and rows["vllm", 6000, 1]["itl_over_shortest"] == 2.0
    assert main([str(tmp_path), "vllm", "appliance-default"]) == 0
    md = (tmp_path / "compare.md").read_text()
    assert "| appliance-default | 6000 | 1 | 750 | 1.50x | 10.00 | 4.00x | 2.00x | 25.0 | 30 |" in md
    assert "| appliance-default | 2000 | 1 | 900 | - | 7.00 | - | 1.40x | 25.0 | 30 |" in md
    assert "concurrency" not in md  # no levels table without levels
