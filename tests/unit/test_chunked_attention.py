"""Chunked local attention (Llama 4's) in every backend: a token at position
p attends to keys ``p - p % chunk .. p`` only, and the blocks before the
chunk of a request's first query token (given back: the null block, or
another request's) are never read. Each backend that runs on the CPU
(torch_sdpa, cpu_native's paged attention, Triton under the interpreter in
fp32) is checked against a dense masked softmax over the explicit K/V, with
those blocks pointed at a block of NaN (a read one, even masked, would
spread NaN through the softmax's weighted sum); FlashAttention-3 and
FlashInfer, which take no chunks, run causal attention over the step's
virtual batch (``local_attention.virtual_batches``), checked here through
torch_sdpa over that batch and by hand."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported (as test_triton_attention)

from dataclasses import replace  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from appliance.kernels.base import CommonAttentionMetadata  # noqa: E402
from appliance.kernels.local_attention import virtual_batches  # noqa: E402
from appliance.kernels.registry import BACKENDS  # noqa: E402
from appliance.kernels.torch_sdpa import TorchSDPABackend  # noqa: E402
from tests.kernel_helpers import make_problem  # noqa: E402


def specs_for(chunk):
    """(num_computed, query_len) by chunk size: a fresh prompt over three chunks, a chunk of a prefill from
    mid-chunk across a boundary, decodes at a boundary, just after one and at a chunk's last position, a long
    chunk from mid-chunk across two boundaries, a chunk inside the first chunk after a prefix."""
    c = chunk
    return [(0, 2 * c + 7), (2 * c - 3, 7), (2 * c, 1), (2 * c + 1, 1), (3 * c - 1, 1), (4 * c + 5, 2 * c + 3),
            (c // 2, max(1, c // 4))]


def chunked_problem(specs, chunk, block_size, num_heads, num_kv_heads, head_dim, seed=0):
    """``make_problem`` under chunked local attention: (common, q, k, v, kv_cache, expected output). The
    expected output is a masked softmax over each request's explicit K/V; then each request's blocks wholly
    before its first query token's chunk are pointed at a block of NaN appended to the cache."""
    common, q, k, v, cache = make_problem(specs, block_size, num_heads, num_kv_heads, head_dim, seed=seed)
    common = replace(common, attention_chunk=chunk, block_table=common.block_table.clone())
    expected = torch.empty_like(q)
    group, qsl, bs = num_heads // num_kv_heads, common.query_start_loc_cpu, block_size
    for i, (done, n) in enumerate(specs):
        table = common.block_table[i].long()
        slots = table[torch.arange(done) // bs] * bs + torch.arange(done) % bs
        rows = slice(qsl[i], qsl[i + 1])
        keys = torch.cat([cache[0].view(-1, num_kv_heads, head_dim)[slots], k[rows]]).repeat_interleave(group, 1)
        values = torch.cat([cache[1].view(-1, num_kv_heads, head_dim)[slots], v[rows]]).repeat_interleave(group, 1)
        pos, key_pos = torch.arange(done, done + n).view(-1, 1), torch.arange(done + n).view(1, -1)
        visible = (key_pos <= pos) & (key_pos >= pos - pos % chunk)
        s = torch.einsum("qhd,khd->hqk", q[rows], keys) * head_dim ** -0.5
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
        expected[rows] = torch.einsum("hqk,khd->qhd", p, values)
    poison = cache.shape[1]
    cache = torch.cat([cache, torch.full_like(cache[:, :1], float("nan"))], dim=1)
    for i, (done, _) in enumerate(specs):
        common.block_table[i, : done // chunk * chunk // bs] = poison
    return common, q, k, v, cache, expected


def cpu_backends():
    out = [TorchSDPABackend]
    try:
        from appliance.kernels.cpu_native import CpuNativeBackend
    except ImportError as e:  # no compiler or no AVX2 here: cpu_native is not selectable either
        return out + [pytest.param(None, marks=pytest.mark.skip(reason=f"cpu_native does not build here: {e}"))]
    return out + [CpuNativeBackend]


@pytest.mark.parametrize("backend", cpu_backends(), ids=["torch_sdpa", "cpu_native"])
# the last: a chunk that is not a multiple of the block size (the engine's never are; the kernels do not need it)
@pytest.mark.parametrize("chunk,block_size,heads", [(8, 4, (4, 2)), (4, 4, (4, 2)), (16, 8, (8, 1)),
                                                    (32, 16, (6, 2)), (6, 8, (4, 2))])
def test_each_token_attends_within_its_chunk_and_nothing_before_is_read(backend, chunk, block_size, heads):
    common, q, k, v, cache, expected = chunked_problem(specs_for(chunk), chunk, block_size, *heads, 16)
    b = backend(*heads, 16, 16 ** -0.5)
    out = b.forward(q, k, v, cache, b.build_metadata(common))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", cpu_backends(), ids=["torch_sdpa", "cpu_native"])
def test_a_bf16_cache_keeps_to_its_chunks(backend):
    """bf16 rows and cache (cpu_native's bf16 KV reads, on the decode items this CPU runs: AVX-512F or AVX2), within
    bf16's rounding of the fp32 reference; the poisoned blocks still never read."""
    common, q, k, v, cache, expected = chunked_problem(specs_for(8), 8, 4, 4, 2, 16)
    b = backend(4, 2, 16, 16 ** -0.5)
    out = b.forward(*(t.to(torch.bfloat16) for t in (q, k, v, cache)), b.build_metadata(common))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("backend", cpu_backends(), ids=["torch_sdpa", "cpu_native"])
def test_long_chunks_with_split_decode_contexts(backend):
    """Chunks longer than cpu_native's split of a decode's context (256 positions): a decode whose chunk
    holds 389 keys (split and merged), one just past a boundary, a prefill chunk across one."""
    specs = [(900, 1), (1024, 1), (1020, 9)]
    common, q, k, v, cache, expected = chunked_problem(specs, 512, 16, 4, 2, 16)
    b = backend(4, 2, 16, 16 ** -0.5)
    torch.testing.assert_close(b.forward(q, k, v, cache, b.build_metadata(common)), expected, rtol=1e-4, atol=1e-4)


def test_the_chunk_changes_the_answer():
    """The problems are ones where attending past the chunk would show: full causal attention differs."""
    specs = specs_for(8)
    _, _, _, _, _, expected = chunked_problem(specs, 8, 4, 4, 2, 16)
    common, q, k, v, cache = make_problem(specs, 4, 4, 2, 16)
    b = TorchSDPABackend(4, 2, 16, 16 ** -0.5)
    full = b.forward(q, k, v, cache, b.build_metadata(common))
    rows = [i for i, (done, n) in enumerate(specs) if done + n > 8]  # the requests that reach past a chunk
    for i in rows:
        end = common.query_start_loc_cpu[i + 1]
        assert (full[end - 1] - expected[end - 1]).abs().max() > 1e-2, specs[i]


def _triton():
    from appliance.kernels import triton_attention

    if not triton_attention.INTERPRET:
        pytest.skip("appliance.kernels.triton_attention was imported before TRITON_INTERPRET=1 was set")
    return triton_attention.TritonAttentionBackend


@pytest.mark.parametrize("chunk,heads", [(16, (4, 2)), (32, (8, 2)), (24, (4, 2))])
def test_triton_under_the_interpreter(chunk, heads):
    """fp32 only: the interpreter's bf16 tl.dot is wrong. Tiles of up to 4 query tokens start mid-chunk."""
    common, q, k, v, cache, expected = chunked_problem(specs_for(chunk), chunk, 16, *heads, 16)
    b = _triton()(*heads, 16, 16 ** -0.5)
    torch.testing.assert_close(b.forward(q, k, v, cache, b.build_metadata(common)), expected, rtol=1e-4, atol=1e-4)


def random_specs(rng, chunk):
    """Prefix lengths anywhere in five chunks, query lengths of decodes and of chunks of up to three chunks."""
    return [(int(rng.integers(0, 5 * chunk)), int(rng.choice([1, rng.integers(1, 3 * chunk + 1)])))
            for _ in range(int(rng.integers(1, 7)))]


@pytest.mark.parametrize("chunk,block_size", [(4, 4), (8, 4), (16, 4), (16, 16), (24, 8)])
@pytest.mark.parametrize("seed", range(3))
def test_causal_attention_over_the_virtual_batch_is_chunked_attention(chunk, block_size, seed):
    """What FlashAttention-3 and FlashInfer run: plain causal attention (torch_sdpa, no chunk) over the virtual
    batch, whose block tables start at each chunk's first block (the poisoned ones are never named)."""
    specs = random_specs(np.random.default_rng([seed, chunk, block_size]), chunk)
    common, q, k, v, cache, expected = chunked_problem(specs, chunk, block_size, 4, 2, 8, seed=seed)
    virtual = virtual_batches(common)
    assert virtual.attention_chunk is None and virtual.slot_mapping is common.slot_mapping
    assert virtual.num_actual_tokens == common.num_actual_tokens == virtual.query_start_loc_cpu[-1]
    b = TorchSDPABackend(4, 2, 8, 8 ** -0.5)
    torch.testing.assert_close(b.forward(q, k, v, cache, b.build_metadata(virtual)), expected, rtol=1e-4, atol=1e-4)
    # a virtual request's context lies within one chunk: never past its end, never before its start
    assert all(0 < s <= chunk for s in virtual.seq_lens_cpu)
    assert (virtual.seq_lens - virtual.num_computed_tokens).tolist() == \
        np.diff(virtual.query_start_loc_cpu).tolist()


def _by_hand() -> CommonAttentionMetadata:
    """Chunk 4, block size 2: a request at positions 3..8 (3 computed, 6 new), a decode at position 4, a fresh
    prompt of 3."""
    bt = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 0, 0], [30, 31, 0, 0, 0]], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 6, 7, 10], dtype=torch.int32),
        seq_lens=torch.tensor([9, 5, 3], dtype=torch.int32),
        num_computed_tokens=torch.tensor([3, 4, 0], dtype=torch.int32),
        block_table=bt, slot_mapping=torch.arange(10, dtype=torch.long), block_size=2, num_reqs=3,
        num_actual_tokens=10, max_query_len=6, max_seq_len=9, query_start_loc_cpu=[0, 6, 7, 10],
        seq_lens_cpu=[9, 5, 3], attention_chunk=4)


