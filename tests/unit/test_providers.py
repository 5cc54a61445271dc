"""A kernel package is selected only if it really serves: fake packages on
sys.path stand for the ones PyPI has (an empty placeholder, a build without
paged KV, one that does not load on this torch, a JIT without nvcc)."""

import os
import sys

import pytest
import torch

import appliance.kernels.registry as reg
from appliance.config.compose import resolve
from appliance.kernels import flashinfer_moe, marlin_int4, providers

FA3 = "def flash_attn_with_kvcache(*args, **kwargs):\n    raise RuntimeError('not a GPU')\n"


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path to write fake packages into; their modules and the probe cache are forgotten after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    providers._probe.cache_clear()
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]
    providers._probe.cache_clear()


def package(site, name, init="", libraries=()):
    """A package ``name`` with ``init`` as its __init__ and fake compiled libraries holding the given bytes."""
    root = site.joinpath(*name.split("."))
    root.mkdir(parents=True)
    (root / "__init__.py").write_text(init)
    for i, blob in enumerate(libraries):
        (root / f"_C{i}.cpython.so").write_bytes(b"\x7fELF" + b"\0" * 64 + blob + b"\0" * 64)


def test_an_empty_placeholder_is_rejected(site):
    package(site, "flash_attn_interface")
    assert providers.probe("flash_attn_interface") == (
        "has no flash_attn_with_kvcache (a placeholder package, or another build of flash-attention's hopper/ "
        "build (FA3))")


def test_a_build_without_paged_kv_or_fp16_is_rejected_for_what_it_lacks(site):
    package(site, "fa3_fwd_interface", FA3, [b"This flash attention build does not support paged KV.",
                                             b"This flash attention build does not support FP16."])
    needs = providers.attention_needs("flash_attn3", "bfloat16", "auto")
    assert needs == {"paged_kv"}
    assert providers.probe("fa3_fwd_interface", needs) == "built without paged_kv, which this deployment needs"
    assert providers.probe("fa3_fwd_interface", providers.attention_needs("flash_attn3", "float16", "auto")) == (
        "built without float16, paged_kv, which this deployment needs")
    assert providers.probe("fa3_fwd_interface") is None  # nothing needed that it lacks


def test_a_flashinfer_from_before_sinks_is_rejected_where_the_model_has_them(site):
    """The wrapper's run() must take ``sinks`` for a model with attention sinks (gpt-oss's); any build serves
    the others."""
    package(site, "flashinfer_jit_cache")  # precompiled kernels: no nvcc needed
    old = "class BatchPrefillWithPagedKVCacheWrapper:\n    def run(self, q, paged_kv_cache, *args, k_scale=None):\n" \
          "        pass\n"
    package(site, "flashinfer", old)
    assert providers.probe("flashinfer", frozenset({"sinks"})) == (
        "its BatchPrefillWithPagedKVCacheWrapper.run() takes no sinks (a flashinfer-python from before them), which "
        "this deployment needs")
    assert providers.probe("flashinfer") is None
    providers._probe.cache_clear()
    del sys.modules["flashinfer"]
    (site / "flashinfer" / "__init__.py").write_text(old.replace("k_scale=None", "k_scale=None, sinks=None"))
    assert providers.probe("flashinfer", frozenset({"sinks"})) is None


def test_a_full_build_serves(site):
    package(site, "fa3_fwd_interface", FA3, [b"an ordinary library"])
    assert providers.probe("fa3_fwd_interface", providers.attention_needs("flash_attn3", "float16", "fp8_e4m3")) is None


def test_a_package_that_does_not_load_says_why(site):
    package(site, "sgl_kernel", "raise OSError('libtorch_cuda.so: undefined symbol: _ZN3c10')")
    assert providers.probe("sgl_kernel") == "does not import: OSError: libtorch_cuda.so: undefined symbol: _ZN3c10"


@pytest.fixture
def no_nvcc(monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(providers.os, "access", lambda path, mode: False)  # no /usr/local/cuda/bin/nvcc either


FLASHINFER = "class BatchPrefillWithPagedKVCacheWrapper:\n    pass\n"


def test_a_jit_package_without_nvcc_is_rejected_with_the_way_out(site, no_nvcc):
    package(site, "flashinfer", FLASHINFER)
    assert providers.nvcc() is None
    assert providers.probe("flashinfer") == (
        "compiles its kernels at first use and there is no nvcc here (set CUDA_HOME, or install "
        "flashinfer-jit-cache or flashinfer-cubin for precompiled kernels)")


def test_a_jit_package_with_precompiled_kernels_needs_no_nvcc(site, no_nvcc):
    package(site, "flashinfer", FLASHINFER)
    package(site, "flashinfer_jit_cache")
    assert providers.probe("flashinfer") is None


def test_a_jit_package_uses_the_nvcc_of_cuda_home(site, tmp_path_factory, monkeypatch):
    package(site, "flashinfer", FLASHINFER)
    home = tmp_path_factory.mktemp("cuda")
    (home / "bin").mkdir()
    (home / "bin" / "nvcc").write_text("#!/bin/sh\n")
    os.chmod(home / "bin" / "nvcc", 0o755)
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setenv("PATH", "/nonexistent")
    assert providers.nvcc() == str(home / "bin" / "nvcc")
    assert providers.probe("flashinfer") is None


def test_the_selector_skips_unusable_fa3_builds_and_names_each(site, monkeypatch):
    package(site, "flash_attn_interface")
    package(site, "fa3_fwd_interface", FA3, [b"This flash attention build does not support paged KV."])
    package(site, "sgl_kernel", "raise OSError('undefined symbol')")
    cfg = resolve(["+profile=h100_bf16", "model=tiny_random", "model.head_dim=64", "attention.fallback=allow"]).cfg
    sel = reg.select_backend(cfg, "bfloat16", check_import=True)
    reasons = dict(sel.rejected)["flash_attn3"]
    assert reasons == ["no usable package: flash_attn_interface: has no flash_attn_with_kvcache (a placeholder "
                       "package, or another build of flash-attention's hopper/ build (FA3)) | fa3_fwd_interface: "
                       "built without paged_kv, which this deployment needs | sgl_kernel.flash_attn: does not "
                       "import: OSError: undefined symbol"]
    assert sel.chosen != "flash_attn3"


def test_marlin_and_flashinfer_moe_say_why_they_do_not_run_on_a_cpu():
    assert marlin_int4.unusable_reason(torch.device("cpu")) == "it runs on NVIDIA GPUs, not cpu"
    assert not marlin_int4.usable(torch.device("cpu"), torch.bfloat16)
    assert flashinfer_moe.unusable_reason(torch.zeros(2, 4)) == "it runs on NVIDIA GPUs, not cpu"
    assert not flashinfer_moe.usable(torch.zeros(2, 4, dtype=torch.bfloat16))
