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