def test_virtual_batch_by_hand():
    v = virtual_batches(_by_hand())
    # request 0 splits into {3} over keys 0..3, {4..7} over 4..7, {8} over 8; the decode at 4 sees only itself
    assert v.query_start_loc_cpu == [0, 1, 5, 6, 7, 10] and v.query_start_loc.tolist() == [0, 1, 5, 6, 7, 10]
    assert v.seq_lens_cpu == [4, 4, 1, 1, 3] and v.seq_lens.tolist() == [4, 4, 1, 1, 3]
    assert v.num_computed_tokens.tolist() == [3, 0, 0, 0, 0]
    assert v.block_table.tolist() == [[10, 11], [12, 13], [14, 0], [22, 0], [30, 31]]
    assert all(t.dtype == torch.int32 for t in (v.query_start_loc, v.seq_lens, v.num_computed_tokens, v.block_table))
    assert (v.num_reqs, v.max_query_len, v.max_seq_len, v.num_actual_tokens, v.attention_chunk) == (5, 4, 4, 10, None)
    assert torch.equal(v.slot_mapping, torch.arange(10))
    plain = replace(_by_hand(), attention_chunk=None)
    assert virtual_batches(plain) is plain
    with pytest.raises(ValueError, match="attention_chunk 6 is not a multiple of the block size 4"):
        virtual_batches(replace(_by_hand(), attention_chunk=6, block_size=4))


