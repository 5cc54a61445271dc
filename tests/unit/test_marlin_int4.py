"""The Marlin int4 GEMM's host side (the kernel itself runs only on NVIDIA
GPUs, in scripts/gpu_check.sh): which blocks it takes (AWQ and GPTQ
checkpoints' integer zero points, not GGUF-style float mins), its weight
words equal GPTQ's own packing, the scales and zero points land where
Marlin's layout puts them, and a linear laid out for it computes its
dequantized GEMM when the kernel is stood in for by the layout's inverse
(a transposed or misplaced scale, zero point or word would not)."""

import pytest
import torch

from appliance.kernels import marlin_int4
from appliance.kernels.marlin_int4 import (SCALE_PERM, SCALE_PERM_SINGLE, ZERO_INTERLEAVE, gptq_words,
                                           integer_zeros, pack_zero_points, permute_scales, prepare)
from appliance.models.int4_checkpoints import pack_awq, pack_gptq, quantize_zero_point, unpack_awq, unpack_gptq
from appliance.models.quant import Int4WeightOnlyLinear, quantize_groups_int4


def _checkpoint_blocks(n=128, k=256, group=64, seed=0, symmetric=False):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, z, s = quantize_zero_point(w, group)
    if symmetric:
        z = torch.full_like(z, 8)
    return q, z, s


def test_the_words_are_gptqs_packing():
    q, z, s = _checkpoint_blocks()
    assert torch.equal(gptq_words(q), pack_gptq(q, z, s)["qweight"])


def test_checkpoint_zero_points_are_read_back_exactly_and_float_mins_are_not_taken():
    q, z, s = _checkpoint_blocks()
    for blocks in (unpack_awq(**pack_awq(q, z, s)), unpack_gptq(*pack_gptq(q, z, s).values())):
        assert torch.equal(integer_zeros(blocks[1], blocks[2]), z)
    _, d, m = quantize_groups_int4(torch.randn(64, 128), 32)  # mins anywhere (int4_wo, GGUF's Q4_1 / Q4_K)
    assert integer_zeros(d, m) is None
    assert integer_zeros(torch.ones(1, 2), torch.tensor([[-3.0, -16.0]])) is None  # past 4 bits


def test_the_perms_are_marlins():
    assert sorted(SCALE_PERM) == list(range(64)) and sorted(SCALE_PERM_SINGLE) == list(range(32))
    assert SCALE_PERM[:9] == [0, 8, 16, 24, 32, 40, 48, 56, 1]
    assert SCALE_PERM_SINGLE[:9] == [0, 1, 8, 9, 16, 17, 24, 25, 2]
    s = torch.arange(2 * 128, dtype=torch.float32).reshape(2, 128)
    assert permute_scales(s, 256, 128)[1, 64 + 1].item() == s[1, 64 + 8].item()  # chunk 2 of row 1, slot 1
    assert permute_scales(s, 128, 128)[0, 3].item() == s[0, 9].item()  # one group over k: the single perm


def _unpack_zero_points(packed, n):
    """The inverse of pack_zero_points (the layout as Marlin reads it back)."""
    fields = torch.stack([(packed >> (4 * i)) & 15 for i in range(8)], dim=-1).reshape(packed.shape[0], n)
    inter = torch.empty_like(fields.reshape(-1, 8))
    inter[:, ZERO_INTERLEAVE] = fields.reshape(-1, 8)
    chunks = torch.empty_like(inter.reshape(-1, 64))
    chunks[:, SCALE_PERM] = inter.reshape(-1, 64)
    return chunks.reshape(-1, n)


def test_zero_points_are_permuted_interleaved_and_packed():
    z = torch.zeros(1, 64, dtype=torch.uint8)
    z[0, 8] = 5  # column 8 goes to slot 1 of the chunk (SCALE_PERM), which the interleave puts in field 4
    packed = pack_zero_points(z)
    assert packed.shape == (1, 8) and packed[0, 0].item() == 5 << 16 and int(packed[0, 1:].abs().sum()) == 0
    many = torch.randint(0, 16, (4, 192), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(_unpack_zero_points(pack_zero_points(many), 192), many.to(torch.int32))


def test_marlin_takes_only_shapes_it_tiles():
    q, z, s = _checkpoint_blocks(n=128, k=256, group=64)
    d, m = s.float().T, -(s.float() * z.float()).T
    assert prepare(q, d.T.contiguous(), m.T.contiguous(), torch.float16) is not None
    for n, k, group in ((96, 256, 64), (128, 192, 64), (128, 256, 256)):
        q2, z2, s2 = _checkpoint_blocks(n=n, k=k, group=group)
        d2, m2 = s2.float(), -(s2.float() * z2.float())
        assert prepare(q2, d2, m2, torch.float16) is None, (n, k, group)
    sym_q, sym_z, sym_s = _checkpoint_blocks(symmetric=True)
    words, scales, zeros = prepare(sym_q, sym_s.float(), -(sym_s.float() * sym_z.float()), torch.bfloat16)
    assert zeros is None and scales.dtype == torch.bfloat16  # GPTQ's symmetric weights: uint4b8, no zero points


def _dequantize_marlin(words, scales, zeros, n, k):
    """What the Marlin GEMM multiplies by, read back from the host layouts."""
    q = ((words.to(torch.int64)[:, None, :] >> (4 * torch.arange(8)).view(1, 8, 1)) & 15).reshape(k, n).T
    group = k // scales.shape[0]
    perm = SCALE_PERM if group < k else SCALE_PERM_SINGLE
    s = torch.empty_like(scales.reshape(-1, len(perm)))
    s[:, perm] = scales.reshape(-1, len(perm))
    s = s.reshape(-1, n).T.float().repeat_interleave(group, dim=1)
    z = 8 if zeros is None else _unpack_zero_points(zeros, n).T.float().repeat_interleave(group, dim=1)
    return (q.float() - z) * s


@pytest.mark.parametrize("symmetric,act_order", [(False, False), (True, False), (False, True)])
def test_a_linear_laid_out_for_marlin_computes_its_gemm(monkeypatch, symmetric, act_order):
    n, k, group = 128, 256, 64
    q, z, s = _checkpoint_blocks(n, k, group, symmetric=symmetric)
    g_idx = torch.randperm(k, generator=torch.Generator().manual_seed(3)) // group if act_order else None
    blocks = unpack_gptq(*pack_gptq(q, z, s, g_idx=g_idx).values())
    lin = Int4WeightOnlyLinear(None, torch.randn(n), blocks=blocks[:3],
                               in_perm=blocks[3] if act_order else None)
    x = torch.randn(5, k)
    want = lin(x)  # the dequantized torch path
    monkeypatch.setattr(marlin_int4, "usable", lambda device, dtype: True)
    lin.prepare_for(torch.device("cpu"), torch.float32)
    assert lin.marlin_words is not None and lin.weight_q4.numel() == 0 and (lin.marlin_zeros is None) == symmetric
    monkeypatch.setattr(marlin_int4, "repack", lambda words, n, k: words)
    monkeypatch.setattr(marlin_int4, "gemm", lambda rows, tiles, scales, zeros, n, bias: rows @ _dequantize_marlin(
        tiles, scales, zeros, n, rows.shape[1]).T + bias)
    assert torch.allclose(lin._marlin(x), want, atol=1e-4)


def test_float_mins_and_cpus_keep_the_triton_layout():
    lin = Int4WeightOnlyLinear(torch.randn(128, 256), None, group=32)  # our quantizer: float mins
    lin.prepare_for(torch.device("cpu"), torch.float16)
    assert lin.marlin_words is None and lin.weight_rows is not None
