"""The native CPU kernels (appliance/kernels/csrc/cpu_ops.c) against torch references:
GEMMs over every tile remainder (fp32, bf16, int8 and int4 weights, and the
AVX-512F and AVX512-BF16 paths where the CPU has them), paged attention on ragged mixed
batches, whole-model generation token for token against the torch_sdpa path
(bf16 models against fp32 runs of the same bf16-rounded weights), and a
clear refusal when the library cannot be built."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from appliance import LLM, SamplingParams
from appliance.kernels.cpu_native import (CpuNativeBackend, NativeLinear, amx, amx_min_rows, avx512, bf16_attention, bf16_dot, decode_tiles, fma_rows,
                                          int8_quads, int8_rows, pack_int8_quads, pack_q4_panels, pack_q4_quads,
                                          pack_vnni_panels, vnni)
from appliance.kernels.registry import Selection
from appliance.models.quant import (GroupedInt8Linear, Int4WeightOnlyLinear, Int8WeightOnlyLinear, dequantize_int4,
                                    int8_matmul, quantize_int8_weight_only, quantize_rows_int8)
from tests.kernel_helpers import make_problem, reference
from tests.model_helpers import NATIVE_VARIANTS, PROMPTS, TINY_VARIANTS


HAS_BF16_DOT = bf16_dot()  # the default: on where the CPU has AVX512-BF16
needs_bf16_dot = pytest.mark.skipif(not HAS_BF16_DOT, reason="this CPU lacks AVX512-BF16 (vdpbf16ps): "
                                                              "bf16 GEMMs widen the weights to fp32 here")


HAS_AVX512 = avx512()
needs_avx512 = pytest.mark.skipif(not HAS_AVX512, reason="this CPU lacks AVX512F/BW: int4 GEMMs of one to six rows "
                                                          "run the AVX2 GEMV or widen to fp32 here, prefill "
                                                          "attention tiles the AVX2 kernel")


HAS_VNNI = vnni()
needs_vnni = pytest.mark.skipif(not HAS_VNNI, reason="this CPU lacks AVX512-VNNI: W8A8 int8 GEMMs sum on AVX2 "
                                                      "(vpmaddwd) here")
needs_int8_rows = pytest.mark.skipif(not int8_rows(), reason="this CPU lacks AVX512-VNNI: 4- and 8-bit weights' "
                                                            "GEMMs keep float rows here (vdpbf16ps or fp32 FMAs)")


HAS_AMX = amx()  # on where the CPU has AMX-BF16 and AMX-INT8 and the OS grants the tile state
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU (or its OS) has no AMX tiles: GEMMs of 16 rows or "
                                                    "more run on vdpbf16ps or vpdpbusd here, where the CPU has them")


@contextlib.contextmanager
def _pinned(switch, enabled):
    """Pin a run-time kernel choice (bf16_dot, fma_rows, bf16_attention, avx512, vnni or amx) for a block."""
    before = switch()
    switch(enabled)
    try:
        yield
    finally:
        switch(before)


def _bf16_dot(enabled):
    """Pin the batched bf16 GEMM path (vdpbf16ps or widen) for a block, the rows of 4- and 8-bit weights'
    GEMMs kept in floating point (int8_rows off), bf16 weights off AVX-512 FMAs (fma_rows off)."""
    stack = contextlib.ExitStack()
    stack.enter_context(_pinned(bf16_dot, enabled))
    stack.enter_context(_pinned(fma_rows, False))
    stack.enter_context(_pinned(int8_rows, False))
    return stack


def _avx2_only():
    """The kernels an AVX2-only CPU runs: no vdpbf16ps, no AVX-512 int4 rows, no vpdpbusd (W8A8 or int8
    rows), no AMX."""
    stack = contextlib.ExitStack()
    stack.enter_context(_pinned(bf16_dot, False))
    stack.enter_context(_pinned(fma_rows, False))
    stack.enter_context(_pinned(avx512, False))
    stack.enter_context(_pinned(int8_rows, False))  # before vnni: with vnni off it reads off, and would stay so
    stack.enter_context(_pinned(vnni, False))
    stack.enter_context(_pinned(amx, False))
    return stack


def _module(kind, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    if kind == "int8":
        m = Int8WeightOnlyLinear(w, b)
        return m, m.weight_int8.float() * m.scale[:, None], b
    lin = torch.nn.Linear(k, n, bias=bias)
    lin.weight.data, lin.bias = w, (torch.nn.Parameter(b) if bias else None)
    if kind == "bf16":  # the reference computes in fp32 with exactly the bf16 values
        lin = lin.to(torch.bfloat16)
        return lin, lin.weight.float(), None if b is None else lin.bias.float()
    return lin, w, b


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 13, 100])
@pytest.mark.parametrize("n,k", [(7, 13), (12, 16), (50, 40), (33, 200), (9, 1000)])
def test_linear_matches_torch_over_every_remainder(kind, m, n, k):
    mod, w_ref, b = _module(kind, n, k, bias=(n % 2 == 1), seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = F.linear(x, w_ref, b)
    with _bf16_dot(False):
        got = NativeLinear(mod)(x)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        # accumulate=True adds into the output (the fused residual add)
        base = torch.randn(m, n)
        out = base.clone()
        NativeLinear(mod)(x, out=out, accumulate=True)
        torch.testing.assert_close(out, base + ref, rtol=1e-4, atol=1e-4)
        if kind == "bf16":  # widening is exact: the same sums, in the same order, as fp32 weights of those values
            f32 = torch.nn.Linear(k, n, bias=b is not None)
            f32.weight.data, f32.bias = w_ref, (None if b is None else torch.nn.Parameter(b))
            assert torch.equal(got, NativeLinear(f32)(x))


def _w8a8(n, k, m, bias, seed):
    g = torch.Generator().manual_seed(seed)
    mod = Int8WeightOnlyLinear(torch.randn(n, k, generator=g), torch.randn(n, generator=g) if bias else None,
                               activations=True)
    x = torch.randn(m, k, generator=g) * 4
    if m > 2:
        x[1] = 0  # a zero row: scale 0, output the bias
    return mod, x


def _assert_w8a8_exact(mod, x):
    """The native W8A8 linear equals the torch reference bit for bit, plain
    and accumulating into an output."""
    ref = mod(x)
    assert torch.equal(NativeLinear(mod)(x), ref)
    base = torch.randn(x.shape[0], mod.out_features)
    out = base.clone()
    NativeLinear(mod)(x, out=out, accumulate=True)
    assert torch.equal(out, base + ref)


W8A8_SHAPES = [(7, 13), (12, 16), (50, 40), (33, 200), (9, 1000), (20, 1), (100, 576), (70, 7)]


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("n,k", W8A8_SHAPES)
def test_w8a8_linear_on_avx2_matches_the_reference_bit_for_bit(m, n, k):
    """Integer sums are exact, so the AVX2 (vpmaddwd) path equals the torch
    reference (torch._int_mm) exactly: every row tile and panel remainder,
    k not a multiple of 4, a zero row, bias, accumulate."""
    mod, x = _w8a8(n, k, m, bias=n % 2 == 1, seed=m * 1000 + n + k)
    with _pinned(vnni, False), _pinned(amx, False):
        _assert_w8a8_exact(mod, x)


@needs_vnni
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("n,k", W8A8_SHAPES)
def test_w8a8_linear_on_vnni_matches_the_reference_bit_for_bit(m, n, k):
    """vpdpbusd (unsigned rows offset by 128, the weight sums subtracted):
    the same bits as the reference; six-row tiles by four panels and their
    remainders."""
    mod, x = _w8a8(n, k, m, bias=n % 2 == 1, seed=m * 1000 + n + k)
    with _pinned(vnni, True), _pinned(amx, False):
        _assert_w8a8_exact(mod, x)


@needs_amx
@pytest.mark.parametrize("m", [16, 17, 31, 32, 33, 40, 100])
@pytest.mark.parametrize("n,k", [*W8A8_SHAPES, (40, 64), (17, 128), (48, 130)])
def test_w8a8_linear_on_amx_matches_the_reference_bit_for_bit(m, n, k):
    """tdpbssd over 32-row by two-panel blocks: the same bits as the
    reference; one or two row tiles, one or two panels, k padded to the
    tiles' 64 (a last block of fewer quads read from a zero-padded copy),
    rows padded to 16."""
    mod, x = _w8a8(n, k, m, bias=n % 2 == 1, seed=m * 1000 + n + k)
    with _pinned(amx, True):
        _assert_w8a8_exact(mod, x)


@pytest.mark.parametrize("m", [0, 1, 3, 17])
@pytest.mark.parametrize("n,k", [(1, 1), (20, 1), (7, 2), (64, 13), (9, 576)])
def test_int8_matmul_sums_exactly_on_every_cpu(m, n, k):
    """The reference's int32 sums equal an int64 product, k == 1 included
    (torch._int_mm returns wrong sums there on VNNI/AMX CPUs)."""
    g = torch.Generator().manual_seed(m * 100 + n + k)
    q = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    got = int8_matmul(q, w)
    assert got.dtype == torch.int32 and torch.equal(got, (q.long() @ w.long().t()).int())


def test_w8a8_rows_quantize_per_token_round_half_even():
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -63.5], [0.0, 0.0, 0.0, 0.0, 0.0], [-2.0, 1.0, 0.0, 0.0, 0.0]])
    q, s = quantize_rows_int8(x)
    assert q.tolist() == [[127, 0, 0, 2, -64], [0, 0, 0, 0, 0], [-127, 64, 0, 0, 0]]  # 63.5 -> 64, 0.5 -> 0
    assert s.tolist() == [1.0, 0.0, pytest.approx(2 / 127)]
    mod, rows = _w8a8(9, 40, 6, bias=True, seed=3)
    alone = torch.cat([mod(rows[i:i + 1]) for i in range(6)])
    assert torch.equal(mod(rows), alone)  # a row's result does not depend on the batch
    assert torch.equal(NativeLinear(mod)(rows), alone)
    # close to the float product of the int8 weights: one int8 step per row, relative
    w = mod.weight_int8.float() * mod.scale[:, None]
    torch.testing.assert_close(mod(rows), F.linear(rows, w, mod.bias), rtol=0.05, atol=0.1 * rows.abs().max().item())


@needs_bf16_dot
@pytest.mark.parametrize("tiles", [False, pytest.param(True, marks=needs_amx)], ids=["vdpbf16ps", "amx"])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("m", [7, 8, 12, 13, 16, 23, 24, 25, 33, 100])
@pytest.mark.parametrize("n,k", [(7, 13), (12, 16), (50, 40), (33, 200), (9, 1000), (20, 1), (40, 96)])
def test_bf16_dot_gemm_matches_the_widen_path_on_rounded_rows(tiles, kind, m, n, k):
    """vdpbf16ps (or from amx_min_rows() rows AMX's tdpbf16ps) rounds the rows to bf16
    and sums exact products in fp32 (bf16 weights, or int8 ones converted
    exactly, their scale applied to the sums): the widen path's result on
    the rounded rows, up to summation order. Row tiles of 12 and their
    remainders, odd k (paired with zeros); on AMX one or two row tiles of
    16 by one or two panels, k padded to 32; accumulate."""
    mod, w_ref, b = _module(kind, n, k, bias=(n % 2 == 1), seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    xr = x.to(torch.bfloat16).float()
    base = torch.randn(m, n)
    with _bf16_dot(True), _pinned(amx, tiles):
        got = NativeLinear(mod)(x)
        acc = base.clone()
        NativeLinear(mod)(x, out=acc, accumulate=True)
    with _bf16_dot(False):
        widen, unrounded = NativeLinear(mod)(xr), NativeLinear(mod)(x)
    # Summation order moves a result by a small fraction of the magnitude of the terms summed.
    terms = xr.abs() @ w_ref.abs().T + (0 if b is None else b.abs())
    for a, want in ((got, widen), (got, F.linear(xr, w_ref, b)), (acc, base + widen)):
        assert ((a - want).abs() <= 1e-5 * (terms + base.abs())).all()
    assert not torch.allclose(got, unrounded, rtol=1e-5, atol=1e-5)  # the path under test did run


@needs_avx512
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 12, 13, 23, 25, 100])
@pytest.mark.parametrize("n,k", [(7, 13), (12, 16), (50, 40), (33, 200), (9, 1000), (20, 1), (200, 96), (48, 600)])
def test_gemm_in_avx512_fmas_matches_torch_on_fp32_rows(kind, m, n, k):
    """With fma_rows on, bf16 and int8 (per channel, float rows) weights are widened in registers and the
    rows stay fp32: torch's product of the same values up to summation order, the rows not rounded
    (vdpbf16ps's would be), every tile shape (one row by eight panels, up to three by four, six by two,
    twelve by one, the remainders; panels left over at the end of a thread's share; from 96 rows, chunks of
    256 k of two panels widened once, a lone last panel paired with zeros); accumulate adds into the
    output."""
    mod, w_ref, b = _module(kind, n, k, bias=(n % 2 == 1), seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    base = torch.randn(m, n)
    with _pinned(avx512, True), _pinned(fma_rows, True), _pinned(bf16_dot, False), _pinned(int8_rows, False):
        got = NativeLinear(mod)(x)
        acc = base.clone()
        NativeLinear(mod)(x, out=acc, accumulate=True)
    terms = x.abs() @ w_ref.abs().T + (0 if b is None else b.abs())
    want = F.linear(x, w_ref, b)
    for a, ref in ((got, want), (acc, base + want)):
        assert ((a - ref).abs() <= 1e-5 * (terms + base.abs())).all()
    if HAS_BF16_DOT and k > 1:  # the rows were not rounded to bf16 on the way in
        with _bf16_dot(True), _pinned(amx, False):
            assert not torch.allclose(got, NativeLinear(mod)(x), rtol=1e-6, atol=1e-6)


@needs_avx512
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_rows_result_in_avx512_fmas_does_not_depend_on_the_rows_beside_it(kind):
    """fma_rows sums each row and channel in one chain, k in order, at every row count: a row's result is
    the same bits alone, by two, by three, in a decode batch and in a prefill chunk. (AMX tiles, where the
    CPU has them, take 13 rows and more: off here.)"""
    mod, _, _ = _module(kind, 70, 300, bias=True, seed=1)
    lin = NativeLinear(mod)
    x = torch.randn(130, 300, generator=torch.Generator().manual_seed(0))
    with _pinned(avx512, True), _pinned(fma_rows, True), _pinned(int8_rows, False), _pinned(amx, False):
        whole = lin(x)  # 96 rows and more: chunks of the panels widened once for the block's tiles
        for rows in (slice(0, 1), slice(5, 6), slice(0, 2), slice(0, 3), slice(3, 9), slice(9, 17), slice(17, 41),
                     slice(41, 60), slice(30, 130)):
            assert torch.equal(lin(x[rows]), whole[rows]), rows


def _int4(n, k, group, seed, params="fp16"):
    """An int4 linear and its dequantized weight; fp32 params are moved off
    the fp16 grid, so reading them as fp16 would show."""
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    mod = Int4WeightOnlyLinear(w, b, group)
    if params == "fp32":
        jitter = 1 + 1e-4 * torch.rand(mod.q_scale.shape, generator=g)
        mod = Int4WeightOnlyLinear(None, b, blocks=(mod.weight_q4, mod.q_scale.float() * jitter,
                                                    mod.q_min.float() * jitter))
    return mod, dequantize_int4(mod.weight_q4, mod.q_scale, mod.q_min), b


def _assert_sums_close(got, want, x, w, b, base=None):
    """Equal up to summation order: within a small fraction of the magnitude of the terms summed."""
    terms = x.abs() @ w.abs().T + b.abs() + (0 if base is None else base.abs())
    assert ((got - want).abs() <= 1e-5 * terms).all()


def test_int4_panels_hold_each_pair_of_k_in_one_byte():
    q = torch.randint(0, 16, (20, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    d, m = torch.rand(20, 2).half(), torch.randn(20, 2).half()
    packed, params = pack_q4_panels(q, d, m)
    assert packed.shape == (2, 32, 16) and params.shape == (2, 2, 2, 16) and params.dtype == torch.float16
    assert pack_q4_panels(q, d.float(), m.float())[1].dtype == torch.float32
    for c in (0, 15, 16, 19):
        for j in (0, 5, 31):
            byte = int(packed[c // 16, j, c % 16])
            assert (byte & 15, byte >> 4) == (int(q[c, 2 * j]), int(q[c, 2 * j + 1]))
        for grp in (0, 1):
            assert params[c // 16, grp, 0, c % 16] == d[c, grp] and params[c // 16, grp, 1, c % 16] == m[c, grp]
    assert not packed[1, :, 4:].any() and not params[1, :, :, 4:].any()  # channels past n weigh nothing


@pytest.mark.parametrize("params", ["fp16", "fp32"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 9, 12, 13])
@pytest.mark.parametrize("n", [7, 50, 100])  # 1, 4 and 7 panels: remainders of the four-panel groups per thread
def test_int4_linear_matches_its_dequantized_weights(params, group, m, n):
    """The AVX2 paths (the GEMV at one row, passes of one to four rows up to
    twelve, fp32 tiles on the widened panels beyond): d * q + m exactly,
    summed in fp32; accumulate adds."""
    _check_on_avx2(*_int4(n, 384, group, seed=m * 100 + n, params=params), m)


def _check_on_avx2(mod, w, b, m):
    """The AVX2 paths of a grouped linear (and accumulate) against the GEMM of its dequantized weight."""
    x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m))
    base = torch.randn(m, w.shape[0])
    with _avx2_only():
        got = NativeLinear(mod)(x)
        acc = base.clone()
        NativeLinear(mod)(x, out=acc, accumulate=True)
    _assert_sums_close(got, F.linear(x, w, b), x, w, b)
    _assert_sums_close(acc, base + F.linear(x, w, b), x, w, b, base)
    _assert_sums_close(mod(x), F.linear(x, w, b), x, w, b)  # the torch path


@needs_avx512
@pytest.mark.parametrize("params", ["fp16", "fp32"])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 9, 12, 13, 15])
@pytest.mark.parametrize("n", [7, 50, 100])
def test_int4_avx512_rows_match_the_avx2_path(params, group, m, n):
    """One to fifteen rows on AVX-512F (up to four rows over four panels a
    pass, the remainder of panels one at a time; five or six rows over two
    panels, then one; more in even passes of those): the AVX2 path's sums
    (passes of up to four rows, the widened fp32 panels beyond twelve) up to
    their order."""
    mod, w, b = _int4(n, 384, group, seed=m * 100 + n, params=params)
    x = torch.randn(m, 384, generator=torch.Generator().manual_seed(m))
    base = torch.randn(m, n)
    with _avx2_only():
        avx2 = NativeLinear(mod)(x)
    # int8 rows where VNNI is, rows on vdpbf16ps where AVX512-BF16 is: the fp32 rows here
    with _pinned(avx512, True), _pinned(int8_rows, False), _bf16_dot(False):
        got = NativeLinear(mod)(x)
        acc = base.clone()
        NativeLinear(mod)(x, out=acc, accumulate=True)
    _assert_sums_close(got, avx2, x, w, b)
    _assert_sums_close(got, F.linear(x, w, b), x, w, b)
    _assert_sums_close(acc, base + avx2, x, w, b, base)


@needs_bf16_dot
@pytest.mark.parametrize("tiles", [False, pytest.param(True, marks=needs_amx)], ids=["vdpbf16ps", "amx"])
@pytest.mark.parametrize("params", ["fp16", "fp32"])
@pytest.mark.parametrize("m", [16, 23, 40])  # AMX tiles from 32 rows
def test_int4_bf16_dot_gemm_runs_the_rounded_rows(tiles, params, m):
    """On AVX512-BF16 the rows are rounded to bf16 and multiply the weights' integers (exact in bf16), each
    group's scale and min applied to its sums: the fp32 GEMM of the rounded rows and the weights as they are,
    up to order. AMX tiles, from 32 rows, widen each panel and round it to bf16 like the rows."""
    mod, w, b = _int4(50, 384, 32, seed=m, params=params)
    x = torch.randn(m, 384, generator=torch.Generator().manual_seed(m))
    rounded = tiles and m >= amx_min_rows(grouped=True)
    xr, wr = x.to(torch.bfloat16).float(), (w.to(torch.bfloat16).float() if rounded else w)
    with _bf16_dot(True), _pinned(amx, tiles):
        got = NativeLinear(mod)(x)
    _assert_sums_close(got, F.linear(xr, wr, b), xr, wr, b)


def _q8g(n, k, group, seed):
    """A grouped-int8 linear (GGUF Q8_0/Q5_K/Q6_K kept at width) and its dequantized weight."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    d, m = torch.rand(n, k // group, generator=g) * 0.1, torch.randn(n, k // group, generator=g) * 0.1
    b = torch.randn(n, generator=g)
    return GroupedInt8Linear((q, d, m), b), dequantize_int4(q, d, m), b


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("m", [1, 2, 5, 7, 13])
@pytest.mark.parametrize("n", [7, 50, 100])
def test_grouped_int8_linear_matches_its_dequantized_weights(group, m, n):
    """The GEMV at one row (d and m per group), widened fp32 panels beyond."""
    _check_on_avx2(*_q8g(n, 256, group, seed=m * 100 + n), m)


@needs_bf16_dot
@pytest.mark.parametrize("tiles", [False, pytest.param(True, marks=needs_amx)], ids=["vdpbf16ps", "amx"])
@pytest.mark.parametrize("m", [7, 40])
def test_grouped_int8_bf16_dot_gemm_runs_the_rounded_rows(tiles, m):
    """As int4's: the weights as they are on vdpbf16ps, rounded to bf16 on AMX tiles, which take grouped
    weights from 32 rows (seven stay on vdpbf16ps with AMX on)."""
    mod, w, b = _q8g(50, 256, 16, seed=m)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    rounded = tiles and m >= amx_min_rows(grouped=True)
    xr, wr = x.to(torch.bfloat16).float(), (w.to(torch.bfloat16).float() if rounded else w)
    with _bf16_dot(True), _pinned(amx, tiles):
        got = NativeLinear(mod)(x)
    _assert_sums_close(got, F.linear(xr, wr, b), xr, wr, b)


def _float_row_modules():
    """(name, module, k) of each weight type the rows of which run on vdpbf16ps."""
    yield "bf16", _module("bf16", 50, 257, bias=True, seed=1)[0], 257  # an odd k: the last pair ends in a zero
    yield "int8", _module("int8", 50, 257, bias=False, seed=2)[0], 257
    yield "int4 fp16", _int4(50, 256, 32, seed=3, params="fp16")[0], 256
    yield "int4 fp32", _int4(50, 256, 32, seed=4, params="fp32")[0], 256
    yield "grouped int8", _q8g(50, 256, 16, seed=5)[0], 256


@needs_amx
@needs_avx512
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_amx_takes_the_rows_from_its_row_count_and_the_fmas_below(kind):
    """Where the CPU has AMX-BF16 the FMAs run below amx_min_rows() rows (the same bits as with the tiles
    off) and the tiles from there: the rows rounded to bf16, the widen path's sums up to order, and a row's
    result the same bits in any batch the tiles take (blocks of 32 rows, their remainders)."""
    n, k = 70, 300
    mod, w, b = _module(kind, n, k, bias=True, seed=2)
    lin = NativeLinear(mod)
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(1))
    first = amx_min_rows()
    with _pinned(avx512, True), _pinned(fma_rows, True), _pinned(int8_rows, False), _pinned(bf16_dot, True):
        with _pinned(amx, False):
            fmas = lin(x)
        with _pinned(amx, True):
            assert torch.equal(lin(x[:first - 1]), fmas[:first - 1])
            tiles = lin(x[:first])
            assert not torch.equal(tiles, fmas[:first])
            xr = x[:first].to(torch.bfloat16).float()
            _assert_sums_close(tiles, F.linear(xr, w, b), xr, w, b)
            whole = lin(x)
            for rows in (slice(0, first), slice(0, 32), slice(20, 53), slice(40, 100)):
                assert torch.equal(lin(x[rows]), whole[rows]), rows