def test_gpu_backends_metadata_describes_the_virtual_batch():
    from appliance.kernels.flash_attn_attention import build_fa3_metadata
    from appliance.kernels.flashinfer_attention import FlashInferBackend

    fa3 = build_fa3_metadata(_by_hand())
    assert fa3.cu_seqlens_q.tolist() == [0, 1, 5, 6, 7, 10] and fa3.cache_seqlens.tolist() == [4, 4, 1, 1, 3]
    assert fa3.page_table.tolist() == [[10, 11], [12, 13], [14, 0], [22, 0], [30, 31]] and fa3.max_seqlen_q == 4
    assert fa3.common.num_reqs == 5  # fp8 descales are per virtual request
    fi = FlashInferBackend(4, 2, 64, 0.125).build_metadata(_by_hand())
    assert fi.qo_indptr.tolist() == [0, 1, 5, 6, 7, 10]
    assert fi.paged_kv_indptr.tolist() == [0, 2, 4, 5, 6, 8]
    assert fi.paged_kv_indices.tolist() == [10, 11, 12, 13, 14, 22, 30, 31]  # no block before a chunk: not 20, 21
    assert fi.paged_kv_last_page_len.tolist() == [2, 2, 1, 1, 1]


def test_the_virtual_batch_is_built_where_the_batch_is():
    meta = torch.device("meta")
    common = _by_hand()
    common = replace(common, **{f: getattr(common, f).to(meta) for f in ("query_start_loc", "seq_lens",
                                                                         "num_computed_tokens", "block_table")})
    v = virtual_batches(common)
    assert {t.device for t in (v.query_start_loc, v.seq_lens, v.num_computed_tokens, v.block_table)} == {meta}


