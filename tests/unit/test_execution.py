"""What a config resolves to on a host: CPU feature detection from faked
/proc/cpuinfo flag sets, dtype and backend chosen together, the deployment
fingerprint, and where the resolution is shown."""

import json

import pytest

import appliance.config.detect as detect
import appliance.kernels.registry as reg
from appliance.config.compose import resolve
from appliance.config.detect import DeviceDescription, parse_cpuinfo
from appliance.config.execution import resolve_execution
from appliance.config.plan import make_plan
from appliance.config.execution import check_runnable
from tests.kernel_helpers import fake_packages

BASE_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c"
HOSTS = {
    "avx2": f"{BASE_FLAGS} avx2 fma",
    "avx512f": f"{BASE_FLAGS} avx2 fma avx512f avx512bw avx512vl",
    "avx512_bf16": f"{BASE_FLAGS} avx2 fma avx512f avx512bw avx512_vnni avx512_bf16",
    "amx": f"{BASE_FLAGS} avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_int8 amx_tile",
}
FAST_BF16 = {"avx2": False, "avx512f": False, "avx512_bf16": True, "amx": True}
CPU = DeviceDescription("cpu")


def cpuinfo_text(flags: str) -> str:
    core = "processor\t: {n}\nvendor_id\t: GenuineIntel\nmodel name\t: Test CPU\nflags\t\t: {flags}\n\n"
    return "".join(core.format(n=n, flags=flags) for n in range(2))


@pytest.fixture(params=list(HOSTS))
def host(request, tmp_path, monkeypatch):
    """This process sees a CPU with one of the flag sets."""
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo_text(HOSTS[request.param]))
    monkeypatch.setattr(detect, "CPUINFO", str(path))
    return request.param


def test_parse_cpuinfo_flag_sets(host):
    info = detect.cpu_info()
    assert info.model == "Test CPU"
    assert info.fast_bf16 is FAST_BF16[host]
    assert info.isa[:2] == ["avx2", "fma"]
    assert ("avx512_bf16" in info.isa) is (host in ("avx512_bf16", "amx"))
    assert "Test CPU (avx2 fma" in info.describe()


def test_parse_cpuinfo_without_flags():
    info = parse_cpuinfo("processor\t: 0\n")
    assert info.model == "" and not info.fast_bf16 and info.describe() == "unknown CPU (no AVX2)"


def test_without_a_gpu_drivers_nodes_the_device_is_the_cpu_and_torch_is_not_asked(tmp_path, monkeypatch):
    """On Linux, no NVIDIA, AMD or WSL2 GPU node means no CUDA or ROCm device:
    detect_device answers without importing torch (``appliance plan`` stays fast)."""
    import sys

    node = tmp_path / "nvidiactl"
    monkeypatch.setattr(sys, "platform", "linux")
    assert detect.no_gpu_driver((str(tmp_path / "kfd"),))
    node.touch()
    assert not detect.no_gpu_driver((str(tmp_path / "kfd"), str(node)))
    monkeypatch.setattr(sys, "platform", "darwin")
    assert not detect.no_gpu_driver((str(tmp_path / "kfd"),))  # elsewhere torch is asked

    monkeypatch.setattr(detect, "no_gpu_driver", lambda: True)
    monkeypatch.setitem(sys.modules, "torch", None)  # an import of torch would raise
    assert detect.detect_device() == DeviceDescription(kind="cpu", name="cpu")


@pytest.mark.parametrize("profile, dtype", [("cpu", "bfloat16"), ("cpu_int8", "float32"), ("cpu_int4", "float32")])
def test_native_kernels_run_their_fastest_dtype_on_every_cpu(host, profile, dtype, monkeypatch):
    """bf16 weights halve what the native kernels stream; with int8 or int4 weights fp32 is faster."""
    fake_packages(monkeypatch, {"cpu_native", "torch_sdpa"})
    ex = check_runnable(resolve([f"+profile={profile}"]), CPU)
    assert (ex.backend, ex.dtype) == ("cpu_native", dtype)
    assert ex.fallback_note() is None
    assert "Test CPU" in ex.host


def test_without_native_kernels_torch_runs_bf16_only_where_the_cpu_has_it(host, monkeypatch):
    fake_packages(monkeypatch, {"torch_sdpa"})
    ex = check_runnable(resolve(["+profile=cpu"]), CPU)
    assert ex.backend == "torch_sdpa"
    assert ex.dtype == ("bfloat16" if FAST_BF16[host] else "float32")
    note = ex.fallback_note()
    assert note.startswith("attention backend torch_sdpa instead of cpu_native (no usable package")
    assert "install gcc" in note
    # The plan for the target hardware (not probed) still names the native kernels.
    static = resolve_execution(resolve(["+profile=cpu"]).cfg)
    assert (static.backend, static.dtype, static.probed) == ("cpu_native", "bfloat16", False)


