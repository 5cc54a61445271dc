"""The Triton kernels fit the GPUs they are selected for: every kernel compiled
ahead of time for sm_90a (and sm_100a and gfx942, every head and block size, in
the full run) with the tile the registry picks (tests/triton_compile.py), and
the registry's refusals and plan notes that come from the same rule."""

import json
import os
import subprocess
import sys

import pytest

import appliance.kernels.registry as reg
from appliance.config.compose import resolve
from appliance.config.plan import make_plan
from tests.conftest import REPO


@pytest.mark.parametrize("args", [pytest.param(["sm_90a"], id="sm_90a"),
                                  pytest.param(["--full"], id="full", marks=pytest.mark.slow)])
def test_every_kernel_compiles_within_the_targets_shared_memory(args):
    # its own process: the interpreter tests leave Triton's language patched for the interpreter
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "tests.triton_compile", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, r.stderr[-3000:]
    cases = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(cases) >= 15
    assert {c["kernel"] for c in cases} == {"unified_attention", "reshape_and_cache", "moe_gemm", "int_gemm",
                                            "mxfp4_gemm"}
    bad = [c for c in cases if not c["ok"]]
    assert not bad, bad


def _cfg(*overrides):
    return resolve(["model=tiny_random", *overrides]).cfg


def test_kv_tile_is_the_block_when_it_fits_and_halves_until_it_does():
    assert reg.triton_kv_tile(16, 128, 2, 64, "9.0") == 16
    assert reg.triton_kv_tile(64, 128, 2, 64, "9.0") == 64
    assert reg.triton_kv_tile(256, 128, 2, 64, "9.0") == 128
    assert reg.triton_kv_tile(256, 256, 2, 64, "9.0") == 64  # 128 took 294,916 bytes on an H200 (227 KiB there)
    assert reg.triton_kv_tile(256, 256, 4, 64, "9.0") == 16
    assert reg.triton_kv_tile(256, 256, 4, 64, "gfx942") == 0  # 64 KiB of LDS: nothing fits
    assert reg.triton_kv_tile(256, 256, 4, 64, None) == 256  # the interpreter has no limit


def test_registry_refuses_what_no_tile_fits_and_says_why():
    cfg = _cfg("+profile=mi300x_bf16", "model.dtype=float32", "model.head_dim=256", "model.num_heads=4",
               "model.num_kv_heads=2", "attention.backend=triton")
    reasons = reg.BACKENDS["triton"].validate(cfg, "float32")
    assert len(reasons) == 1 and reasons[0].startswith("head_dim 256 in float32 needs about ")
    assert "gfx942 has 65536" in reasons[0]
    assert reg.BACKENDS["triton"].validate(cfg, "bfloat16") == []


def test_plan_names_the_kv_tile_when_a_block_is_split():
    cfg = _cfg("+profile=h100_bf16", "model.head_dim=256", "model.num_heads=4", "model.num_kv_heads=2",
               "cache.block_size=256", "attention.backend=triton", "model.dtype=bfloat16")
    chain = make_plan(cfg).attention_chain
    assert chain[-1] == ("triton: reads each 256-token KV block in tiles of 64 keys: a whole block (head_dim 256, "
                         "bfloat16) would take more shared memory than a thread block has on 9.0 (232448 bytes)")
    small = make_plan(_cfg("+profile=h100_bf16", "attention.backend=triton", "model.dtype=bfloat16")).attention_chain
    assert small == ["triton: chosen"]