@needs_amx
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4", "grouped int8", "grouped int8 by 16"])
def test_amx_blocks_chunks_and_groups_keep_a_rows_sums(kind):
    """AMX tiles block a GEMM whose rows pass 1 MiB in bf16: chunks of about 512 k, blocks of rows, groups of
    panels per thread; fewer rows keep their sums in the tiles through the whole k, 32 rows by two panels at a
    time (past 32 rows each pair's whole k kept re-laid for the next 32). A row's sums run k in order either way,
    so a row's result is the same bits in a prefill of 600 rows (two chunks, two blocks of rows, on each of two
    threads a group of 38 panels and one of three, a pair and a lone panel; a part panel at the end) as in a
    slice of 32 rows, 40, 64, 500 (sixteen passes over the kept pairs) or 530; the widen path's sums of the rounded rows up to order; accumulate adds into
    the output."""
    n, k = 1300, 1000
    if kind in ("bf16", "int8"):
        mod, w, b = _module(kind, n, k, bias=True, seed=3)
    elif kind == "int4":
        mod, w, b = _int4(n, 1024, 32, seed=3, params="fp16")
        k = 1024
    else:  # chunks of whole groups and whole 32-k tiles
        mod, w, b = _q8g(n, 1024, 16 if kind.endswith("16") else 32, seed=3)
        k = 1024
    lin = NativeLinear(mod)
    x = torch.randn(600, k, generator=torch.Generator().manual_seed(2))
    base = torch.randn(600, n, generator=torch.Generator().manual_seed(3))
    with _bf16_dot(True), _pinned(amx, True), _pinned(int8_rows, False):
        whole = lin(x)
        acc = base.clone()
        lin(x, out=acc, accumulate=True)
        for rows in (slice(0, 32), slice(500, 532), slice(17, 57), slice(100, 164), slice(0, 500), slice(0, 530)):
            assert torch.equal(lin(x[rows]), whole[rows]), rows
            part = base[rows].clone()
            lin(x[rows], out=part, accumulate=True)
            assert torch.equal(part, acc[rows]), rows
    xr = x.to(torch.bfloat16).float()
    wr = w if kind in ("bf16", "int8") else w.to(torch.bfloat16).float()
    _assert_sums_close(whole, F.linear(xr, wr, b), xr, wr, b)
    _assert_sums_close(acc, base + F.linear(xr, wr, b), xr, wr, b, base)


