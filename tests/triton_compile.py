"""Every Triton kernel compiled ahead of time for the GPU targets, no GPU needed.

``triton.compile`` runs the whole pipeline to the device binary (ptxas for
NVIDIA, the AMD backend's own linker for gfx942): a configuration that needs
more registers than exist fails there, and the compiled kernel's
``metadata.shared`` is the shared memory a launch would ask for, which Triton
checks against the device only at launch (OutOfResources). Each case
compiles one kernel for one target with the tile the registry picks
(``registry.triton_kv_tile``) and checks that it fits the target's shared
memory and that the registry's estimate bounds it; a configuration the
registry refuses is checked to need more than the target has.

Used by tests/unit/test_triton_resources.py and scripts/gpu_check.py.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Callable, Iterator

from appliance.kernels.registry import (SHARED_MEMORY_BYTES, pow2, triton_attention_shared_bytes,
                                        triton_kv_tile)

# name: (backend, arch, warp size, shared memory key)
TARGETS = {"sm_90a": ("cuda", 90, 32, "9.0"), "sm_100a": ("cuda", 100, 32, "10.0"),
           "gfx942": ("hip", "gfx942", 64, "gfx942")}
FLOATS = {"scale", "k_scale", "v_scale"}
TYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp8_e4m3": "fp8e4nv"}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def compile_kernel(kernel, target: str, pointers: dict[str, str], constexprs: dict):
    """The kernel compiled for ``target``: pointer params typed from ``pointers`` (by name, else by the
    first entry), scalars i32 (fp32 for scales). Every pointer and integer is declared divisible by 16, as
    Triton specializes them at a launch on aligned tensors: that lets it pipeline the loads through
    shared memory (cp.async / TMA), which is what takes the most of it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    backend, arch, warp, _ = TARGETS[target]
    default_ptr = next(iter(pointers.values()))
    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, default_ptr)
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    if backend == "hip" and pointers.get("k_cache_ptr") == "fp8e4nv":
        signature = {k: ("*fp8e4b8" if v == "*fp8e4nv" else v) for k, v in signature.items()}  # gfx942's fp8
    aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values())
               if t.startswith("*") or t == "i32"}
    # a fresh JITFunction: under TRITON_INTERPRET=1 (set by the interpreter tests) the module's kernels are
    # wrapped for the interpreter, which compiles nothing
    return triton.compile(ASTSource(fn=JITFunction(kernel.fn), signature=signature, constexprs=constexprs,
                                    attrs=aligned),
                          target=GPUTarget(backend, arch, warp))


def attention_case(target: str, dtype: str, kv: str, head_dim: int, block_size: int,
                   qpkv: int = 8) -> tuple[dict, Callable[[], dict]]:
    cc = TARGETS[target][3]
    shared = SHARED_MEMORY_BYTES[cc]
    block_m = 64
    tile = triton_kv_tile(block_size, head_dim, BYTES[dtype], block_m, cc)
    what = {"kernel": "unified_attention", "target": target, "dtype": dtype, "kv_cache_dtype": kv,
            "head_dim": head_dim, "block_size": block_size, "kv_tile": tile}

    def run() -> dict:
        if not tile:  # refused by the estimate: the registry says so (what the smallest tile takes, for the record)
            return {"refused": True, "shared_at_smallest_tile": compile_one(16).metadata.shared, "limit": shared,
                    "ok": True}
        compiled = compile_one(tile)
        estimate = triton_attention_shared_bytes(tile, head_dim, BYTES[dtype], block_m, cc)
        return {"shared": compiled.metadata.shared, "estimate": estimate, "limit": shared,
                "ok": compiled.metadata.shared <= min(estimate, shared)}

    def compile_one(t: int):
        from appliance.kernels import triton_attention as ta

        qt = TYPE[dtype]
        return compile_kernel(ta._unified_attention_kernel, target,
                              {"q_ptr": qt, "out_ptr": qt, "k_cache_ptr": TYPE.get(kv, qt), "v_cache_ptr": TYPE.get(kv, qt),
                               "block_table_ptr": "i32", "seq_lens_ptr": "i32", "qsl_ptr": "i32",
                               "tile_req_ptr": "i32", "tile_q_ptr": "i32"},
                              dict(NUM_QPKV=qpkv, QPKV_PAD=pow2(qpkv), BLOCK_Q=block_m // pow2(qpkv), BLOCK_M=block_m,
                                   HEAD_DIM=head_dim, HEAD_DIM_PAD=pow2(head_dim), BLOCK_SIZE=block_size, TILE_N=t,
                                   FP8=kv == "fp8_e4m3", UPCAST=dtype == "float32"))
    return what, run


