"""``NativeForward``: a whole Llama-family step in one native call
(``appl_forward``), over the weights a model shows through
``weights_view()`` packed for the library; tensor- and pipeline-parallel
ranks' exchanges and the MoE layers' routing called back from it."""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import torch

from appliance.kernels.cpu_native_ops import (
    _LIB,
    KV_DTYPES,
    KV_TYPES,
    WEIGHT_DTYPES,
    Layer,
    Linear,
    Model,
    Moe,
    NativeLinear,
    NativeMetadata,
    ReduceFn,
    RouteFn,
    Step,
    _ptr,
    _small_f32,
)

def _view(ptr: int, n: int, ctype: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer((ctype * n).from_address(ptr), dtype=dtype)


class _Router:
    """The routing callback of the native forward: the model's own
    ``route`` (``torch.topk`` over the router's softmax, so ties fall as in
    the torch path and the reference models). An exception cannot cross
    the C frames; it is kept and raised once the step returns."""

    def __init__(self, route: Any):
        self.route = route
        self.error: Optional[BaseException] = None
        self.fn = RouteFn(self)

    def __call__(self, logits_ptr: int, t: int, n_experts: int, k: int, ids_ptr: int, weights_ptr: int) -> None:
        if t == 0 or self.error is not None:
            return
        try:
            logits = _view(logits_ptr, t * n_experts, ctypes.c_float, torch.float32).view(t, n_experts)
            weights, ids = self.route(logits)
            _view(ids_ptr, t * k, ctypes.c_int32, torch.int32).copy_(ids.reshape(-1))
            _view(weights_ptr, t * k, ctypes.c_float, torch.float32).copy_(weights.reshape(-1))
        except BaseException as e:  # noqa: BLE001 (kept for the caller; C cannot unwind it)
            self.error = e
            _view(ids_ptr, t * k, ctypes.c_int32, torch.int32).fill_(-1)  # routed nowhere: the step is discarded

    def raise_error(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise RuntimeError(f"routing a sparse layer failed: {type(e).__name__}: {e}") from e


class _Reducer:
    """A tensor-parallel rank's all-reduce for the native forward, through
    collectives without a native entry (``torch.distributed``): a callback
    into ``comm.all_reduce``. An exception cannot cross the C frames; it is
    kept, the call reports failure and the step stops there."""

    def __init__(self, comm: Any):
        self.comm = comm
        self.error: Optional[BaseException] = None
        self.fn = ReduceFn(self)

    def __call__(self, _ctx: int, data: int, n: int) -> int:
        try:
            self.comm.all_reduce(_view(data, n, ctypes.c_float, torch.float32))
            return 0
        except BaseException as e:  # noqa: BLE001 (kept for the caller; C cannot unwind it)
            self.error = e
            return 1


class NativeForward:
    """The whole forward of a LlamaForCausalLM in one native call per step,
    built from the model's ``weights_view()`` (``ModelWeights``). A
    tensor-parallel rank's part runs the same call: its embedding rows,
    o_proj's and down's partial sums (a sparse layer's: its rows of every
    expert, combined by the routing weights) are all-reduced inside
    it, through the shared-memory segment's C entry where the ranks have
    one (``ShmComm.native_reduce``), else a callback into the rank's
    collectives; its logits columns are gathered after it. A pipeline
    stage's (``weights.pp``) runs its layers in one call, from the ids
    (first stage) or the rows the stage before handed on, to its rows
    (handed on, fp32) or, on the last stage, the logits."""

    def __init__(self, weights: Any):
        arch = weights.arch
        self.arch = arch
        self._lin: list[NativeLinear] = []
        self._held: list[torch.Tensor] = []  # every tensor a pointer below refers to
        self._layers = (Layer * len(weights.layers))()
        self._kv_ptrs: list[int] = []
        self._moes: list[Moe] = []
        route = None
        for i, lw in enumerate(weights.layers):
            mlp = (lw.gate_up_proj, lw.down_proj) if lw.moe is None else ()
            # q/k/v take the normed rows unrounded: int8 rows on every projection cost SmolLM2 1.44% perplexity,
            # on all but q/k/v 0.68% (docs/benchmarks.md)
            lins = [NativeLinear(lw.qkv_proj, release=True, float_rows=True)]
            lins += [NativeLinear(m, release=True) for m in (lw.o_proj, *mlp)]
            self._lin += lins
            L = self._layers[i]
            L.ln1 = self._hold(lw.input_norm)
            L.ln2 = self._hold(lw.post_attention_norm)
            if arch.qk_norm:
                L.q_norm, L.k_norm = self._hold(lw.q_norm), self._hold(lw.k_norm)
            L.qkv, L.o = lins[0].struct, lins[1].struct
            if lw.moe is None:
                L.gate_up, L.down = lins[2].struct, lins[3].struct
            else:
                L.moe = ctypes.pointer(self._sparse(lw.moe))
                route = route or lw.moe
            L.k_scale, L.v_scale = lw.k_scale, lw.v_scale
        self.pp = weights.pp
        first, last = self.pp is None or self.pp.first, self.pp is None or self.pp.last
        if not last:  # its rows go on to the next stage: no head
            self._lm_head = None
        elif weights.lm_head is not None:
            self._lm_head = NativeLinear(weights.lm_head, release=True, float_rows=True)  # the logits: rows unrounded
        else:  # tied: the embedding stays row-major for lookups, so pack a copy
            self._lm_head = NativeLinear.from_weight(weights.embed)
        cos, sin = weights.rope_cos, weights.rope_sin  # fp32, like the activations
        # The embedding is read one row per token, widened in the kernel: a bf16 table stays bf16. An embedding
        # that is no table (read from the tied head's blocks) hands its rows in, as a later pipeline stage's do.
        embed = weights.embed if first else None  # a later stage starts from the rows handed on
        self._embed_rows = weights.embed_rows if first and embed is None else None
        if embed is not None:
            if embed.dtype not in WEIGHT_DTYPES:
                raise ValueError(f"cpu_native needs an fp32 or bf16 embedding; it is {embed.dtype}")
            embed = embed.contiguous()
            self._held.append(embed)
        self.struct = Model(
            len(weights.layers), arch.hidden_size, arch.intermediate_size, arch.num_heads, arch.num_kv_heads,
            arch.head_dim, arch.vocab_size, cos.shape[0], arch.rms_norm_eps, arch.head_dim ** -0.5, 0,
            int(embed is not None and embed.dtype == torch.bfloat16), _ptr(embed),
            self._hold(weights.final_norm) if last else None, self._hold(cos), self._hold(sin),
            self._lm_head.struct if self._lm_head is not None else Linear(), ctypes.cast(self._layers, ctypes.POINTER(Layer)),
        )
        if cos.shape[1] != arch.rope_dim:
            raise ValueError(f"rope tables of {cos.shape[1]} channels for a rope over {arch.rope_dim} of each head")
        self.struct.rope_dim = arch.rope_dim
        self._router = None
        if route is not None:
            self._router = _Router(route.route)  # held: C keeps the pointer
            self.struct.route = self._router.fn
            self.struct.moe_experts, self.struct.moe_top_k = arch.num_experts, arch.num_experts_per_tok
            self.struct.moe_inter = arch.moe_intermediate_size
        self._scratch = torch.empty(0, dtype=torch.float32)
        self.vocab_size, self.tp = weights.vocab_size, weights.tp
        self._reduce_keep: Any = None
        if self.tp is not None:
            self._bind_reduce(self.tp)

    def _bind_reduce(self, tp: Any) -> None:
        self.struct.vocab_start = tp.rank * self.arch.vocab_size  # arch: this rank's rows
        native = getattr(tp.comm, "native_reduce", None)
        if native is not None:
            fn, ctx, self._reduce_keep = native()
            self.struct.reduce, self.struct.reduce_ctx = fn, ctx
        else:
            self._reduce_keep = _Reducer(tp.comm)
            self.struct.reduce = ctypes.cast(self._reduce_keep.fn, ctypes.c_void_p).value

    def _sparse(self, moe: Any) -> "Moe":
        """A sparse layer's router and experts, packed (the float experts freed)."""
        experts = moe.experts
        if moe.top_k > 64:
            raise ValueError(f"cpu_native routes a token to at most 64 experts; this model routes to {moe.top_k}")
        router = NativeLinear(moe.gate, release=True)
        w13, w2 = [], []
        for e in range(experts.num_local):
            gate_up, down = experts.projections(e)
            w13.append(NativeLinear(gate_up, release=experts.quantized is not None))
            w2.append(NativeLinear(down, release=experts.quantized is not None))
        experts.release_float()
        self._lin += [router, *w13, *w2]
        arr13 = (Linear * len(w13))(*(x.struct for x in w13))
        arr2 = (Linear * len(w2))(*(x.struct for x in w2))
        self._held_structs = getattr(self, "_held_structs", []) + [arr13, arr2]
        s = Moe(moe.num_experts, moe.top_k, experts.inter, experts.first, experts.num_local, 0, router.struct,
                ctypes.cast(arr13, ctypes.POINTER(Linear)), ctypes.cast(arr2, ctypes.POINTER(Linear)))
        self._moes.append(s)
        return s

    def _hold(self, t: torch.Tensor) -> int:
        t = _small_f32(t, "a weight")
        self._held.append(t)
        return t.data_ptr()

    def _bind_caches(self, kv_caches: list[torch.Tensor]) -> None:
        ptrs = [c.data_ptr() for c in kv_caches]
        if ptrs == self._kv_ptrs:
            return
        dtypes = {c.dtype for c in kv_caches}
        if len(dtypes) != 1 or not dtypes <= set(KV_DTYPES):
            raise ValueError(f"cpu_native needs one fp32, bf16 or fp8 KV cache dtype, got {sorted(map(str, dtypes))}")
        self.struct.kv_type = KV_TYPES[kv_caches[0].dtype]
        for i, c in enumerate(kv_caches):
            if not c.is_contiguous():
                raise ValueError("cpu_native needs a contiguous KV cache")
            self._layers[i].k_cache, self._layers[i].v_cache = c[0].data_ptr(), c[1].data_ptr()
        self._kv_ptrs = ptrs

    def _bind_groups(self, md: Any) -> tuple[NativeMetadata, Any]:
        """The step's metadata: one for every layer (the first returned), or
        (a list, one per layer) each layer's KV-cache group's; then the
        groups' block tables, slots and windows as the native call reads
        them, each layer told its group (None: one group, full attention)."""
        if any(m.common.attention_chunk for m in (md if isinstance(md, list) else [md])):
            raise ValueError("cpu_native's whole-step forward has no chunked local attention (a KV-cache group "
                             "with attention_chunk set): a model with chunked layers runs layer by layer")
        if not isinstance(md, list) and not md.common.sliding_window:
            return md, None
        per_layer = md if isinstance(md, list) else [md] * len(self._layers)
        groups: dict[int, int] = {}
        for i, m in enumerate(per_layer):
            self._layers[i].group = groups.setdefault(id(m), len(groups))
        mds = list({id(m): m for m in per_layer}.values())
        n = len(mds)
        slots = [m.common.slot_mapping.to(torch.int64).contiguous() for m in mds]
        arrays = ((ctypes.c_void_p * n)(*(m.block_table.data_ptr() for m in mds)),
                  (ctypes.c_void_p * n)(*(x.data_ptr() for x in slots)),
                  (ctypes.c_int32 * n)(*(m.common.sliding_window or 0 for m in mds)), slots)
        return mds[0], arrays

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 md: Any, logits_indices: torch.Tensor) -> Optional[torch.Tensor]:
        """The logits at ``logits_indices``; None on a pipeline stage before the last (its rows went on).
        ``md``: the step's metadata, or one per layer (a model with several KV-cache groups)."""
        self._bind_caches(kv_caches)
        md, groups = self._bind_groups(md)
        c = md.common
        t = int(input_ids.shape[0])
        need = _LIB.appl_scratch_floats(ctypes.byref(self.struct), t)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        ids = input_ids.to(torch.int64).contiguous()
        pos = positions.to(torch.int64).contiguous()
        if t:  # the native side indexes tables with these: check them here, not with a crash there
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
            if int(pos.max()) >= self.struct.max_pos:
                raise ValueError(f"position {int(pos.max())} beyond the rope table ({self.struct.max_pos})")
        slots = c.slot_mapping.to(torch.int64).contiguous()
        li = logits_indices.to(torch.int64).contiguous()

        def stage(rows: Optional[torch.Tensor], last: bool) -> torch.Tensor:
            """This rank's layers on ``rows`` (None: the ids' embedding); the logits, or (before the last
            pipeline stage) the rows after them."""
            out = torch.empty((li.shape[0], self.arch.vocab_size) if last else (t, self.arch.hidden_size),
                              dtype=torch.float32)
            step = Step(t, c.num_reqs, li.shape[0] if last else 0, c.block_size, md.block_table.stride(0), 0,
                        ids.data_ptr(), pos.data_ptr(), slots.data_ptr(), li.data_ptr(),
                        md.qsl.data_ptr(), md.seq_lens.data_ptr(), md.block_table.data_ptr(),
                        self._scratch.data_ptr(), out.data_ptr() if last else None, _ptr(rows),
                        None if last else out.data_ptr())
            if groups is not None:
                step.group_tables, step.group_slots, step.group_windows = (ctypes.addressof(a) for a in groups[:3])
            _LIB.appl_forward(ctypes.byref(self.struct), ctypes.byref(step))
            if self._router is not None:
                self._router.raise_error()
            if step.failed:
                error = getattr(self._reduce_keep, "error", None)
                if error is not None:
                    self._reduce_keep.error = None
                raise RuntimeError(f"the tensor-parallel all-reduce inside the native forward failed on rank "
                                   f"{self.tp.rank}: {error or 'the other ranks did not arrive in time'}") from error
            if last and self.tp is not None:
                out = torch.cat(self.tp.comm.all_gather(out), dim=-1)[:, : self.vocab_size]
            return out

        if self.pp is None:
            return stage(None if self._embed_rows is None else self._embed_rows(ids).float().contiguous(), True)
        return self.pp.run(stage, (t, self.arch.hidden_size), torch.float32, torch.device("cpu"))