@needs_amx
def test_amx_outputs_of_16_mib_or_more_go_to_memory_with_the_same_bits():
    """An output of 16 MiB or more (no bias, scale or sum to add; rows a multiple of 16 floats apart) leaves the
    AMX GEMM in non-temporal stores: the same bits as the rows computed in smaller calls (an odd panel count: a
    lone panel), the widen path's sums of the rounded rows up to order."""
    mod, w, b = _module("bf16", 2096, 64, bias=False, seed=4)
    lin = NativeLinear(mod)
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(4))
    with _bf16_dot(True), _pinned(amx, True):
        whole = lin(x)
        assert whole.numel() * 4 >= 16 << 20
        for rows in (slice(0, 40), slice(1000, 1600), slice(2000, 2048)):
            assert torch.equal(lin(x[rows]), whole[rows]), rows
    xr = x.to(torch.bfloat16).float()
    _assert_sums_close(whole, F.linear(xr, w), xr, w, torch.zeros(2096))


@needs_bf16_dot
def test_a_rows_result_on_vdpbf16ps_does_not_depend_on_the_rows_beside_it():
    """Every row count runs on vdpbf16ps (up to twelve rows reading the stored panels, the weights made into
    bf16 pairs in registers, in one tile or two; up to 24 bf16 rows in tiles of at most eight against the
    stored panels; more re-laying four panels at a time for tiles of six rows): a row's result is the same bits
    alone, in a decode batch and in a prefill chunk, so the load on a server does not change a greedy answer.
    (AMX tiles, where the CPU has them, take 16 rows and more and sum in their own order: off here.)"""
    x = torch.randn(40, 257, generator=torch.Generator().manual_seed(0))
    for name, mod, k in _float_row_modules():
        lin = NativeLinear(mod)
        with _bf16_dot(True), _pinned(amx, False):
            whole = lin(x[:, :k])
            for rows in (slice(0, 1), slice(5, 6), slice(0, 3), slice(3, 15), slice(16, 28), slice(28, 40),
                         slice(10, 30)):
                assert torch.equal(lin(x[rows, :k]), whole[rows]), (name, rows)


