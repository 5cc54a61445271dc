"""Per-profile backend composition against faked hardware and packages."""

import pytest

import appliance.kernels.registry as reg
from appliance.config.compose import ConfigError, resolve
from appliance.config.detect import DeviceDescription
from appliance.config.plan import make_plan
from appliance.config.execution import check_runnable
from tests.kernel_helpers import fake_packages

EXPECTED = {
    "cpu": ("cpu_native", []),
    "cpu_int8": ("cpu_native", []),
    "cpu_int4": ("cpu_native", []),
    "h100_bf16": ("flash_attn3", []),
    "h100_fp8": ("flash_attn3", []),
    "h200_fp8": ("flash_attn3", []),
    "b200_fp8": ("flashinfer", []),
    "mi300x_bf16": ("triton", []),
}

DEVICES = {
    "cpu": DeviceDescription("cpu"),
    "cpu_int8": DeviceDescription("cpu"),
    "cpu_int4": DeviceDescription("cpu"),
    "h100_bf16": DeviceDescription("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 79.6, 8),
    "h100_fp8": DeviceDescription("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 79.6, 8),
    "h200_fp8": DeviceDescription("cuda", "NVIDIA H200", (9, 0), 139.8, 8),
    "b200_fp8": DeviceDescription("cuda", "NVIDIA B200", (10, 0), 178.4, 8),
    "mi300x_bf16": DeviceDescription("rocm", "AMD Instinct MI300X", None, 191.5, 8),
}


@pytest.mark.parametrize("profile", list(EXPECTED))
def test_plan_names_backend_for_every_profile(profile):
    p = make_plan(resolve([f"+profile={profile}", "model=llama3_1_8b" if not profile.startswith("cpu") else "model=smollm2_135m"]).cfg)
    assert p.attention_backend == EXPECTED[profile][0]
    assert p.attention_chain[-1].startswith(f"{EXPECTED[profile][0]}: chosen")


@pytest.mark.parametrize("profile", list(EXPECTED))
def test_runtime_composition_on_faked_hardware(profile, monkeypatch):
    fake_packages(monkeypatch, set(reg.BACKENDS))
    r = resolve([f"+profile={profile}"])
    sel = check_runnable(r, DEVICES[profile]).selection
    assert sel.chosen == EXPECTED[profile][0] and not sel.fallback_used


def test_fallback_deny_fails_with_every_reason(monkeypatch):
    fake_packages(monkeypatch, {"flashinfer", "triton"})
    r = resolve(["+profile=h100_bf16"])
    with pytest.raises(ConfigError) as e:
        check_runnable(r, DEVICES["h100_bf16"])
    msg = str(e.value)
    assert "flash_attn3: rejected: no usable package: flash_attn_interface" in msg
    assert "attention.fallback=allow" in msg


def test_fallback_allow_walks_the_chain(monkeypatch):
    fake_packages(monkeypatch, {"triton"})
    r = resolve(["+profile=h100_bf16", "attention.fallback=allow"])
    ex = check_runnable(r, DEVICES["h100_bf16"])
    sel = ex.selection
    assert sel.chosen == "triton" and sel.fallback_used
    assert [name for name, _ in sel.rejected] == ["flash_attn3", "flashinfer"]
    assert ex.fallback_note().startswith("attention backend triton instead of flash_attn3 (no usable package")
    assert "install a package that provides flash_attn3 (README, Install notes)" in ex.fallback_note()


def test_static_rejections_are_recorded():
    # head_dim 80 is not a FlashInfer size; b200 walks on to Triton with the reason.
    r = resolve(["+profile=b200_fp8", "model=tiny_random", "model.head_dim=80", "model.num_heads=4",
                 "model.num_kv_heads=2"], check=False)
    sel = reg.select_backend(r.cfg, "bfloat16", check_import=False)
    assert sel.chosen == "triton"
    assert sel.rejected == [("flashinfer", ["head_dim 80 not in [64, 128, 256]"])]


def test_forced_backend_and_capability_reasons(monkeypatch):
    fake_packages(monkeypatch, set(reg.BACKENDS))
    r = resolve(["+profile=b200_fp8", "attention.backend=flash_attn3"], check=False)
    sel = reg.select_backend(r.cfg, "bfloat16", check_import=True)
    assert sel.chosen is None
    assert sel.rejected == [("flash_attn3", ["compute capability 10.0 above 9.0"])]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # under the interpreter triton runs on CPU
    r = resolve(["+profile=cpu", "attention.backend=triton"], check=False)
    sel = reg.select_backend(r.cfg, "float32", check_import=True)
    assert sel.rejected[0][1][0].startswith("device kind cpu not in ['cuda', 'rocm'] (TRITON_INTERPRET=1 runs it")


def test_capability_mismatch_and_missing_devices():
    r = resolve(["+profile=h100_bf16"])
    with pytest.raises(ConfigError, match="targets compute capability 9.0 but NVIDIA A100 has 8.0"):
        check_runnable(r, DeviceDescription("cuda", "NVIDIA A100", (8, 0), 80, 1))
    r = resolve(["+profile=h100_bf16", "parallel=tp8", "model=llama3_1_8b"])
    with pytest.raises(ConfigError, match="needs 8 devices; this machine has 1"):
        check_runnable(r, DeviceDescription("cuda", "NVIDIA H100", (9, 0), 80, 1))


def test_cli_plan_prints_chain_for_every_profile(cli):
    for profile, (backend, _) in EXPECTED.items():
        r = cli("plan", f"+profile={profile}")
        assert r.returncode == 0, r.stderr
        assert f"attention backend  {backend}" in r.stdout
        if backend in ("flash_attn3", "flashinfer"):  # CUDA-only packages, not installed on CPU machines
            assert f"{backend} has no usable package on this machine" in r.stdout


def test_cpu_falls_back_to_torch_sdpa_when_native_kernels_cannot_build(monkeypatch):
    fake_packages(monkeypatch, {"torch_sdpa"})
    sel = check_runnable(resolve(["+profile=cpu"]), DEVICES["cpu"]).selection
    assert sel.chosen == "torch_sdpa" and sel.fallback_used
    assert any(line.startswith("cpu_native: rejected: no usable package") for line in sel.explain())


def test_cpu_native_runs_bf16_and_fp8_kv():
    cfg = resolve(["+profile=cpu", "model.dtype=bfloat16"]).cfg
    assert reg.BACKENDS["cpu_native"].validate(cfg, "bfloat16") == []
    assert make_plan(cfg).attention_backend == "cpu_native"
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        cfg = resolve(["+profile=cpu", f"cache.kv_cache_dtype={kv}"]).cfg
        assert reg.BACKENDS["cpu_native"].validate(cfg, "float32") == []
    assert any("kv_cache_dtype fp8_e5m2" in r for r in reg.BACKENDS["triton"].validate(cfg, "float32"))
