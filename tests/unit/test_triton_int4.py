"""The Triton int4 GEMM (the GPU profiles' AWQ, GPTQ and kept-4-bit GGUF
projections) against the dequantized GEMM, under the Triton interpreter on
CPU (TRITON_INTERPRET=1, set before the kernel module is imported)."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from appliance.kernels.registry import triton_interpreter_on  # noqa: E402
from appliance.kernels.triton_int4 import int4_gemm, int8_block_k, int8_gemm, pack_int4_rows  # noqa: E402
from appliance.models.int4_checkpoints import checkpoint_blocks, pack_awq, quantize_zero_point  # noqa: E402
from appliance.models.quant import dequantize_int4, quantize_groups_int4  # noqa: E402

assert triton_interpreter_on()


def test_rows_hold_two_k_per_byte():
    q = torch.arange(16, dtype=torch.uint8).repeat(3, 2)  # k = 0..31, value k % 16
    packed = pack_int4_rows(q)
    assert packed.shape == (3, 16) and packed[0, 1].item() == 2 | (3 << 4)


@pytest.mark.parametrize("m", [1, 7, 16, 33])
@pytest.mark.parametrize("n,k,group", [(48, 128, 32), (100, 256, 64), (70, 256, 128), (20, 64, 64)])
def test_gemm_is_the_dequantized_one(m, n, k, group):
    g = torch.Generator().manual_seed(m * n)
    q, d, mn = quantize_groups_int4(torch.randn(n, k, generator=g), group)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    w = dequantize_int4(q, d, mn)
    got = int4_gemm(x, pack_int4_rows(q), d, mn, b)
    terms = x.abs() @ w.abs().T + b.abs()
    assert got.shape == (m, n) and ((got - F.linear(x, w, b)).abs() <= 1e-5 * terms).all()


def test_fp32_parameters_of_a_checkpoint():
    """AWQ-style blocks (fp32 scale and -scale x zero) through the same GEMM."""
    q, z, s = quantize_zero_point(torch.randn(64, 128, generator=torch.Generator().manual_seed(3)), 64)
    bq, d, mn = checkpoint_blocks("awq", pack_awq(q, z, s))
    x = torch.randn(5, 128)
    w = dequantize_int4(bq, d, mn)
    got = int4_gemm(x, pack_int4_rows(bq), d, mn)
    assert ((got - x @ w.T).abs() <= 1e-5 * (x.abs() @ w.abs().T)).all()


def test_groups_the_kernel_cannot_step_are_refused():
    q, d, mn = quantize_groups_int4(torch.randn(8, 96), 32)
    with pytest.raises(ValueError, match="groups must be multiples of 32"):
        int4_gemm(torch.randn(2, 96), pack_int4_rows(q), d[:, :2], mn[:, :2])  # groups of 48


def test_a_linear_packs_its_rows_once_for_the_gpu():
    """What the runner does before moving int4 linears to a GPU: two k per
    byte, the unpacked weight freed."""
    from appliance.models.quant import Int4WeightOnlyLinear

    lin = Int4WeightOnlyLinear(torch.randn(16, 64), None, 32)
    q = lin.weight_q4.clone()
    lin.pack_rows()
    assert torch.equal(lin.weight_rows, pack_int4_rows(q)) and lin.weight_q4.numel() == 0
    lin.pack_rows()  # idempotent
    assert torch.equal(lin.weight_rows, pack_int4_rows(q))


def _grouped_int8(n, k, group, seed):
    """Grouped int8 blocks as GGUF's K-quants and GPTQ 8-bit give them: int8 q, fp32 d and m per group."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    d = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
    m = torch.randn(n, k // group, generator=g) * 0.01
    return q, d, m


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("n,k,group", [(48, 128, 16), (100, 256, 32), (70, 256, 128), (20, 96, 48)])
def test_int8_gemm_is_the_dequantized_one(m, n, k, group):
    """Groups of 16 (Q6_K), 32 (Q8_0, Q5_K) and GPTQ 8-bit's larger ones, and 48 (stepped by 16)."""
    q, d, mn = _grouped_int8(n, k, group, m * n)
    x, b = torch.randn(m, k, generator=torch.Generator().manual_seed(m)), torch.randn(n)
    w = dequantize_int4(q, d, mn)
    got = int8_gemm(x, q, d, mn, b)
    terms = x.abs() @ w.abs().T + b.abs()
    assert got.shape == (m, n) and ((got - F.linear(x, w, b)).abs() <= 1e-5 * terms).all()


def test_int8_groups_the_kernel_cannot_step_are_refused():
    q, d, mn = _grouped_int8(8, 96, 8, 0)
    assert int8_block_k(8) is None and int8_block_k(16) == 16 and int8_block_k(64) == 32
    with pytest.raises(ValueError, match="groups of a multiple of 16"):
        int8_gemm(torch.randn(2, 96), q, d, mn)
    with pytest.raises(ValueError, match="int8 weights"):
        int8_gemm(torch.randn(2, 96), q.to(torch.uint8), d[:, :2], mn[:, :2])


@pytest.mark.parametrize("act_order", [False, True])
def test_int8_linear_gathers_its_inputs_for_the_gemm(act_order):
    """GroupedInt8Linear's GPU path (run here under the interpreter): the
    leading dimensions kept, act-order inputs gathered, equal to its torch path."""
    from appliance.models.quant import GroupedInt8Linear

    q, d, mn = _grouped_int8(24, 64, 16, 7)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1)) if act_order else None
    lin = GroupedInt8Linear((q, d, mn), torch.randn(24), perm)
    x = torch.randn(2, 3, 64)
    got, want = lin._triton(x), lin(x)  # lin(x) on CPU tensors: the dequantized torch path
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