def cache_write_case(target: str, dtype: str, kv: str, head_dim: int = 256, kv_heads: int = 8):
    what = {"kernel": "reshape_and_cache", "target": target, "dtype": dtype, "kv_cache_dtype": kv,
            "head_dim": head_dim}

    def run() -> dict:
        from appliance.kernels import triton_attention as ta

        qt = TYPE[dtype]
        c = compile_kernel(ta._reshape_and_cache_kernel, target,
                           {"k_ptr": qt, "v_ptr": qt, "k_cache_ptr": TYPE.get(kv, qt), "v_cache_ptr": TYPE.get(kv, qt),
                            "slot_ptr": "i64"},
                           dict(NUM_KV_HEADS=kv_heads, KVH_PAD=pow2(kv_heads), HEAD_DIM=head_dim,
                                HEAD_DIM_PAD=pow2(head_dim), BLOCK_SIZE=16, FP8=kv == "fp8_e4m3"))
        return {"shared": c.metadata.shared, "ok": c.metadata.shared <= SHARED_MEMORY_BYTES[TARGETS[target][3]]}
    return what, run


def gemm_case(target: str, kernel: str, dtype: str, bits: int = 4):
    what = {"kernel": kernel, "target": target, "dtype": dtype} | ({"bits": bits} if kernel == "int_gemm" else {})

    def run() -> dict:
        from appliance.kernels import triton_int4, triton_moe, triton_mxfp4

        t = TYPE[dtype]
        if kernel == "mxfp4_gemm":
            c = compile_kernel(triton_mxfp4._mxfp4_gemm_kernel, target,
                               {"x_ptr": t, "b_ptr": "u8", "s_ptr": "u8", "out_ptr": t},
                               dict(BLOCK_M=64, BLOCK_N=64, IEEE=dtype == "float32"))
        elif kernel == "moe_gemm":
            c = compile_kernel(triton_moe._grouped_gemm_kernel, target,
                               {"a_ptr": t, "b_ptr": t, "c_ptr": t, "w_ptr": "fp32", "sorted_ptr": "i32",
                                "experts_ptr": "i32"},
                               dict(PER_PAIR=True, MUL_WEIGHT=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=triton_moe.BLOCK_K,
                                    IEEE=dtype == "float32"))
        else:
            c = compile_kernel(triton_int4._grouped_gemm_kernel, target,
                               {"x_ptr": t, "q_ptr": "i8" if bits == 8 else "u8", "d_ptr": "fp32", "m_ptr": "fp32",
                                "out_ptr": t},
                               dict(GROUP=32, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32 if bits == 4 else 16,
                                    IEEE=dtype == "float32", BITS=bits))
        return {"shared": c.metadata.shared, "ok": c.metadata.shared <= SHARED_MEMORY_BYTES[TARGETS[target][3]]}
    return what, run


def compile_cases(full: bool = False, targets: tuple[str, ...] = tuple(TARGETS)) -> Iterator[tuple[dict, Callable]]:
    """(what, run) for each case. Bounded: the largest KV blocks (where tiles are cut) at the two largest
    head sizes, and every other kernel once per dtype; ``full``: every head size and block size."""
    kinds = [("bfloat16", "auto"), ("bfloat16", "fp8_e4m3"), ("float32", "auto")]
    if full:
        kinds.insert(1, ("float16", "auto"))
    heads = (16, 32, 64, 128, 256) if full else (128, 256)
    blocks = (16, 32, 64, 128, 256) if full else (256,)
    for target in targets:
        seen = set()
        for (dtype, kv), head_dim, block_size in itertools.product(kinds, heads, blocks):
            what, run = attention_case(target, dtype, kv, head_dim, block_size)
            key = (dtype, kv, head_dim, what["kv_tile"])  # the resources depend on the tile, not the block
            if key not in seen:
                seen.add(key)
                yield what, run
        for dtype, kv in kinds:
            yield cache_write_case(target, dtype, kv)
        for dtype in ("bfloat16", "float32"):
            yield gemm_case(target, "moe_gemm", dtype)
            yield gemm_case(target, "mxfp4_gemm", dtype)
            for bits in (4, 8):
                yield gemm_case(target, "int_gemm", dtype, bits)


def main(argv: list[str]) -> int:
    """Run the cases (``--full``: all of them) and print one JSON line per case: a process of its own, as
    the Triton interpreter, once it has run in a process, leaves the language patched for it."""
    import json

    full = "--full" in argv
    targets = tuple(a for a in argv if a in TARGETS) or tuple(TARGETS)
    for what, run in compile_cases(full=full, targets=targets):
        try:
            result = run()
        except Exception as e:  # a compile error (ptxas out of registers, say) fails the case
            result = {"error": f"{type(e).__name__}: {str(e)[-2000:]}", "ok": False}
        print(json.dumps({**what, **result}), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