def test_fallback_deny_does_not_walk_on(monkeypatch):
    fake_packages(monkeypatch, {"torch_sdpa"})
    with pytest.raises(reg.BackendSelectionError, match="cpu_native: rejected: no usable package"):
        check_runnable(resolve(["+profile=cpu", "attention.fallback=deny"]), CPU)


@pytest.mark.parametrize("reason, fix", [
    ("dtype float16 not in ['float32']", "model.dtype=auto"),
    ("kv_cache_dtype fp8_e4m3 not in ['auto', 'bfloat16']", "cache.kv_cache_dtype=auto"),
    ("no usable package: appliance.kernels.cpu_native: ImportError: no gcc", "install gcc"),
])
def test_fallback_note_names_the_reason_and_the_fix(reason, fix):
    from dataclasses import replace

    ex = resolve_execution(resolve(["+profile=cpu"]).cfg)
    sel = reg.Selection(chosen="torch_sdpa", rejected=[("cpu_native", [reason])], fallback_used=True)
    note = replace(ex, selection=sel).fallback_note()
    assert note.startswith(f"attention backend torch_sdpa instead of cpu_native ({reason})")
    assert f"to run cpu_native: {fix}" in note
    assert replace(ex, selection=reg.Selection(chosen="cpu_native")).fallback_note() is None


def test_fingerprint_follows_the_host_but_the_config_hash_does_not(monkeypatch, tmp_path):
    fake_packages(monkeypatch, {"torch_sdpa"})
    r = resolve(["+profile=cpu"])
    prints = {}
    for name in ("avx2", "avx512_bf16"):
        path = tmp_path / name
        path.write_text(cpuinfo_text(HOSTS[name]))
        monkeypatch.setattr(detect, "CPUINFO", str(path))
        assert resolve(["+profile=cpu"]).hash == r.hash
        prints[name] = check_runnable(r, CPU).fingerprint(r.hash)
    assert prints["avx2"] != prints["avx512_bf16"]
    assert len(prints["avx2"]) == 16


def test_plan_shows_what_was_asked_and_what_runs(monkeypatch, host):
    fake_packages(monkeypatch, {"torch_sdpa"})
    r = resolve(["+profile=cpu"])
    p = make_plan(r.cfg, check_runnable(r, CPU))
    want = "bfloat16" if FAST_BF16[host] else "float32"
    assert p.dtype == want and p.attention_backend == "torch_sdpa"
    assert p.execution["dtype"] == {"requested": "auto", "resolved": want, "reason": p.execution["dtype"]["reason"]}
    assert p.kv_bytes_per_token == 2 * 30 * 3 * 64 * (2 if want == "bfloat16" else 4)
    assert any(line.startswith(f"dtype              auto -> {want} on this host") for line in p.summary)


def test_cli_plan_config_and_profiles_show_this_host(cli):
    r = cli("plan", "+profile=cpu", "model=tiny_random")
    assert r.returncode == 0, r.stderr
    assert "host               cpu: " in r.stdout and "on this host" in r.stdout and "deployment   " in r.stdout
    plan = json.loads(cli("plan", "+profile=cpu", "model=tiny_random", "--json").stdout)
    assert plan["execution"]["probed"] and len(plan["deployment"]) == 16
    r = cli("config", "+profile=cpu", "model=tiny_random")
    assert r.returncode == 0 and "# dtype              float32 -> float32 on this host" in r.stdout
    assert f"# deployment         {plan['deployment']}" in r.stdout
    r = cli("plan", "+profile=h100_bf16")
    assert "(target hardware, not probed here)" in r.stdout
    r = cli("profiles")
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith("cpu_int8 "))
    assert "cpu_native" in row and row.endswith("yes")


def test_fallback_is_printed_once_after_the_profile_line(cli, tmp_path):
    """No C compiler and no cached kernels: the CPU profile falls back to
    torch_sdpa and every entry point says so once, with the fix."""
    env = {"CC": str(tmp_path / "no-such-cc"), "APPLIANCE_CACHE_DIR": str(tmp_path / "cache")}
    r = cli("plan", "model=tiny_random", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("profile auto -> cpu: ")
    assert lines[1].startswith("note: attention backend torch_sdpa instead of cpu_native (no usable package")
    assert "to run cpu_native: install gcc" in lines[1]
    assert r.stdout.count("instead of cpu_native") == 1
    r = cli("generate", "model=tiny_random", "prompt=Hello", "max_tokens=2", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("instead of cpu_native") == 1
    assert r.stderr.index("profile auto -> cpu") < r.stderr.index("instead of cpu_native")
