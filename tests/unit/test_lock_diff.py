"""Committed resolved configs and semantic diffs."""


import appliance.config.lock as lock
from appliance.config.compose import resolve


def test_committed_resolved_configs_match_the_tree():
    drift = lock.check_locks()
    report = "\n".join(f"{p}:\n  " + "\n  ".join(lines) for p, lines in drift.items())
    assert not drift, f"resolved/ drifted; run `appliance lock`:\n{report}"


def test_drift_is_detected_with_a_semantic_diff(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "LOCK_DIR", tmp_path)
    lock.write_locks()
    assert lock.check_locks() == {}
    path = tmp_path / "cpu.yaml"
    path.write_text(path.read_text().replace("block_size: 16", "block_size: 32"))
    drift = lock.check_locks()
    assert list(drift) == ["cpu"]
    lines = drift["cpu"]
    assert "cache.block_size: 32 -> 16" in lines
    assert any(ln.strip().startswith("plan.num_kv_blocks: 2912 -> 5825") for ln in lines)


def test_semantic_diff_names_keys_and_plan_effects():
    a = resolve(["+profile=h100_bf16", "model=llama3_1_8b"]).cfg
    b = resolve(["+profile=h100_fp8", "model=llama3_1_8b"]).cfg
    lines = lock.semantic_diff(a, b)
    assert "quantization.method: 'none' -> 'fp8'" in lines
    assert "cache.kv_cache_dtype: 'auto' -> 'fp8_e4m3'" in lines
    assert any("plan.kv_bytes_per_token: 131072 -> 65536" in ln for ln in lines)
    assert lock.semantic_diff(a, a) == []


def test_cli_diff_accepts_profiles_files_and_override_sets(cli, tmp_path):
    r = cli("diff", "cpu", "+profile=cpu cache.block_size=32")
    assert r.returncode == 0, r.stderr
    assert "cache.block_size: 16 -> 32" in r.stdout
    r = cli("diff", "resolved/cpu.yaml", "cpu")
    assert r.stdout.strip() == "no differences"
    r = cli("diff", "cpu", "nonsense")
    assert r.returncode == 2 and "neither a profile" in r.stderr


def test_lock_check_cli_passes(cli):
    r = cli("lock", "--check")
    assert r.returncode == 0, r.stdout
    assert "resolved configs match the tree" in r.stdout