def test_linear_reads_strided_rows():
    mod, w_ref, _ = _module("int8", 24, 64, bias=False, seed=3)
    wide = torch.randn(6, 96)
    x = wide[:, 16:80]  # row stride 96, not contiguous: the wrapper makes it so
    assert torch.equal(NativeLinear(mod)(x), NativeLinear(mod)(x.contiguous()))
    with _bf16_dot(False):
        torch.testing.assert_close(NativeLinear(mod)(x), F.linear(x, w_ref), rtol=1e-4, atol=1e-4)


# (num_computed, query_len): fresh prefill, chunk after a prefix ending mid-block,
# decodes at a block boundary and inside a block, a chunk crossing several blocks, a 1-token prompt.
MIXED = [(0, 5), (7, 3), (16, 1), (21, 1), (3, 18), (0, 1)]
# Prefill runs of 8 tokens or more go by tiles of 16 tokens and one kv head (widened K/V, online softmax):
# one whole tile, a partial one, several, chunks after a cached prefix that ends mid-block, a long
# context, beside decodes and a run just under the threshold.
PREFILL = [(0, 8), (5, 9), (0, 37), (100, 16), (33, 70), (17, 1), (0, 7), (230, 50), (0, 1)]
# Decodes of contexts split across items (splits of 256 positions), an odd length,
# a three-token chunk whose tokens see 1,000 to 1,002 positions, and a short context left whole.
LONG = [(1499, 1), (700, 1), (999, 3), (37, 1)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 1), (6, 2), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_sdpa(num_heads, num_kv_heads, head_dim, block_size):
    common, q, k, v, cache = make_problem(MIXED, block_size, num_heads, num_kv_heads, head_dim)
    ref_out, ref_cache = reference(common, q, k, v, cache, num_heads, num_kv_heads, head_dim)
    b = CpuNativeBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wide", [False, pytest.param(True, marks=needs_avx512)], ids=["avx2", "avx512"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (9, 3), (8, 2), (16, 2)])
@pytest.mark.parametrize("head_dim", [40, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_prefill_tiles_match_sdpa(wide, num_heads, num_kv_heads, head_dim, block_size):
    """Query groups of one to eight heads per kv head (tiles of 16 to 128 rows), head sizes that are not a
    multiple of 16, keys gathered across shuffled blocks of every size; the AVX2 tile and, where the CPU
    has it, the AVX-512F one (eight score rows a pass, 64 lanes of P V, a masked 8-lane tail)."""
    common, q, k, v, cache = make_problem(PREFILL, block_size, num_heads, num_kv_heads, head_dim, seed=block_size)
    ref_out, _ = reference(common, q, k, v, cache, num_heads, num_kv_heads, head_dim)
    b = CpuNativeBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    with _pinned(avx512, wide):
        out = b.forward(q, k, v, cache, b.build_metadata(common))
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (9, 3)])
@pytest.mark.parametrize("specs", [MIXED, PREFILL, LONG], ids=["mixed", "prefill", "long"])
def test_bf16_kv_cache_matches_sdpa_on_the_rounded_values(num_heads, num_kv_heads, specs):
    common, q, k, v, cache = make_problem(specs, 16, num_heads, num_kv_heads, 64, seed=7)
    bf_cache = cache.to(torch.bfloat16)
    b = CpuNativeBackend(num_heads, num_kv_heads, 64, 0.125, kv_cache_dtype="bfloat16")
    with _pinned(bf16_attention, False):  # the fp32 tiles (the vdpbf16ps ones: test_bf16_attention_...)
        out = b.forward(q, k, v, bf_cache, b.build_metadata(common))
    # The reference attends over exactly the values the bf16 cache holds (round to nearest even).
    kq, vq = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    ref_out, ref_cache = reference(common, q, kq, vq, bf_cache.float(), num_heads, num_kv_heads, 64)
    torch.testing.assert_close(bf_cache.float(), ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


WIDE = pytest.mark.parametrize("wide", [False, pytest.param(True, marks=needs_avx512)], ids=["avx2", "avx512"])
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}


@WIDE
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (9, 3), (16, 2), (14, 2)])
@pytest.mark.parametrize("head_dim", [64, 40, 128])
@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_long_decodes_split_their_context_and_merge_it(wide, num_heads, num_kv_heads, head_dim, kv):
    """Decodes over contexts longer than a split (256 positions or more each, about four items a thread):
    splits that end inside a block of 48, the last shorter, merged by their maxima; beside a short one. On
    AVX-512F, head sizes that are a multiple of 32 take the 16-lane items (a bf16 row's even and odd
    elements widened apart, the query laid to match), others the AVX2 ones."""
    common, q, k, v, cache = make_problem(LONG, 48, num_heads, num_kv_heads, head_dim, seed=5)
    dtype = KV_DTYPES[kv]
    stored = cache.to(dtype)
    b = CpuNativeBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5,
                         kv_cache_dtype="auto" if kv == "float32" else kv)
    with _pinned(avx512, wide), _pinned(bf16_attention, False):  # fp32 items (AMX ones: test_decode_items_on_amx_...)
        out = b.forward(q, k, v, stored, b.build_metadata(common))
    kq, vq = k.to(dtype).float(), v.to(dtype).float()
    ref_out, _ = reference(common, q, kq, vq, stored.float(), num_heads, num_kv_heads, head_dim)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


