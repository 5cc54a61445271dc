"""`appliance bench scheduler` in its short CI form: well-formed results, no timing asserts."""

import json

import pytest


def test_bench_scheduler_short(cli, tmp_path):
    r = cli("bench", "scheduler", "--sizes", "1,64", "--steps", "3", "--prompt-len", "40", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "scheduler.json").read_text())
    assert [p["num_running"] for p in data["points"]] == [1, 1, 64, 64]
    shared = [p for p in data["points"] if p["shared_prefix"] and p["num_running"] == 64][0]
    # 30 shared tokens = 1 full block of 16 out of 40, for all but the first request
    assert shared["prefix_hit_rate"] == pytest.approx(16 / 40 * 63 / 64)
    assert all(p["decode_us_per_step"] > 0 for p in data["points"])
    assert 0 <= data["kv_waste"]["kv_waste_ratio"] < 1
    assert (tmp_path / "scheduler.png").stat().st_size > 0


def test_bench_unknown_kind(cli):
    r = cli("bench", "nope")
    assert r.returncode == 2 and "unknown bench kind 'nope'" in r.stderr
