"""Native CPU execution (``attention.backend=cpu_native``).

``csrc/cpu_ops.c`` holds AVX2/FMA kernels: fp32-, bf16-, int8- or int4-weight
GEMMs with the widening in registers and fp32 activations (bf16 GEMMs in
AVX-512 FMAs on Intel's CPUs, see ``fma_rows``, or on bf16-rounded rows on
AVX512-BF16, see ``bf16_dot``; 4- and 8-bit weights' on int8 rows and VNNI,
see ``int8_rows``), W8A8 int8 GEMMs with int32 sums (AVX512-VNNI where the CPU
has it, see ``vnni``), AMX tiles for both from 16 rows (``amx``), paged attention that reads K/V blocks in
place (no gather), fused RMSNorm/rope/KV-write/SiLU, and ``appl_forward``,
which runs a whole Llama-family step in one call so a decode step pays no
per-op Python or dispatcher cost. The library is compiled with the
system's C compiler at first use and cached by source hash under
``$APPLIANCE_CACHE_DIR/kernels`` (default ``~/.cache/appliance/kernels``);
images ship it prebuilt in ``$APPLIANCE_KERNEL_DIR``.
Importing this module builds or loads it; any failure (no compiler, no
AVX2/FMA) raises ImportError with the reason, which the backend selector
reports as "no usable package".

As an attention backend it also serves the layer-by-layer torch model
(``forward``). Its ``native_forward`` flag tells the ModelRunner to run
each step through ``NativeForward`` instead (``build_native_forward``),
which reads the model through ``weights_view()`` (``ModelWeights``).

The library's Python face is ``cpu_native_ops`` (loaded library, ISA
switches, ``NativeLinear``, paged attention) over ``cpu_native_pack`` (the
weights' panel layouts), and the whole-step forward ``cpu_native_forward``;
this module, the backend, names them.
"""

from __future__ import annotations

from typing import Any

import torch

from appliance.kernels.base import AttentionBackend, CommonAttentionMetadata
from appliance.kernels.cpu_native_forward import NativeForward
from appliance.kernels.cpu_native_pack import (  # noqa: F401 (named from here too)
    PANEL,
    pack_group_params,
    pack_int8_quads,
    pack_panels,
    pack_q4_pairs,
    pack_q4_panels,
    pack_q4_quads,
    pack_vnni_panels,
)
from appliance.kernels.cpu_native_ops import (  # noqa: F401 (the library's Python face, named from here)
    _LIB,
    KV_DTYPES,
    KV_TYPES,
    PHASES,
    NativeLinear,
    NativeMetadata,
    _f32_contig,
    amx,
    amx_min_rows,
    apply_token_bitmask,
    avx512,
    bf16_attention,
    bf16_dot,
    decode_tiles,
    fma_rows,
    host_notes,
    int8_quads,
    int8_rows,
    paged_attention,
    phase_times,
    vnni,
)


class CpuNativeBackend(AttentionBackend):
    name = "cpu_native"
    native_forward = True
    kv_dtypes = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *args: Any, **kw: Any):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, *args, **kw)
        if head_dim % 8 or num_heads % num_kv_heads or num_heads // num_kv_heads > 64:
            raise ValueError(f"cpu_native needs head_dim % 8 == 0 and at most 64 query heads per kv head; got "
                             f"head_dim={head_dim}, {num_heads} heads over {num_kv_heads} kv heads")

    def build_native_forward(self, model: Any) -> "NativeForward":
        """The whole-step forward of ``model`` (a LlamaForCausalLM with its rope
        tables cached) as its weights are now; packs and releases the
        projections' row-major weights, so the model's torch forward no
        longer runs after this."""
        return NativeForward(model.weights_view())

    def build_metadata(self, common: CommonAttentionMetadata) -> NativeMetadata:
        return NativeMetadata(
            common,
            common.query_start_loc.to(torch.int32).contiguous(),
            common.seq_lens.to(torch.int32).contiguous(),
            common.block_table.to(torch.int32).contiguous(),
        )

    def forward(self, q, k, v, kv_cache, md: NativeMetadata, sinks=None):
        if kv_cache.dtype not in KV_DTYPES:
            raise ValueError(f"cpu_native keeps an fp32, bf16 or fp8 KV cache, got {kv_cache.dtype}")
        self.write_kv(k, v, kv_cache, md.common.slot_mapping)
        t = q.shape[0]
        # a bf16 model's query is widened: the kernel reads fp32 queries (and any cache), the output goes back
        q2 = _f32_contig(q.float() if q.dtype == torch.bfloat16 else q, "the query").view(t, -1)
        out = torch.empty_like(q2)
        paged_attention(q2, out, kv_cache, md, self.num_heads, self.num_kv_heads, self.head_dim, self.scale,
                        self.k_scale, self.v_scale, self.soft_cap, sinks)
        return out.view(q.shape).to(q.dtype)