def test_each_backend_declares_chunks_and_one_without_them_is_refused():
    from appliance.config.compose import resolve

    assert all("chunked" in caps.features for caps in BACKENDS.values())
    cfg = resolve(["model=tiny_random"]).cfg
    why = f"no chunked local attention ({cfg.model.architecture} has them)"
    assert why not in BACKENDS["torch_sdpa"].validate(cfg, "float32", ("chunked",))
    assert why in replace(BACKENDS["torch_sdpa"], features=("sinks",)).validate(cfg, "float32", ("chunked",))


def test_the_native_whole_step_forward_refuses_chunked_groups():
    """It has no chunks (models with chunked layers run layer by layer): it says so rather than ignore them."""
    try:
        from appliance.kernels.cpu_native_forward import NativeForward
    except ImportError as e:
        pytest.skip(f"cpu_native does not build here: {e}")
    chunked = SimpleNamespace(common=_by_hand())
    plain = SimpleNamespace(common=replace(_by_hand(), attention_chunk=None))
    for md in (chunked, [plain, chunked]):
        with pytest.raises(ValueError, match="no chunked local attention"):
            NativeForward._bind_groups(SimpleNamespace(_layers=[]), md)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runs only on CUDA")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flashinfer", "flash_attn3", "triton"])
def test_cuda_kernels_attend_within_chunks(name):
    from appliance.kernels.registry import load_backend, probe_provider

    if probe_provider(name, model_needs=("chunked",))[0] is None:
        pytest.skip(f"{name} not importable here")
    common, q, k, v, cache, expected = chunked_problem(specs_for(16), 16, 16, 8, 2, 64)
    dev = torch.device("cuda")
    common = replace(common, **{f: getattr(common, f).to(dev) for f in common.__dataclass_fields__
                                if torch.is_tensor(getattr(common, f))})
    b = load_backend(name)(8, 2, 64, 64 ** -0.5)
    out = b.forward(*(t.to(dev, torch.bfloat16) for t in (q, k, v, cache)), b.build_metadata(common))
    torch.testing.assert_close(out.float().cpu(), expected, rtol=3e-2, atol=3e-2)