def _nan_outside_contexts(cache, common):
    """cache ([2, blocks, bs, kv heads, d]) with NaN in every slot no request's context holds (the rest of its
    last block, the free blocks): a kernel that reads past a context shows it in the output."""
    bs = cache.shape[2]
    held = torch.zeros(cache.shape[1] * bs, dtype=torch.bool)
    for r, n in enumerate(common.seq_lens.tolist()):
        pos = torch.arange(n)
        held[common.block_table[r, pos // bs].long() * bs + pos % bs] = True
    flat = cache.view(2, -1, *cache.shape[3:])
    flat[:, ~held] = float("nan")
    return cache


@needs_amx
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (16, 2), (14, 2), (32, 2), (9, 3), (34, 2)])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("block_size", [4, 16, 48])
def test_decode_items_on_amx_tiles_stay_within_the_rounding_of_q_and_p(num_heads, num_kv_heads, head_dim,
                                                                       block_size):
    """Over a bf16 cache with bf16_attention on, decode items of 4 to 16 query heads a kv head run on AMX tiles:
    K's rows read in place where one block holds 16 of them (blocks of 16 and 48) or copied (blocks of 4), V
    interleaved in pairs of positions, contexts split and merged, a last chunk shorter than a tile, a three-token
    chunk; every slot past the contexts NaN (never read into the output). Against attention over the bf16-rounded
    queries, the output moves by no more than rounding each softmax weight to bf16 can move it: 2^-9 of the
    largest |v|. Three heads a kv head, and seventeen, keep the AVX-512 items: the same bits as with
    bf16_attention off (and fp8 caches keep them: widening each row to bf16 for the tiles ran 0.74-0.80x at 1B
    shapes)."""
    common, q, k, v, cache = make_problem(LONG, block_size, num_heads, num_kv_heads, head_dim, seed=block_size)
    stored = _nan_outside_contexts(cache.to(torch.bfloat16), common)
    b = CpuNativeBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, kv_cache_dtype="bfloat16")
    md = b.build_metadata(common)
    outs = {}
    for on in (False, True):
        with _pinned(bf16_attention, on), _pinned(amx, True):
            outs[on] = b.forward(q, k, v, stored.clone(), md)
    with _pinned(bf16_attention, True), _pinned(amx, True):
        assert decode_tiles(num_heads, num_kv_heads, head_dim, torch.bfloat16) == (4 <= num_heads // num_kv_heads <= 16)
    if not 4 <= num_heads // num_kv_heads <= 16:
        assert torch.equal(outs[True], outs[False])
        return
    kq, vq = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    ref_out, _ = reference(common, q.to(torch.bfloat16).float(), kq, vq, cache.to(torch.bfloat16).float(), num_heads,
                           num_kv_heads, head_dim)  # the reference masks scores, not values: no NaN there
    v_max = max(vq.abs().max(), cache[1].abs().max())
    assert (outs[True] - ref_out).abs().max() <= 2.0 ** -9 * v_max + 1e-5
    assert not torch.equal(outs[True], outs[False])  # the tiles ran
    with _pinned(bf16_attention, True), _pinned(amx, False):  # AMX off: the AVX-512 items
        assert torch.equal(b.forward(q, k, v, stored.clone(), md), outs[False])


@WIDE
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_a_decodes_attention_does_not_depend_on_the_decodes_beside_it(wide, kv):
    """A context splits into items of 256 positions whatever else the step holds: each token's output is the
    same bits alone as in the batch (splits sized by the step's work summed in another order)."""
    import dataclasses

    specs = [(1499, 1), (700, 1), (2100, 1), (37, 1)]
    common, q, k, v, cache = make_problem(specs, 16, 8, 2, 64, seed=7)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[kv]
    b = CpuNativeBackend(8, 2, 64, 64 ** -0.5, kv_cache_dtype="auto" if kv == "float32" else kv)
    with _pinned(avx512, wide):
        whole = b.forward(q, k, v, cache.to(dtype), b.build_metadata(common))
        for r, (c, n) in enumerate(specs):
            alone = dataclasses.replace(
                common, query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=common.seq_lens[r:r + 1],
                num_computed_tokens=common.num_computed_tokens[r:r + 1], block_table=common.block_table[r:r + 1],
                slot_mapping=common.slot_mapping[r:r + 1], num_reqs=1, num_actual_tokens=1, max_query_len=1,
                max_seq_len=c + n, query_start_loc_cpu=[0, 1], seq_lens_cpu=[c + n])
            out = b.forward(q[r:r + 1], k[r:r + 1], v[r:r + 1], cache.to(dtype), b.build_metadata(alone))
            assert torch.equal(out, whole[r:r + 1]), r


def test_bf16_kv_cache_whole_model_matches_torch_path():
    overrides = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05", "cache.kv_cache_dtype=bfloat16"]
    p = SamplingParams(max_tokens=16, temperature=0, logprobs=3)
    ref_llm = LLM(overrides=overrides, selection=Selection(chosen="torch_sdpa"))
    assert ref_llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    ref = ref_llm.generate(PROMPTS, p, use_tqdm=False)
    nat_llm = LLM(overrides=overrides)
    assert nat_llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    with _pinned(bf16_attention, False):  # fp32 prefill tiles over the bf16 values (vdpbf16ps ones round q, P)
        nat = nat_llm.generate(PROMPTS, p, use_tqdm=False)
    fp32 = LLM(overrides=overrides[:-1]).generate(PROMPTS, p, use_tqdm=False)
    same_as_fp32 = 0
    for a, b, c in zip(ref, nat, fp32):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        same_as_fp32 += b.outputs[0].token_ids == c.outputs[0].token_ids
        # the paths sum K and V in other orders before rounding them to bf16: a value that lands on the
        # other side of a rounding boundary moves by one bf16 step (2^-8 relative), seen up to 2.2e-4 here
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lb.logprob == pytest.approx(la.logprob, abs=1e-3)
    assert same_as_fp32 >= len(PROMPTS) - 2  # bf16 K/V rounding may flip a near tie


FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("kind", list(FP8))
def test_native_fp8_kv_write_rounds_like_torch(kind):
    """The whole-step forward's K/V write (C) and the layer path's (torch)
    store the same byte for every value: round to nearest even, subnormals,
    saturation at the largest finite value, signed zeros."""
    import ctypes

    from appliance.kernels.base import to_fp8
    from appliance.kernels.cpu_native import _LIB, KV_TYPES

    big = torch.finfo(FP8[kind]).max
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=g) * torch.logspace(-12, 6, 4096, base=2.0),
                   torch.tensor([0.0, -0.0, big, -big, big * 1.03, big * 1.1, 1e30, float("inf"), float("-inf")]),
                   torch.finfo(FP8[kind]).tiny * torch.arange(-24, 25) / 8])  # subnormals and their ties
    kc, vc = torch.zeros(x.numel(), dtype=torch.uint8), torch.zeros(x.numel(), dtype=torch.uint8)
    for k_scale, v_scale in [(1.0, 1.0), (0.37, 5.5)]:  # a checkpoint's scales: the cache holds x / scale
        _LIB.appl_kv_write(ctypes.c_void_p(kc.data_ptr()), ctypes.c_void_p(vc.data_ptr()),
                           ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(0),
                           ctypes.c_int64(x.numel()), ctypes.c_int(KV_TYPES[FP8[kind]]), ctypes.c_float(k_scale),
                           ctypes.c_float(v_scale))
        assert torch.equal(kc, to_fp8(x / k_scale, FP8[kind]).view(torch.uint8))
        assert torch.equal(vc, to_fp8(x / v_scale, FP8[kind]).view(torch.uint8))


