"""The MXFP4 GEMMs gpt-oss's kept 4-bit experts multiply with, against the
reference dequantization: the native CPU kernel (cpu_native's library) and
the Triton one under the interpreter (TRITON_INTERPRET=1, set before the
kernel module is imported), every code and a range of scales."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from appliance.kernels.registry import triton_interpreter_on  # noqa: E402
from appliance.models.mxfp4 import WIDEN_ROWS, dequantize_mxfp4, mxfp4_linear  # noqa: E402

assert triton_interpreter_on()
SHAPES = [(1, 5, 32), (7, 48, 64), (9, 130, 96), (33, 64, 128)]  # m, n, k: rows past 8 and 32, n past 64


def operands(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=g)  # every code, both nibbles
    scales = torch.randint(112, 140, (n, k // 32), dtype=torch.uint8, generator=g)
    scales[0, 0] = 0  # e8m0's smallest: 2^-127
    return torch.randn(m, k, generator=g), blocks, scales, torch.randn(n, generator=g)


def check(got, x, w, b):
    terms = x.abs() @ w.abs().T + (b.abs() if b is not None else 0)
    want = F.linear(x, w, b)
    assert got.shape == want.shape and ((got - want).abs() <= 1e-5 * terms + 1e-30).all()


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_the_native_gemm_is_the_dequantized_one(m, n, k):
    cpu_mxfp4 = pytest.importorskip("appliance.kernels.cpu_mxfp4", reason="the cpu_native library does not load")
    x, blocks, scales, b = operands(m, n, k, m * n)
    w = dequantize_mxfp4(blocks, scales)
    check(cpu_mxfp4.mxfp4_linear(x, blocks, scales, b), x, w, b)
    check(cpu_mxfp4.mxfp4_linear(x, blocks, scales), x, w, None)
    strided = torch.randn(m, k + 32)[:, 16:16 + k]  # rows of a wider tensor
    strided.copy_(x)
    check(cpu_mxfp4.mxfp4_linear(strided, blocks, scales, b), x, w, b)
    with pytest.raises(ValueError, match="uint8 blocks"):
        cpu_mxfp4.mxfp4_linear(x, blocks.to(torch.int8), scales)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_the_triton_gemm_is_the_dequantized_one(m, n, k):
    from appliance.kernels.triton_mxfp4 import mxfp4_gemm

    x, blocks, scales, b = operands(m, n, k, m + n)
    w = dequantize_mxfp4(blocks, scales)
    check(mxfp4_gemm(x, blocks, scales, b), x, w, b)
    with pytest.raises(ValueError, match="uint8 blocks"):
        mxfp4_gemm(x, blocks, scales[:, :-1])


def test_the_weights_widen_to_bf16_exactly():
    cpu_mxfp4 = pytest.importorskip("appliance.kernels.cpu_mxfp4", reason="the cpu_native library does not load")
    _, blocks, scales, _ = operands(1, 70, 96, 9)
    scales[1, :] = torch.tensor([0, 1, 254], dtype=torch.uint8)  # e8m0's ends (255 is NaN)
    assert torch.equal(cpu_mxfp4.mxfp4_to_bf16(blocks, scales).float(), dequantize_mxfp4(blocks, scales))


@pytest.mark.parametrize("m", [4, WIDEN_ROWS + 1])
def test_the_experts_gemm_keeps_the_activations_dtype(m):
    """bf16 rows: fp32 sums of the native kernel, or past WIDEN_ROWS (with bf16 dot products) torch's bf16 GEMM
    over the exactly widened weight, what a dequantized bf16 model computes."""
    x, blocks, scales, _ = operands(m, 16, 64, 5)
    w, xb = dequantize_mxfp4(blocks, scales), x.bfloat16()
    out = mxfp4_linear(xb, blocks, scales)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(xb.float(), w), rtol=1e-2, atol=1e-2)


def test_many_bf16_rows_take_the_widened_weight_where_bf16_dot_products_are(monkeypatch):
    import appliance.models.mxfp4 as mx

    calls = []

    def gemm(x, blocks, scales):
        calls.append("gemm")
        return F.linear(x, dequantize_mxfp4(blocks, scales))

    def widen(blocks, scales):
        calls.append("widen")
        return dequantize_mxfp4(blocks, scales).bfloat16()

    x, blocks, scales, _ = operands(WIDEN_ROWS + 1, 16, 64, 5)
    for fast, want in [(True, ["widen", "gemm", "gemm"]), (False, ["gemm"] * 3)]:
        monkeypatch.setattr(mx, "_native", lambda fast=fast: (gemm, widen, fast))
        calls.clear()
        for rows in (x.bfloat16(), x[:WIDEN_ROWS].bfloat16(), x):
            mx.mxfp4_linear(rows, blocks, scales)
        assert calls == want
