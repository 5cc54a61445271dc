"""A Triton fused mixture-of-experts: grouped GEMMs over the (token,
expert) pairs sorted by expert, for the GPU profiles' sparse layers
(``models.layers.moe.FusedExperts`` calls it on CUDA/ROCm tensors).

``align_by_expert`` sorts the pairs a rank holds (flat index ``p = token x
top_k + slot``) by expert, each expert's run padded to a multiple of
``BLOCK_M`` with the sentinel ``P`` (no pair); every block of ``BLOCK_M``
sorted pairs belongs to one expert (``block_experts``). A program of
``_grouped_gemm_kernel`` takes one such block and ``BLOCK_N`` output
columns: it gathers the block's input rows (the token's hidden row, or the
pair's own row for the second GEMM), multiplies them by that expert's
weight [N, K] and stores each row at its pair's place, scaled by the
pair's routing weight where asked. ``fused_experts`` runs gate|up, SiLU x
up, then down with the weights, and sums each token's pairs. Pairs routed
to experts another rank holds stay zero. Under TRITON_INTERPRET=1 the
kernel runs on CPU tensors (how the tests run it); fp32 inputs take IEEE
products (no TF32), and so do bf16/fp16 ones there, widened first (the
interpreter's half-precision ``tl.dot`` returns garbage; the widened
products are exact, so only the summation order differs from a GPU's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from appliance.kernels.registry import triton_interpreter_on

BLOCK_K = 32


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, experts_ptr, N, K, P, TOP_K, stride_am, stride_be,
                         stride_bn, stride_cm, PER_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(experts_ptr + pid_m)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pairs < P
    if PER_PAIR:  # the second GEMM reads the pair's own row
        rows = pairs
    else:  # the first reads the token's hidden row
        rows = pairs // TOP_K
    rows = tl.where(real, rows, 0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + rk)[None, :], mask=real[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(b_ptr + expert * stride_be + rn[:, None] * stride_bn + (k0 + rk)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b))
    if MUL_WEIGHT:
        w = tl.load(w_ptr + tl.where(real, pairs, 0), mask=real, other=0.0)
        acc = acc * w[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=real[:, None] & n_ok[None, :])


def align_by_expert(ids: torch.Tensor, first: int, count: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair indices padded with P = ids.numel(), one expert per
    ``block_m`` of them: local expert index per block) for the pairs routed
    to experts ``first .. first + count - 1``."""
    flat = ids.reshape(-1)
    p = flat.numel()
    local = flat - first
    mine = torch.nonzero((local >= 0) & (local < count)).squeeze(1)
    order = mine[torch.argsort(local[mine], stable=True)]
    counts = torch.bincount(local[order], minlength=count)
    padded = (counts + block_m - 1) // block_m * block_m
    blocks = int(padded.sum()) // block_m
    sorted_ids = torch.full((max(blocks, 1) * block_m,), p, dtype=torch.int64, device=ids.device)
    starts = torch.cumsum(padded, 0) - padded  # each expert's first padded slot
    run_starts = torch.cumsum(counts, 0) - counts
    within = torch.arange(order.numel(), device=ids.device) - torch.repeat_interleave(run_starts, counts)
    sorted_ids[torch.repeat_interleave(starts, counts) + within] = order
    block_experts = torch.repeat_interleave(torch.arange(count, device=ids.device), padded // block_m)
    return sorted_ids, block_experts[:blocks]


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, sorted_ids: torch.Tensor,
                 block_experts: torch.Tensor, top_k: int, per_pair: bool, weights: torch.Tensor | None,
                 block_m: int) -> None:
    """c[p] = a[row of p] @ b[expert of p].T (x weights[p]) for every sorted pair p; c [P, N]."""
    n, k = b.shape[1], b.shape[2]
    blocks = block_experts.numel()
    if not blocks:
        return
    grid = (blocks, triton.cdiv(n, 64))
    w = weights if weights is not None else c  # unread without MUL_WEIGHT
    _grouped_gemm_kernel[grid](a, b, c, w, sorted_ids, block_experts, n, k, c.shape[0], top_k, a.stride(0),
                               b.stride(0), b.stride(1), c.stride(0), PER_PAIR=per_pair,
                               MUL_WEIGHT=weights is not None, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=BLOCK_K,
                               IEEE=a.dtype == torch.float32 or triton_interpreter_on())


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  first: int = 0) -> torch.Tensor:
    """Sum over each token's routed experts ``first .. first + len(w13) - 1``
    of weight x down(silu(gate x) * up x); x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    weights fp32 and ids [T, top_k]."""
    t, top_k = ids.shape
    inter = w2.shape[2]
    if t == 0:  # a rank no row was routed to (small batches under expert parallelism)
        return x.new_zeros(0, w2.shape[1])
    block_m = 16 if t * top_k <= 256 else 64
    sorted_ids, block_experts = align_by_expert(ids, first, w13.shape[0], block_m)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    gu = torch.zeros(t * top_k, 2 * inter, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, gu, sorted_ids, block_experts, top_k, False, None, block_m)
    gate, up = gu.split(inter, dim=-1)
    act = (F.silu(gate) * up).contiguous()
    down = torch.zeros(t * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    grouped_gemm(act, w2, down, sorted_ids, block_experts, top_k, True,
                 weights.reshape(-1).float().contiguous(), block_m)
    return down.view(t, top_k, -1).sum(dim=1)