@pytest.mark.parametrize("kind", list(FP8))
@pytest.mark.parametrize("head_dim", [8, 32])
def test_every_fp8_value_reads_back_exactly(kind, head_dim):
    """Each of the 256 bytes an fp8 cache may hold (subnormals, signed zeros, the largest values, NaN)
    read as torch reads it: decodes that see one position each give that position's V row; a head size of
    32 takes the AVX-512 items where the CPU has them (e4m3 looked up as bf16 words there)."""
    from appliance.kernels.cpu_native import paged_attention

    n = 256 // head_dim
    common, q, _, _, cache = make_problem([(0, 1)] * n, 16, 1, 1, head_dim)
    cache = cache.to(FP8[kind])
    codes = torch.arange(256, dtype=torch.uint8).view(n, head_dim)
    slots = common.block_table[:, 0].long() * 16  # each request's one position
    cache.view(torch.uint8)[1].view(-1, head_dim)[slots] = codes
    cache.view(torch.uint8)[0].view(-1, head_dim)[slots] = 0  # K: zero scores, a softmax of one position
    b = CpuNativeBackend(1, 1, head_dim, head_dim ** -0.5, kv_cache_dtype=kind)
    out = torch.empty(n, head_dim)
    paged_attention(q.reshape(n, head_dim), out, cache, b.build_metadata(common), 1, 1, head_dim, head_dim ** -0.5)
    torch.testing.assert_close(out, codes.view(FP8[kind]).float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kind", list(FP8))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (9, 3)])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 3.0)])
@pytest.mark.parametrize("specs", [MIXED, PREFILL], ids=["mixed", "prefill"])
def test_fp8_kv_cache_matches_sdpa_on_the_rounded_values(kind, num_heads, num_kv_heads, k_scale, v_scale, specs):
    """The cache holds k / k_scale and v / v_scale; attention reads them
    scaled back (the scale folded into the scores and the output)."""
    from appliance.kernels.base import to_fp8

    common, q, k, v, cache = make_problem(specs, 16, num_heads, num_kv_heads, 64, seed=7)
    fp8_cache = cache.to(FP8[kind])
    b = CpuNativeBackend(num_heads, num_kv_heads, 64, 0.125, kv_cache_dtype=kind, k_scale=k_scale, v_scale=v_scale)
    scales = torch.tensor([k_scale, v_scale]).view(2, 1, 1, 1, 1)
    before = fp8_cache.float() * scales  # what the cache means
    with _pinned(bf16_attention, False):  # the fp32 tiles (the vdpbf16ps ones: test_bf16_attention_...)
        out = b.forward(q, k, v, fp8_cache, b.build_metadata(common))
    kq, vq = (to_fp8(x / s, FP8[kind]).float() * s for x, s in ((k, k_scale), (v, v_scale)))
    ref_out, ref_cache = reference(common, q, kq, vq, before, num_heads, num_kv_heads, 64)
    torch.testing.assert_close(fp8_cache.float() * scales, ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5 * v_scale)


def _tile_rounded_q(q, specs):
    """q as the prefill tiles on vdpbf16ps read it: the tokens of runs of 8 or more (ATT_MIN_QUERY) rounded to bf16."""
    out, t = q.clone(), 0
    for _, n in specs:
        if n >= 8:
            out[t:t + n] = q[t:t + n].to(torch.bfloat16).float()
        t += n
    return out


@needs_bf16_dot
@pytest.mark.parametrize("tiles", [False, pytest.param(True, marks=needs_amx)], ids=["vdpbf16ps", "amx"])
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (9, 3), (16, 2)])
@pytest.mark.parametrize("head_dim", [40, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
def test_bf16_attention_tiles_stay_within_the_rounding_of_q_and_p(tiles, kv, num_heads, num_kv_heads, head_dim,
                                                                    block_size):
    """Over a bf16 or fp8 cache (bf16 values exactly) the prefill tiles run on vdpbf16ps or, where amx is on and
    the head size a multiple of 32, AMX tiles (query rows padded to 16): keys in chunks of 32 (runs that end
    inside a chunk, odd counts, chunks across shuffled blocks), query groups of 4 to 8 heads, head sizes with an
    8-lane tail. Against the reference on the bf16-rounded queries, the output moves by no more than rounding
    each softmax weight to bf16 can move it: 2^-9 of the largest |v|."""
    from appliance.kernels.base import to_fp8

    dtype = {"bfloat16": torch.bfloat16, **FP8}[kv]
    k_scale, v_scale = (1.0, 1.0) if kv == "bfloat16" else (0.05, 3.0)
    common, q, k, v, cache = make_problem(PREFILL, block_size, num_heads, num_kv_heads, head_dim, seed=block_size)
    scales = torch.tensor([k_scale, v_scale]).view(2, 1, 1, 1, 1)
    stored = (cache / scales).to(dtype) if kv != "bfloat16" else cache.to(dtype)
    before = stored.float() * scales
    b = CpuNativeBackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, kv_cache_dtype=kv, k_scale=k_scale,
                         v_scale=v_scale)
    md = b.build_metadata(common)
    outs = {}
    for dot in (False, True):
        with _pinned(bf16_attention, dot), _pinned(amx, tiles):
            outs[dot] = b.forward(q, k, v, stored.clone(), md)
    if kv == "bfloat16":
        kq, vq = k.to(dtype).float(), v.to(dtype).float()
    else:
        kq, vq = (to_fp8(x / s, dtype).float() * s for x, s in ((k, k_scale), (v, v_scale)))
    ref_out, _ = reference(common, _tile_rounded_q(q, PREFILL), kq, vq, before, num_heads, num_kv_heads, head_dim)
    v_max = max(vq.abs().max(), before[1].abs().max())
    assert (outs[True] - ref_out).abs().max() <= 2.0 ** -9 * v_max + 1e-5
    assert not torch.equal(outs[True], outs[False])  # the bf16 tiles ran
    if tiles and head_dim % 32 == 0:  # the AMX tiles, summing in their own order
        with _pinned(bf16_attention, True), _pinned(amx, False):
            assert not torch.equal(outs[True], b.forward(q, k, v, stored.clone(), md))


@pytest.mark.parametrize("kind", list(FP8))
def test_fp8_kv_cache_whole_model_matches_torch_path(kind):
    """The native whole-step forward (C write, table or fp16 reads) against
    torch_sdpa over the same fp8 cache: the same tokens (fp32 prefill tiles;
    the vdpbf16ps ones round q and the softmax weights to bf16)."""
    overrides = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05", f"cache.kv_cache_dtype={kind}"]
    p = SamplingParams(max_tokens=16, temperature=0, logprobs=3)
    ref_llm = LLM(overrides=overrides, selection=Selection(chosen="torch_sdpa"))
    assert ref_llm.engine.runner.kv_caches[0].dtype == FP8[kind]
    ref = ref_llm.generate(PROMPTS, p, use_tqdm=False)
    nat_llm = LLM(overrides=overrides)
    assert nat_llm.engine.runner.kv_caches[0].dtype == FP8[kind]
    with _pinned(bf16_attention, False):
        nat = nat_llm.generate(PROMPTS, p, use_tqdm=False)
    for a, b in zip(ref, nat):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lb.logprob == pytest.approx(la.logprob, abs=1e-4)


def test_long_context_softmax_is_stable():
    # 300 positions of large logits: the max-subtracted exp must not overflow.
    common, q, k, v, cache = make_problem([(290, 10), (0, 1)], 16, 4, 2, 64, seed=5)
    q = q * 30
    ref_out, _ = reference(common, q, k, v, cache, 4, 2, 64)
    b = CpuNativeBackend(4, 2, 64, 64 ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


# phi4_mini computes a sequence again once it grows past its original context: rows it decoded one at a time
# come back as one prefill, which the torch path's fp32 GEMMs round apart from those decodes (the native forward's
# rows do not depend on the batch), and an int8 row turns such a last-bit difference into a whole step. Its
# quantized runs against the torch path are left out; its fp32 ones here and against HF (test_generation) stay.
QUANTIZED = (["quantization=int8_wo"], ["quantization=int4_wo"])


@pytest.mark.parametrize("variant,extra", [
    (v, e) for e in ([], *QUANTIZED, ["scheduler.max_num_batched_tokens=16", "cache.block_size=4"])
    for v in NATIVE_VARIANTS if not (v == "phi4_mini" and e in QUANTIZED)])
def test_whole_step_forward_matches_torch_path(variant, extra):
    """fp32 activations throughout (an int4 prefill would otherwise round to
    bf16 on AVX512-BF16 CPUs, see the test below that); int4 decodes on
    AVX-512F where the CPU has it."""
    overrides = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05"] + TINY_VARIANTS[variant] + extra
    p = SamplingParams(max_tokens=16, temperature=0, logprobs=3)
    ref = LLM(overrides=overrides, selection=Selection(chosen="torch_sdpa")).generate(PROMPTS, p, use_tqdm=False)
    nat_llm = LLM(overrides=overrides)
    assert nat_llm.engine.runner.backend.name == "cpu_native"
    with _bf16_dot(False):
        nat = nat_llm.generate(PROMPTS, p, use_tqdm=False)
    for a, b in zip(ref, nat):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lb.logprob == pytest.approx(la.logprob, abs=1e-4)
            assert [t for t, _ in lb.top] == [t for t, _ in la.top]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", NATIVE_VARIANTS)
def test_w8a8_forward_stays_close_to_torch_path(variant, dtype):
    """quantization=w8a8_int8: the native projections equal the torch
    reference bit for bit (see test_w8a8_linear_*), but the attention's fp32
    summation order differs, and a row value that moves by an ulp can round
    to the next int8 step: close, not equal."""
    overrides = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05", f"model.dtype={dtype}",
                 "quantization=w8a8_int8"] + TINY_VARIANTS[variant]
    p = SamplingParams(max_tokens=16, temperature=0, logprobs=3)
    ref = LLM(overrides=overrides, selection=Selection(chosen="torch_sdpa")).generate(PROMPTS, p, use_tqdm=False)
    nat_llm = LLM(overrides=overrides)
    assert nat_llm.engine.runner.backend.name == "cpu_native"
    assert nat_llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.act_int8
    nat = nat_llm.generate(PROMPTS, p, use_tqdm=False)
    _assert_greedy_close(ref, nat)
    for a, b in zip(ref, nat):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            if la.token_id != lb.token_id:
                break
            # bf16: the torch path keeps bf16 activations between layers, the native one fp32
            assert lb.logprob == pytest.approx(la.logprob, abs=0.05 if dtype == "float32" else 0.2)


def _bf16_rounded_fp32(overrides, int8, selection=None):
    """An fp32 deployment of the weights a bf16 load holds: every parameter
    rounded to bf16, then (int8) quantized from those values as a bf16 load
    quantizes them. Overrides carry quantization=none."""
    llm = LLM(overrides=overrides + ["model.dtype=float32"], selection=selection)
    model = llm.engine.runner.model
    for prm in model.parameters():
        prm.data = prm.data.to(torch.bfloat16).float()
    if int8:
        quantize_int8_weight_only(model)
    return llm


def _assert_greedy_close(ref, got):
    """Greedy tokens equal, or where the two part, each side's token among the
    other's top candidates (after that the contexts differ)."""
    for a, b in zip(ref, got):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            if la.token_id != lb.token_id:
                assert la.token_id in dict(lb.top) and lb.token_id in dict(la.top)
                break


TINY_BF16 = ["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.05", "cache.kv_cache_dtype=bfloat16"]


@pytest.mark.parametrize("variant,int8", [(v, q) for q in (False, True) for v in NATIVE_VARIANTS
                                          if not (q and v == "phi4_mini")])  # see QUANTIZED
def test_bf16_model_matches_fp32_on_the_rounded_weights(variant, int8):
    """model.dtype=bfloat16 on cpu_native: bf16 weights (or int8 ones quantized
    from them, with bf16 embedding, norms and biases) and fp32 activations.
    With the widen path, bit for bit the fp32 native path on the bf16-rounded
    weights, and token for token the torch fp32 path on them."""
    overrides = TINY_BF16 + TINY_VARIANTS[variant]
    p = SamplingParams(max_tokens=16, temperature=0, logprobs=3)
    nat_llm = LLM(overrides=overrides + ["model.dtype=bfloat16"] + (["quantization=int8_wo"] if int8 else []))
    assert nat_llm.engine.runner.backend.name == "cpu_native"
    assert nat_llm.engine.runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    # int8 GEMMs take vdpbf16ps too where the CPU has it, whatever the model's dtype; the prefill
    # attention tiles take it over the bf16 cache on AMD
    with _bf16_dot(False), _pinned(bf16_attention, False):
        nat = nat_llm.generate(PROMPTS, p, use_tqdm=False)
        fp32 = _bf16_rounded_fp32(overrides, int8).generate(PROMPTS, p, use_tqdm=False)
    ref = _bf16_rounded_fp32(overrides, int8, Selection(chosen="torch_sdpa")).generate(PROMPTS, p, use_tqdm=False)
    for a, b, c in zip(ref, nat, fp32):
        assert b.outputs[0].token_ids == c.outputs[0].token_ids == a.outputs[0].token_ids
        for la, lb, lc in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, c.outputs[0].logprobs):
            assert lb.top == lc.top
            # looser than fp32 KV: a summation-order difference can tip a K/V value to the next bf16
            assert lb.logprob == pytest.approx(la.logprob, abs=1e-3)


