"""Random paged-attention problems, faked backend packages and a captured
native step, shared by backend tests."""

import contextlib

import numpy as np
import torch

import appliance.kernels.registry as reg
from appliance.kernels.base import CommonAttentionMetadata, write_kv


@contextlib.contextmanager
def float_rows():
    """The native GEMMs' rows kept fp32 in this process for the block, as the torch layer path computes them:
    no bf16 rounding on vdpbf16ps, no int8 rows on VNNI (where the CPU has them, batched rows would otherwise
    take those paths). Processes started meanwhile read APPLIANCE_CPU_BF16_DOT / APPLIANCE_CPU_INT8_ROWS."""
    from appliance.kernels import cpu_native

    before = cpu_native.bf16_dot(), cpu_native.int8_rows()
    cpu_native.bf16_dot(False)
    cpu_native.int8_rows(False)
    try:
        yield
    finally:
        cpu_native.bf16_dot(before[0])
        cpu_native.int8_rows(before[1])


def fake_packages(monkeypatch, importable):
    """Only the backends named in ``importable`` import on this machine."""

    def probe(name, dtype="bfloat16", kv_cache_dtype="auto", model_needs=()):
        if name in importable:
            return reg.BACKENDS[name].probe_modules[0], None
        return None, f"{reg.BACKENDS[name].probe_modules[0]}: ModuleNotFoundError: No module named 'x'"

    monkeypatch.setattr(reg, "probe_provider", probe)


def make_problem(specs, block_size, num_heads, num_kv_heads, head_dim, dtype=torch.float32, seed=0, num_blocks=None):
    """specs: [(num_computed_tokens, query_len)]. Returns (common, q, k, v, kv_cache) with
    the computed prefixes already in the cache at shuffled physical blocks."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    need = [-(-(c + n) // block_size) for c, n in specs]
    num_blocks = num_blocks or sum(need) + 3
    perm = rng.permutation(np.arange(1, num_blocks))
    tables, start = [], 0
    for n in need:
        tables.append(perm[start:start + n].tolist())
        start += n
    max_blocks = max(need)
    bt = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    qsl = [0]
    slots, seq_lens = [], []
    for i, (c, n) in enumerate(specs):
        # prefix K/V already cached
        pos = np.arange(c)
        pre_slots = torch.tensor([tables[i][p // block_size] * block_size + p % block_size for p in pos], dtype=torch.long)
        if c:
            write_kv(kv_cache, torch.randn(c, num_kv_heads, head_dim, generator=g).to(dtype),
                     torch.randn(c, num_kv_heads, head_dim, generator=g).to(dtype), pre_slots)
        slots += [tables[i][p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
        seq_lens.append(c + n)
    total = qsl[-1]
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_computed_tokens=torch.tensor([c for c, _ in specs], dtype=torch.int32),
        block_table=bt,
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_size=block_size,
        num_reqs=len(specs),
        num_actual_tokens=total,
        max_query_len=max(n for _, n in specs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    q = torch.randn(total, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    return common, q, k, v, kv_cache


def reference(common, q, k, v, kv_cache, num_heads, num_kv_heads, head_dim):
    from appliance.kernels.torch_sdpa import TorchSDPABackend

    b = TorchSDPABackend(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    cache = kv_cache.clone().float()
    out = b.forward(q.float(), k.float(), v.float(), cache, b.build_metadata(common))
    return out, cache


def captured_native_step(llm, prompts, params):
    """The runner's native forward and its arguments at the last step of
    ``llm.generate(prompts, params)`` (the forward stays the runner's)."""
    runner = llm.engine.runner
    plain = runner.step_forward()
    calls = {}

    def capture(*args):
        calls["args"] = args
        return plain(*args)

    runner._native = capture
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner._native = plain
    return plain, calls["args"]


def windowed_problem(specs, window, block_size, num_heads, num_kv_heads, head_dim, seed=0, soft_cap=None, sinks=None,
                     round_to=None):
    """``make_problem`` with a sliding window: (common, q, k, v, kv_cache, expected output). The
    expected output is attention over each query's last ``window`` positions (None: all) computed
    directly, its scores soft-capped where ``soft_cap`` is set, each head's sink logit (``sinks`` [H])
    in the softmax's denominator where given; the blocks wholly before the oldest
    key any query of a request reads are then pointed at block 0, filled with large values, as a
    sliding-window group's given-back blocks may hold anything. ``round_to``: the expected output over K and V
    rounded to that dtype, as a cache of it holds them."""
    from dataclasses import replace

    common, q, k, v, cache = make_problem(specs, block_size, num_heads, num_kv_heads, head_dim, seed=seed)
    if round_to is not None:
        cache, k, v = (x.to(round_to).float() for x in (cache, k, v))
    common = replace(common, sliding_window=window, block_table=common.block_table.clone())
    expected = torch.empty_like(q)
    group = num_heads // num_kv_heads
    qsl = common.query_start_loc_cpu
    for i, (c, n) in enumerate(specs):
        table = common.block_table[i].long()
        slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size for p in range(c)],
                             dtype=torch.long)
        keys = torch.cat([cache[0].view(-1, num_kv_heads, head_dim)[slots], k[qsl[i]:qsl[i + 1]]])
        values = torch.cat([cache[1].view(-1, num_kv_heads, head_dim)[slots], v[qsl[i]:qsl[i + 1]]])
        for j in range(n):
            pos = c + j
            lo = max(0, pos - window + 1) if window else 0
            kk = keys[lo:pos + 1].repeat_interleave(group, dim=1)  # [keys, H, D]
            vv = values[lo:pos + 1].repeat_interleave(group, dim=1)
            s = torch.einsum("hd,khd->hk", q[qsl[i] + j].float(), kk.float()) * head_dim ** -0.5
            if soft_cap:
                s = soft_cap * torch.tanh(s / soft_cap)
            p = torch.softmax(s if sinks is None else torch.cat([s, sinks.float().view(-1, 1)], -1), -1)
            expected[qsl[i] + j] = torch.einsum("hk,khd->hd", p[:, :kk.shape[0]], vv.float()).to(q.dtype)
        first_read = max(0, c - window + 1) // block_size if window else 0
        common.block_table[i, :first_read] = 0
    cache[:, 0] = 1e4
    return common, q, k, v, cache, expected