@needs_bf16_dot
@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_bf16_dot_model_stays_close_to_fp32_on_the_rounded_weights(variant):
    """With vdpbf16ps the batched GEMMs (prefill, and decode of the nine
    prompts) see bf16-rounded rows: close to the torch fp32 path, not equal."""
    overrides = TINY_BF16 + TINY_VARIANTS[variant]
    p = SamplingParams(max_tokens=16, temperature=0, logprobs=5)
    with _bf16_dot(True):
        nat = LLM(overrides=overrides + ["model.dtype=bfloat16"]).generate(PROMPTS, p, use_tqdm=False)
    ref = _bf16_rounded_fp32(overrides, False, Selection(chosen="torch_sdpa")).generate(PROMPTS, p, use_tqdm=False)
    _assert_greedy_close(ref, nat)


SMOLLM2_BF16 = ["+profile=cpu", "quantization=none", "cache.kv_cache_memory_gib=0.05", "model.max_model_len=512",
                "cache.kv_cache_dtype=bfloat16"]


@pytest.fixture(scope="module")
def smollm2_bf16():
    """The real model in bf16 (30 layers, tied LM head packed from the bf16
    embedding) on cpu_native, and the torch fp32 path's greedy outputs on its
    bf16-rounded weights. Eight prompts: decode steps are batched GEMMs too."""
    p = SamplingParams(max_tokens=8, temperature=0, logprobs=5)
    prompts = PROMPTS[:8]
    ref = _bf16_rounded_fp32(SMOLLM2_BF16, False, Selection(chosen="torch_sdpa")).generate(prompts, p, use_tqdm=False)
    return LLM(overrides=SMOLLM2_BF16 + ["model.dtype=bfloat16"]), prompts, p, ref


def test_bf16_smollm2_matches_fp32_on_the_rounded_weights(smollm2_bf16):
    """Widen path: bit for bit the fp32 native path on the rounded weights, and
    close to the torch fp32 path on them."""
    llm, prompts, p, ref = smollm2_bf16
    llm.engine.scheduler.kv.reset_prefix_cache()
    with _bf16_dot(False):
        nat = llm.generate(prompts, p, use_tqdm=False)
        fp32 = _bf16_rounded_fp32(SMOLLM2_BF16, False).generate(prompts, p, use_tqdm=False)
    for b, c in zip(nat, fp32):
        assert b.outputs[0].token_ids == c.outputs[0].token_ids
        assert [lb.top for lb in b.outputs[0].logprobs] == [lc.top for lc in c.outputs[0].logprobs]
    _assert_greedy_close(ref, nat)


@needs_bf16_dot
def test_bf16_dot_smollm2_stays_close_to_fp32_on_the_rounded_weights(smollm2_bf16):
    llm, prompts, p, ref = smollm2_bf16
    llm.engine.scheduler.kv.reset_prefix_cache()
    with _bf16_dot(True):
        nat = llm.generate(prompts, p, use_tqdm=False)
    _assert_greedy_close(ref, nat)
    llm.engine.scheduler.kv.reset_prefix_cache()
    with _bf16_dot(True), _pinned(bf16_attention, True):  # the prefill tiles on vdpbf16ps too (q and P in bf16)
        _assert_greedy_close(ref, llm.generate(prompts, p, use_tqdm=False))
    assert "Paris" in llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                               SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0].outputs[0].text


def _int8_rows_reference(x, q, d, mn, b, group):
    """What the integer-dot path computes, in fp64: the rows quantized per group (s = amax / 127,
    q = x / s rounded half to even), each group's exact integer sums times d * s, plus the min times
    the row's exact group sum; and the magnitude of those terms. d = None: int8 per channel (the
    channel's scale in mn), groups of `group` inputs, whose weights the kernel sums offset by 128, taking
    the offset's products away once a row: their magnitude counts too."""
    m, k = x.shape
    n, gc = q.shape[0], k // group
    xg = x.view(m, gc, group)
    amax = xg.abs().amax(-1, keepdim=True)
    qx = torch.round(xg * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))).double()
    s = (amax / 127.0).double().squeeze(-1)
    isum = torch.einsum("rgk,ngk->rng", qx, q.double().view(n, gc, group))
    if d is None:
        products, mins = torch.einsum("rng,rg->rng", isum, s) * mn.double()[None, :, None], torch.zeros(1)
    else:
        products = torch.einsum("rng,ng,rg->rng", isum, d.double(), s)
        mins = torch.einsum("ng,rg->rng", mn.double(), xg.double().sum(-1))
    bias = torch.zeros(n, dtype=torch.float64) if b is None else b.double()
    offset = 0.0 if d is not None else 128 * (qx.sum(-1).abs() * s).sum(-1)[:, None] * mn.double().abs()[None, :]
    return (products + mins).sum(-1) + bias, (products.abs() + mins.abs()).sum(-1) + bias.abs() + offset, s


def _int8_rows_case(kind, n, k, seed):
    """A 4- or 8-bit linear, its integer weights, group scales and mins (None for int8 per channel, whose
    per-channel scales stand in mn), the rows' group, and its dequantized weight and bias."""
    if kind == "int8":
        mod, w, b = _module("int8", n, k, bias=True, seed=seed)
        return mod, mod.weight_int8, None, mod.scale, next(g for g in (128, 64, 32, 16, 8, 4) if k % g == 0), w, b
    group = {"int4 g32": 32, "int4 g128": 128, "q8 g16": 16, "q8 g32": 32}[kind]
    mod, w, b = (_int4 if kind.startswith("int4") else _q8g)(n, k, group, seed=seed)
    q = mod.weight_q4 if kind.startswith("int4") else mod.weight_q8
    return mod, q, mod.q_scale, mod.q_min, group, w, b


@needs_int8_rows
@pytest.mark.parametrize("kind,k", [("int4 g32", 384), ("int4 g128", 384), ("q8 g16", 256), ("q8 g32", 256),
                                    ("int8", 256), ("int8", 200), ("int8", 96)])  # int8 per channel: rows in groups of 128, 8 and 32
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("n", [7, 50, 100])
def test_int8_rows_sum_each_group_exactly(kind, k, m, n):
    """4- and 8-bit weights run on vpdpbusd: every row quantized per group, each group's integer sums
    exact; the result is the fp64 reference of that arithmetic up to fp32 rounding (one and two panels;
    up to six rows read from the stored panels, more from re-laid ones in row tiles of six and their
    remainders, int8 per channel from its stored k quads at every count; accumulate), and it stays within the rows' rounding (half a step of each group's scale)
    of the fp32 GEMM of the dequantized weights."""
    mod, q, d, mn, group, w, b = _int8_rows_case(kind, n, k, seed=m * 100 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[0, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -126.5])  # ties round to even (scale 1)
    base = torch.randn(m, n)
    with _pinned(int8_rows, True), _pinned(amx, False):
        got = NativeLinear(mod)(x)
        acc = base.clone()
        NativeLinear(mod)(x, out=acc, accumulate=True)
    with _bf16_dot(False):
        floating = NativeLinear(mod)(x)
    want, terms, s = _int8_rows_reference(x, q, d, mn, b, group)
    assert ((got.double() - want).abs() <= 1e-6 * terms).all()
    assert ((acc.double() - base.double() - want).abs() <= 1e-6 * (terms + base.abs().double())).all()
    rounding = torch.einsum("rg,ng->rn", s / 2, w.abs().double().view(n, k // group, group).sum(-1))
    assert ((got.double() - F.linear(x, w, b).double()).abs() <= rounding + 1e-5 * terms).all()
    assert not torch.allclose(got, floating, rtol=1e-5, atol=1e-5)  # the path under test did run


@needs_int8_rows
def test_int8_rows_results_do_not_depend_on_the_batch():
    """Each row's scales are its own: a row's outputs are the same bits whatever rows share its call (one row
    alone read from the stored panels, or forty from re-laid ones) and wherever it sits in the tiles."""
    mod, *_ = _int8_rows_case("int4 g32", 40, 384, seed=1)
    x = torch.randn(40, 384, generator=torch.Generator().manual_seed(2))
    with _pinned(int8_rows, True), _pinned(amx, False):
        whole, moved = NativeLinear(mod)(x), NativeLinear(mod)(x.flip(0))
        parts = [NativeLinear(mod)(x[:m]) for m in (1, 5, 7)]
    assert torch.equal(whole, moved.flip(0))
    assert all(torch.equal(whole[:len(p)], p) for p in parts)


# cpu_ops.c: int8 per channel, int4 and grouped int8 as stored panels, and as the int8 rows' k quads
WTYPE_I8, WTYPE_Q4, WTYPE_Q8G, WTYPE_I8Q, WTYPE_Q8GQ, WTYPE_Q4Q = 1, 3, 4, 6, 7, 8
QUAD_TYPES = {"int8": (WTYPE_I8Q, WTYPE_I8), "q8": (WTYPE_Q8GQ, WTYPE_Q8G), "int4": (WTYPE_Q4Q, WTYPE_Q4)}


def test_int8_quads_are_the_vnni_panels_offset_to_unsigned_bytes():
    q = torch.randint(-127, 128, (20, 12), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    quads = pack_int8_quads(q)
    assert quads.dtype == torch.uint8 and quads.shape == (2, 3, 16, 4)
    assert torch.equal(quads.view(torch.int8) ^ -128, pack_vnni_panels(q)[0])
    assert torch.equal(quads[1, 2, 3].to(torch.int32) - 128, q[19, 8:12].to(torch.int32))  # channel 19, k 8..11
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_int8_quads(q[:, :10])


def test_int4_quads_hold_two_quads_a_byte():
    q = torch.randint(0, 16, (20, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    quads = pack_q4_quads(q)
    assert quads.shape == (2, 2, 16, 4)
    assert torch.equal(quads[1, 1, 3] & 15, q[19, 8:12]) and torch.equal(quads[1, 1, 3] >> 4, q[19, 12:16])
    assert torch.equal(quads[0, 0, 5] & 15, q[5, 0:4]) and not quads[1, :, 4:].any()  # channels past n: zero
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_q4_quads(q[:, :12])


@needs_int8_rows
@pytest.mark.parametrize("kind,k", [("int8", 256), ("int8", 200), ("q8 g32", 256), ("q8 g16", 208),
                                    ("int4 g32", 256), ("int4 g128", 384)])
@pytest.mark.parametrize("m", [1, 5, 7, 13, 40])
@pytest.mark.parametrize("n", [7, 50])
def test_weights_packed_as_quads_for_the_int8_rows_give_the_stored_panels_sums(kind, k, m, n):
    """With the int8 rows on, 4- and 8-bit weights (int8 per channel, grouped int8, int4) are packed as
    vpdpbusd's k quads (no panel re-laid per call): the same bits as the stored panels on the int8 rows, and,
    with the rows switched back to floating point after packing, as the stored panels there too (the quads
    re-laid for the call)."""
    mod = _int8_rows_case(kind, n, k, seed=m * 10 + n)[0]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    base = torch.randn(m, n)
    with _pinned(amx, False):
        with _pinned(int8_rows, True):
            assert int8_quads()
            quads = NativeLinear(mod)
        with _pinned(int8_rows, False):
            assert not int8_quads()
            stored = NativeLinear(mod)
        assert (quads.struct.wtype, stored.struct.wtype) == QUAD_TYPES[kind.split()[0]]
        for rows in (True, False):
            with _pinned(int8_rows, rows):
                assert torch.equal(quads(x), stored(x))
                acc_q, acc_s = base.clone(), base.clone()
                quads(x, out=acc_q, accumulate=True)
                stored(x, out=acc_s, accumulate=True)
                assert torch.equal(acc_q, acc_s)


@needs_int8_rows
def test_int8_weights_that_keep_float_rows_or_odd_inputs_are_packed_as_stored_panels():
    """q/k/v and the LM head keep float rows (``float_rows``), and in_features not a multiple of 4 have no
    quads: both stay in the stored panels; a module released as quads is read as quads again."""
    with _pinned(amx, False), _pinned(int8_rows, True):
        mod, *_ = _module("int8", 20, 64, bias=False, seed=3)
        assert NativeLinear(mod, float_rows=True).struct.wtype == WTYPE_I8
        assert NativeLinear(_module("int8", 20, 66, bias=False, seed=3)[0]).struct.wtype == WTYPE_I8
        x = torch.randn(3, 64)
        want = NativeLinear(mod)(x)
        assert NativeLinear(mod, release=True).struct.wtype == WTYPE_I8Q and mod.weight_int8.numel() == 0
        again = NativeLinear(mod)
        assert again.struct.wtype == WTYPE_I8Q and torch.equal(again(x), want)


@pytest.mark.parametrize("switch,variable", [pytest.param("bf16_dot", "APPLIANCE_CPU_BF16_DOT", marks=needs_bf16_dot),
                                             pytest.param("fma_rows", "APPLIANCE_CPU_FMA_ROWS", marks=needs_avx512),
                                             pytest.param("bf16_attention", "APPLIANCE_CPU_BF16_ATTENTION",
                                                          marks=needs_bf16_dot),
                                             pytest.param("vnni", "APPLIANCE_CPU_VNNI", marks=needs_vnni),
                                             pytest.param("int8_rows", "APPLIANCE_CPU_INT8_ROWS",
                                                          marks=needs_int8_rows),
                                             pytest.param("amx", "APPLIANCE_CPU_AMX", marks=needs_amx)])
def test_environment_switches_a_cpu_feature_path_off(switch, variable):
    code = f"import appliance.kernels.cpu_native as m; print(m.{switch}())"
    for value, want in (("0", "False"), ("1", "True")):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, variable: value})
        assert r.returncode == 0 and r.stdout.strip() == want, r.stderr


def test_prebuilt_library_needs_no_compiler(tmp_path):
    import shutil

    from appliance.kernels.cpu_build import build_library, library_name

    shutil.copy(build_library(), tmp_path / library_name())
    code = "import appliance.kernels.cpu_native as m; print(m._LIB._name)"
    env = {"PATH": "/nonexistent", "CC": "/nonexistent/gcc", "APPLIANCE_KERNEL_DIR": str(tmp_path),
           "APPLIANCE_CACHE_DIR": str(tmp_path / "empty"), "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / library_name())


def test_refuses_clearly_when_the_compiler_is_missing(tmp_path):
    code = (
        "import appliance.kernels.registry as reg\n"
        "mod, err = reg.probe_provider('cpu_native')\n"
        "assert mod is None\n"
        "print(err)\n"
    )
    env = {"PATH": "/nonexistent", "CC": "/nonexistent/gcc", "APPLIANCE_CACHE_DIR": str(tmp_path),
           "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "building cpu_native kernels with /nonexistent/gcc failed" in r.stdout or "C compiler" in r.stdout


def test_out_of_vocabulary_ids_raise_instead_of_reading_past_the_table():
    llm = LLM(overrides=["+profile=cpu", "model=tiny_random", "cache.kv_cache_memory_gib=0.01"])
    vocab = llm.resolved.cfg.model.vocab_size
    with pytest.raises(ValueError, match="token id.* outside the vocabulary"):
        llm.generate([[1, 2, vocab]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_the_plan_says_which_kernels_run_on_this_cpu():
    """`appliance plan` reads the native kernels' run-time switches as they stand on this host."""
    from appliance.config.compose import resolve
    from appliance.runner import compose

    def note(*overrides):
        notes = compose(resolve(["+profile=cpu", *overrides]), here=False).execution.selection.notes
        return next(n for n in notes if n.startswith("on this CPU: "))

    with _pinned(bf16_attention, False):
        assert "prefill attention tiles in fp32 FMAs" in note()
    with _pinned(avx512, False):
        assert "decode attention in fp32 FMAs (AVX2)" in note()
    if HAS_AVX512:  # SmolLM2's head size 64 takes the 16-lane items
        assert "decode attention in fp32 FMAs (AVX-512F)" in note()
    with _bf16_dot(False):
        assert "GEMMs in fp32 FMAs over weights widened to fp32;" in note("quantization=none")
    if HAS_BF16_DOT:
        with _pinned(bf16_attention, True), _pinned(amx, False):
            assert "prefill attention tiles on vdpbf16ps" in note()
        with _bf16_dot(True):
            assert "GEMMs on vdpbf16ps" in note("quantization=none")
    if HAS_AVX512:
        with _pinned(fma_rows, True):
            assert "GEMMs in AVX-512 fp32 FMAs, the bf16 weights widened" in note("quantization=none")
    if HAS_AMX and HAS_AVX512:
        with _pinned(fma_rows, True), _pinned(bf16_dot, True), _pinned(amx, True):
            tiles = f"from {amx_min_rows()} rows on AMX tiles (tdpbf16ps, the rows rounded to bf16)"
            assert tiles in note("quantization=none")
            assert f"from {amx_min_rows(grouped=True)} rows on AMX tiles" in note("quantization=int4_wo")
            with _pinned(bf16_attention, True):
                assert "prefill attention tiles on AMX tiles" in note()  # SmolLM2: head size 64
                assert "decode attention in fp32 FMAs (AVX-512F)" in note()  # three query heads a kv head
                assert "decode attention on AMX tiles" in note("model.num_kv_heads=1")  # nine
        with _pinned(amx, False):
            assert "AMX" not in note("quantization=none")
    if HAS_VNNI:  # int8 rows where the CPU has VNNI
        with _pinned(int8_rows, True):
            assert "GEMMs on integer dot products" in note("quantization=int4_wo")
            if HAS_AVX512:  # int8 per channel keeps its float rows in FMAs; int4's take vdpbf16ps or fp32
                with _pinned(fma_rows, True):
                    assert "keep float rows, in AVX-512 fp32 FMAs" in note("quantization=int8_wo")
                    assert "in AVX-512 fp32 FMAs" not in note("quantization=int4_wo")
    with _bf16_dot(False):  # int8_rows off
        assert "integer dot products" not in note("quantization=int4_wo")
    assert "W8A8 GEMMs" in note("quantization=w8a8_int8", "quantization.activations=true")
    fp32 = note("model.dtype=float32", "quantization=none", "cache.kv_cache_dtype=auto")
    assert fp32.startswith("on this CPU: GEMMs in fp32 FMAs;") and "attention tiles in fp32" in fp32
