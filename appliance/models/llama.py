"""The Llama family in one implementation: Llama 2/3 (llama3 rope scaling),
SmolLM2, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), and the
mixture-of-experts Qwen3-MoE and Mixtral, whose sparse layers hold a
``moe.SparseMoe`` in place of the dense MLP.

The forward runs over a flattened token batch (prefill chunks and decodes
mixed), writes K/V through the attention backend into the paged cache, and
projects only the rows in ``logits_indices`` (the last scheduled position
of each sampling request) through the LM head. Parameter names follow
Hugging Face's so checkpoints load by name, except the packed projections
(``qkv_proj`` = q|k|v, ``gate_up_proj`` = gate|up), which the loader fills
from the checkpoint's separate tensors (``PACKED``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch
from torch import nn
import torch.nn.functional as F

from appliance.config.architectures import support
from appliance.models.moe import ExpertParallel, SparseMoe

if TYPE_CHECKING:  # the config and the backend are handed in; the model never picks one
    from appliance.config.schema import ModelConfig
    from appliance.kernels.base import AttentionBackend


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: Optional[dict] = None
    # Mixture of experts: the layers in ``sparse_layers`` route each token to
    # ``num_experts_per_tok`` of ``num_experts`` experts (see models/moe.py).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[int, ...] = ()
    num_physical_experts: int = 0  # expert slots per sparse layer with redundant ones (0: num_experts)

    @staticmethod
    def from_model_config(m: ModelConfig) -> "ModelArch":
        from appliance.config.sizes import sparse_layers

        rs = m.rope_scaling
        rs_type = rs.type
        scaling = None
        if rs_type != "none":
            scaling = {
                "rope_type": rs_type,
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
        return ModelArch(
            architecture=m.architecture,
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            intermediate_size=m.intermediate_size,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            vocab_size=m.vocab_size,
            max_position_embeddings=m.max_position_embeddings,
            rope_theta=m.rope_theta,
            rms_norm_eps=m.rms_norm_eps,
            tie_word_embeddings=m.tie_word_embeddings,
            qkv_bias=m.qkv_bias,
            qk_norm=m.qk_norm,
            rope_scaling=scaling,
            num_experts=m.num_experts,
            num_experts_per_tok=m.num_experts_per_tok,
            moe_intermediate_size=m.moe_intermediate_size,
            norm_topk_prob=m.norm_topk_prob,
            sparse_layers=tuple(sparse_layers(m)),
        )


# checkpoint projection -> (packed parameter, shard index)
PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def packed_target(arch: "ModelArch", name: str) -> Optional[tuple[str, int, int]]:
    """(packed parameter name, row offset, rows) for a checkpoint tensor of a
    packed projection, or None."""
    for src, (dst, shard) in PACKED.items():
        if f".{src}." in name:
            q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
            offsets = {"self_attn.qkv_proj": [(0, q), (q, kv), (q + kv, kv)],
                       "mlp.gate_up_proj": [(0, inter), (inter, inter)]}[dst]
            start, rows = offsets[shard]
            return name.replace(src, dst), start, rows
    return None


def fused_parts(arch: "ModelArch", names: Iterable[str]) -> dict[str, list[str]]:
    """Checkpoint weight names of projections grouped by the module weight
    they fill (q/k/v into qkv_proj, gate/up into gate_up_proj), each group in
    row order."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        packed = packed_target(arch, name)
        target, start = (packed[0], packed[1]) if packed else (name, 0)
        groups.setdefault(target, []).append((start, name))
    return {target: [n for _, n in sorted(g)] for target, g in groups.items()}


# Mixtral's names for its sparse block and experts -> the names used here (Qwen3-MoE's)
_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                  (".w2.", ".down_proj."))


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name as this model names it: Mixtral's
    ``block_sparse_moe.experts.E.w1`` (gate), ``w3`` (up) and ``w2`` (down)
    become ``mlp.experts.E.gate_proj`` / ``up_proj`` / ``down_proj``, its
    router ``mlp.gate``; other names are unchanged."""
    if ".block_sparse_moe." not in name:
        return name
    for old, new in _MIXTRAL_NAMES:
        name = name.replace(old, new)
    return name


def replace_linear(model: nn.Module, weight_name: str, make: Callable[[nn.Module], nn.Module]) -> None:
    """Swap the linear that owns ``weight_name`` for ``make(old_linear)``."""
    parent_path, attr = weight_name[: -len(".weight")].rsplit(".", 1)
    parent = model.get_submodule(parent_path)
    setattr(parent, attr, make(getattr(parent, attr)))


@dataclass(frozen=True)
class TensorParallel:
    """This rank's part of a tensor-parallel model (as vLLM splits one):
    q heads and the gate/up rows split across the ranks (column-parallel),
    o_proj and down_proj split along their inputs (row-parallel, their
    partial sums all-reduced), KV heads split, or each replicated on
    ``size / num_kv_heads`` ranks when there are fewer KV heads than ranks;
    the embedding and the LM head split by vocabulary rows (the vocabulary
    padded to a multiple of 64 x size; an id outside a rank's rows gives a
    zero row there, then all-reduce; the logits of every rank gathered, so
    every rank samples from the whole row). ``comm`` runs the collectives:
    ``all_reduce(t)`` sums in place over the ranks, ``all_gather(t)``
    returns every rank's ``t`` in rank order."""

    rank: int
    size: int
    comm: Any


@dataclass(frozen=True)
class StageLink:
    """A hand-off between pipeline stages: ``comm.broadcast(t, src)`` copies
    rank ``src``'s ``t`` into the other ranks' ``t``, over the sending
    stage's first rank and every rank of the stage after it (and no other
    rank, so the stages need not meet)."""

    comm: Any
    src: int


_OK, _FAILED = 0.0, 1.0  # the last element of a hand-off: whether the stage before ran


@dataclass(eq=False)
class PipelineParallel:
    """This rank's stage of a pipeline-parallel model: layers ``start`` to
    ``end`` (exclusive) of the whole model; the first stage also embeds, the
    last also norms and projects the logits (and keeps the embedding when
    the LM head is tied to it). A forward receives the stage before's rows
    over ``receive`` (None: the first stage), runs this stage's layers, and
    hands its rows on over ``send`` (its first rank's only; None elsewhere
    and on the last stage); only the last stage has logits, so only its
    ranks sample. No rank waits for a later stage: the first can run the
    next batch while the last still works on this one (``parallel.
    pipeline_parallel_size`` batches in flight, see ``engine/core.py``).

    Every step makes exactly one hand-off on each link, failed or not: a
    hand-off is the rows in fp32 and a last element saying whether the
    stage ran (a stage that failed sends that instead, so the next one
    fails the step too rather than waiting or taking the next step's rows);
    ``begin`` before a step and ``abandon`` after a failure keep that
    count when a step fails before or inside ``run``."""

    stage: int
    size: int
    start: int
    end: int
    receive: Optional[StageLink] = None
    send: Optional[StageLink] = None
    _received: bool = field(default=False, repr=False)
    _sent: bool = field(default=False, repr=False)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.size - 1

    def begin(self) -> None:
        """A step starts: none of its hand-offs made yet."""
        self._received = self._sent = False

    def run(self, stage: Callable[[Optional[torch.Tensor], bool], torch.Tensor], rows: tuple[int, int],
            rows_dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
        """This rank's part of one forward: ``stage(x, last)`` runs this
        stage's layers on ``x`` (the rows received, ``rows`` [tokens,
        hidden] in ``rows_dtype``; None on the first stage: it embeds the
        ids) and returns its output rows or, on the last stage (``last``),
        its logits. Returns the logits on the last stage, else None (the
        rows went on)."""
        x = None
        try:
            if self.receive is not None:
                x = self._receive(rows, device, check=True).view(rows).to(rows_dtype)
            out = stage(x, self.last)
        except BaseException:
            self.abandon(rows, device)
            raise
        if self.last:
            return out
        if self.send is not None:
            self._hand_on(out.reshape(-1), _OK)
        return None

    def abandon(self, rows: tuple[int, int], device: torch.device) -> None:
        """After a failed step: the hand-offs it has not made (the rows
        received and dropped, a failure handed on)."""
        if self.receive is not None and not self._received:
            self._receive(rows, device, check=False)
        if self.send is not None and not self._sent:
            self._hand_on(torch.zeros(rows[0] * rows[1], device=device), _FAILED)

    def _receive(self, rows: tuple[int, int], device: torch.device, check: bool) -> torch.Tensor:
        buf = torch.empty(rows[0] * rows[1] + 1, dtype=torch.float32, device=device)
        self._received = True
        self.receive.comm.broadcast(buf, self.receive.src)
        if check and float(buf[-1]) != _OK:
            raise RuntimeError(f"pipeline stage {self.stage - 1} failed this step; stage {self.stage} cannot run it")
        return buf[:-1]

    def _hand_on(self, flat: torch.Tensor, status: float) -> None:
        buf = torch.empty(flat.numel() + 1, dtype=torch.float32, device=flat.device)
        buf[:-1] = flat
        buf[-1] = status
        self._sent = True
        self.send.comm.broadcast(buf, self.send.src)


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    unit = 64 * tp_size
    return -(-vocab_size // unit) * unit


def shard_arch(arch: ModelArch, tp_size: int, expert_parallel: bool = False) -> ModelArch:
    """The dimensions one rank holds: its heads, KV heads, MLP rows and
    vocabulary rows, and its slice of every expert's rows (whole experts
    under expert parallelism, ``models/moe.py``)."""
    kv = arch.num_kv_heads // tp_size if arch.num_kv_heads % tp_size == 0 else 1
    moe_inter = arch.moe_intermediate_size if expert_parallel else arch.moe_intermediate_size // tp_size
    return dataclasses.replace(arch, num_heads=arch.num_heads // tp_size, num_kv_heads=kv,
                               intermediate_size=arch.intermediate_size // tp_size, moe_intermediate_size=moe_inter,
                               vocab_size=padded_vocab(arch.vocab_size, tp_size) // tp_size)


_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "inter", "up_proj": "inter"}
_ROW = {"o_proj": "q", "down_proj": "inter"}


def tensor_shard(arch: ModelArch, rank: int, tp_size: int, name: str) -> Optional[tuple[int, int, int]]:
    """(dim, start, stop) of the checkpoint tensor ``name`` (full ``arch``)
    that rank ``rank`` of ``tp_size`` holds; None: every rank holds it whole
    (norms). Vocabulary rows may stop past the checkpoint's (padding)."""
    local = shard_arch(arch, tp_size)
    d = arch.head_dim
    kv_start = (rank * local.num_kv_heads if arch.num_kv_heads % tp_size == 0
                else rank * arch.num_kv_heads // tp_size)
    spans = {"q": (rank * local.num_heads * d, local.num_heads * d), "kv": (kv_start * d, local.num_kv_heads * d),
             "inter": (rank * local.intermediate_size, local.intermediate_size)}
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    if name.startswith(("model.embed_tokens.", "lm_head.")):
        return 0, rank * local.vocab_size, (rank + 1) * local.vocab_size
    if ".mlp.experts." in name:  # every rank's slice of each expert's intermediate rows (no expert parallelism)
        spans["inter"] = (rank * local.moe_intermediate_size, local.moe_intermediate_size)
    if module in _COLUMN:
        start, n = spans[_COLUMN[module]]
        return 0, start, start + n
    if module in _ROW and name.endswith(".weight"):
        start, n = spans[_ROW[module]]
        return 1, start, start + n
    return None


def shard_blocks(arch: ModelArch, rank: int, tp_size: int, blocks: dict[str, tuple]) -> dict[str, tuple]:
    """Rank ``rank``'s part of quantized projections given whole as blocks
    ((q, d, m) or (q, d, m, perm) by checkpoint weight name, weight d * q + m
    per group of inputs; ``arch`` the full model's), as ``tensor_shard`` cuts
    their dense weights: column-parallel ones by output rows (an LM head's
    rows past the vocabulary padded with zero weights), row-parallel ones by
    inputs, which must fall on whole groups. Act-order blocks (perm: inputs
    stored out of order) of a row-parallel projection cannot be cut that
    way: ValueError, as for groups that straddle the ranks."""
    out = {}
    for name, b in blocks.items():
        span = tensor_shard(arch, rank, tp_size, name)
        if span is None:
            out[name] = b
            continue
        dim, start, stop = span
        q, d, m = (torch.as_tensor(x) for x in b[:3])
        perm = b[3] if len(b) > 3 else None
        if dim == 0:
            q, d, m = q[start:stop], d[start:stop], m[start:stop]
            pad = stop - start - q.shape[0]
            if pad > 0:  # vocabulary padding: zero weights, logits trimmed away after the gather
                q, d, m = (torch.cat([x, x.new_zeros((pad, x.shape[1]))]) for x in (q, d, m))
        else:
            if perm is not None:
                raise ValueError(f"{name}: its inputs are stored in act-order (GPTQ desc_act), so a row-parallel "
                                 f"split of them is not built; serve it with parallel.tensor_parallel_size=1")
            group = q.shape[1] // d.shape[1]
            if start % group or stop % group:
                raise ValueError(f"{name}: rank {rank} of {tp_size} holds inputs {start}..{stop}, which cut its "
                                 f"groups of {group}; use a tensor-parallel size that splits whole groups")
            q, d, m = q[:, start:stop], d[:, start // group : stop // group], m[:, start // group : stop // group]
        out[name] = (q.contiguous(), d.contiguous(), m.contiguous()) + ((perm,) if perm is not None else ())
    return out


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = arch.rope_scaling
    if rs is None:
        return inv_freq
    if rs["rope_type"] == "linear":
        return inv_freq / rs["factor"]
    if rs["rope_type"] == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {rs['rope_type']!r}")


def rope_tables(arch: ModelArch, positions: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, head_dim] in fp32."""
    pos = torch.arange(positions, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, rope_inv_freq(arch).to(device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, backend: AttentionBackend, tp: Optional[TensorParallel] = None):
        super().__init__()
        self.tp = tp
        h, kv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        # q, k and v projections packed into one GEMM (rows q | k | v).
        self.qkv_proj = nn.Linear(arch.hidden_size, (h + 2 * kv) * d, bias=arch.qkv_bias)
        self.q_size, self.kv_size = h * d, kv * d
        self.o_proj = nn.Linear(h * d, arch.hidden_size, bias=False)
        if arch.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self.backend = backend

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """This layer's fp8 KV scales (a checkpoint's): the layer gets its own
        copy of the backend holding them (the copy shares the backend's
        state), as layers of one model may differ."""
        if not (k_scale > 0 and v_scale > 0 and math.isfinite(k_scale) and math.isfinite(v_scale)):
            raise ValueError(f"KV cache scales must be positive and finite; got k_scale={k_scale}, v_scale={v_scale}")
        self.backend = copy.copy(self.backend)
        self.backend.k_scale, self.backend.v_scale = float(k_scale), float(v_scale)

    def forward(self, x, cos, sin, kv_cache, attn_metadata):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata)
        out = self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
        if self.tp is not None:
            self.tp.comm.all_reduce(out)
        return out


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, tp: Optional[TensorParallel] = None):
        super().__init__()
        self.tp = tp
        # gate and up projections packed into one GEMM (rows gate | up).
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.intermediate_size = arch.intermediate_size
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        if self.tp is not None:
            self.tp.comm.all_reduce(out)
        return out


class DecoderLayer(nn.Module):
    """Layer ``index`` of the whole model: attention, then a dense MLP or,
    in a sparse layer, the router and experts (``SparseMoe``)."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, tp: Optional[TensorParallel] = None,
                 index: int = 0, ep: Optional[ExpertParallel] = None):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, backend, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.sparse = index in arch.sparse_layers
        if self.sparse:
            self.mlp = SparseMoe(arch, ep.comm if ep is not None else (tp.comm if tp is not None else None), ep)
        else:
            self.mlp = MLP(arch, tp)

    def forward(self, x, cos, sin, kv_cache, attn_metadata):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attn_metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """The decoder layers a rank holds (all, or a pipeline stage's), with the
    embedding and the final norm where the stage needs them."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, tp: Optional[TensorParallel] = None,
                 layers: Optional[range] = None, embed: bool = True, norm: bool = True,
                 ep: Optional[ExpertParallel] = None):
        super().__init__()
        if embed:
            # filled by the loader: no random init (nn.Embedding's normal_ on the loader's meta
            # tensors would import torch._dynamo, 1.5 s in every process)
            self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                             _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        held = range(arch.num_layers) if layers is None else layers
        self.layers = nn.ModuleList(DecoderLayer(arch, backend, tp, i, ep) for i in held)
        if norm:
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer: norm weights and the live projection modules
    (``nn.Linear`` or a quantized linear such as ``Int8WeightOnlyLinear``)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    q_norm: Optional[torch.Tensor]  # qk_norm models only
    k_norm: Optional[torch.Tensor]
    qkv_proj: nn.Module  # rows q | k | v
    o_proj: nn.Module
    gate_up_proj: Optional[nn.Module]  # rows gate | up; None in a sparse layer
    down_proj: Optional[nn.Module]
    k_scale: float = 1.0  # an fp8 KV cache holds k / k_scale (and v / v_scale)
    v_scale: float = 1.0
    moe: Optional[SparseMoe] = None  # a sparse layer's router and experts


@dataclass(frozen=True)
class ModelWeights:
    """What ``LlamaForCausalLM.weights_view`` hands an executor that runs the
    whole step itself: the architecture, the tensors and projection modules
    (not copies), and fp32 rope tables over the cached positions. A
    tensor-parallel rank's (``tp``) are its part: ``arch`` the dimensions it
    holds (its vocabulary rows among them), ``vocab_size`` the whole
    vocabulary, the logits' width."""

    arch: ModelArch
    embed: Optional[torch.Tensor]  # [vocab, hidden], looked up one row per token; None on a middle pipeline stage
    # (or where the model looks its rows up itself: ``embed_rows``)
    final_norm: Optional[torch.Tensor]  # None on a pipeline stage before the last
    layers: tuple[LayerWeights, ...]
    lm_head: Optional[nn.Module]  # the LM head's own projection (untied or quantized); None: tied to ``embed``
    # (or, on a pipeline stage before the last, no head)
    rope_cos: torch.Tensor  # [positions, head_dim] fp32
    rope_sin: torch.Tensor
    vocab_size: int
    tp: Optional[TensorParallel] = None
    pp: Optional[PipelineParallel] = None  # a pipeline stage's: ``layers`` are its own
    # ids -> their rows, where the embedding is no table (``quant.TiedBlockEmbedding``: read from the head's blocks)
    embed_rows: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


class LlamaForCausalLM(nn.Module):
    """``arch`` is the whole model's; with ``tp`` the module holds rank
    ``tp.rank``'s part of it (``self.arch``: the dimensions it holds,
    ``shard_arch``) and its forward runs the collectives; with ``pp`` only
    its stage's layers (``model.layers`` holds them from 0; ``local_name``
    maps a checkpoint's names)."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, tp: Optional[TensorParallel] = None,
                 pp: Optional[PipelineParallel] = None, ep: Optional[ExpertParallel] = None):
        super().__init__()
        row, why = support(arch.architecture)
        if row is None or row.family != "llama":
            raise ValueError(why or f"{arch.architecture} is built by the {row.family} implementation, not this one")
        self.tp, self.pp, self.ep = tp, pp, ep
        self.vocab_size = arch.vocab_size  # the logits' width
        if tp is not None:
            arch = shard_arch(arch, tp.size, expert_parallel=ep is not None)
        self.arch = arch
        first, last = pp is None or pp.first, pp is None or pp.last
        self.holds_embedding = first or (last and arch.tie_word_embeddings)
        self.holds_head = last
        self.model = Backbone(arch, backend, tp, None if pp is None else range(pp.start, pp.end),
                              embed=self.holds_embedding, norm=last, ep=ep)
        if not arch.tie_word_embeddings and last:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        # (cos, sin) [positions, head_dim] in the model dtype, set by rope_cache(); a
        # new tuple on every call, so a holder of derived tables can tell they changed.
        self.rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.lm_head_q: Optional[nn.Module] = None  # set by quantize_int8_weight_only
        self.eplb: Any = None  # set by enable_eplb
        # a KV connector's worker side (worker/kv_connector.py), called around each layer on this path
        self.kv_layer_hooks: Any = None

    def local_name(self, name: str) -> Optional[str]:
        """The parameter a checkpoint tensor fills here, or None when another
        pipeline stage holds it (its layer, the embedding, the norm, the head)."""
        if self.pp is None:
            return name
        head, sep, rest = name.partition("model.layers.")
        if sep and not head:
            index, _, tail = rest.partition(".")
            if index.isdigit():
                i = int(index)
                return f"model.layers.{i - self.pp.start}.{tail}" if self.pp.start <= i < self.pp.end else None
        if name.startswith("model.embed_tokens."):
            return name if self.holds_embedding else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.holds_head else None
        return name

    def expert_targets(self, name: str) -> list[tuple[str, int, int, int]]:
        """For a checkpoint's expert tensor (``canonical_name``, local layer
        index): (stacked parameter, local slot, first row, rows) of every
        slot here holding that expert (none when other ranks hold it)."""
        head, _, rest = name.partition(".mlp.experts.")
        index, _, tail = rest.partition(".")
        experts = self.get_submodule(head + ".mlp.experts")
        part = tail.partition(".")[0]
        if part not in ("gate_proj", "up_proj", "down_proj"):
            raise ValueError(f"{name}: not an expert projection (gate_proj, up_proj or down_proj)")
        out = []
        for slot, e in enumerate(experts.slot_experts):
            if e != int(index):
                continue
            if part == "down_proj":
                out.append((f"{head}.mlp.experts.w2", slot, 0, experts.hidden))
            else:
                out.append((f"{head}.mlp.experts.w13", slot, 0 if part == "gate_proj" else experts.inter,
                            experts.inter))
        return out

    def enable_eplb(self, window_size: int, step_interval: int) -> None:
        """Balance the experts over the expert-parallel ranks (``models/eplb.py``)."""
        from appliance.models.eplb import Eplb

        arch, ep = self.arch, self.ep
        sparse = [layer.mlp for layer in self.model.layers if layer.sparse]
        self.eplb = Eplb(sparse, arch.num_experts, arch.num_physical_experts or arch.num_experts, ep.rank, ep.size,
                         ep.group, window_size, step_interval, share=ep.comm if ep.dispatches else None)

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.arch.tie_word_embeddings else self.lm_head.weight

    def rope_cache(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        cos, sin = rope_tables(self.arch, max_positions, device)
        self.rope = (cos.to(dtype), sin.to(dtype))

    def weights_view(self) -> "ModelWeights":
        """The model's tensors and projections as they are now (after any
        quantization), for an executor that runs the whole step itself."""
        assert self.rope is not None, "call rope_cache() once before weights_view()"
        cos, sin = self.rope
        if cos.dtype != torch.float32:  # fp32 angles, not bf16-rounded ones
            cos, sin = rope_tables(self.arch, cos.shape[0])
        layers = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            dense = not layer.sparse
            layers.append(LayerWeights(
                input_norm=layer.input_layernorm.weight.data,
                post_attention_norm=layer.post_attention_layernorm.weight.data,
                q_norm=attn.q_norm.weight.data if self.arch.qk_norm else None,
                k_norm=attn.k_norm.weight.data if self.arch.qk_norm else None,
                qkv_proj=attn.qkv_proj, o_proj=attn.o_proj, gate_up_proj=mlp.gate_up_proj if dense else None,
                down_proj=mlp.down_proj if dense else None, k_scale=attn.backend.k_scale,
                v_scale=attn.backend.v_scale, moe=None if dense else mlp,
            ))
        if not self.holds_head:
            lm_head = None
        elif self.lm_head_q is not None:
            lm_head = self.lm_head_q
        else:
            lm_head = None if self.arch.tie_word_embeddings else self.lm_head
        embed = self.model.embed_tokens if self.holds_embedding else None
        table = isinstance(embed, nn.Embedding)
        return ModelWeights(arch=self.arch, embed=embed.weight.data if table else None,
                            final_norm=self.model.norm.weight.data if self.holds_head else None, layers=tuple(layers),
                            lm_head=lm_head, rope_cos=cos, rope_sin=sin, vocab_size=self.vocab_size, tp=self.tp,
                            pp=self.pp, embed_rows=embed if embed is not None and not table else None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
        logits_indices: torch.Tensor,
    ) -> Optional[torch.Tensor]:
        """fp32 logits at ``logits_indices``; None on a pipeline stage before
        the last (its rows went on to the next stage)."""
        assert self.rope is not None, "call rope_cache() once before forward"
        cos = self.rope[0][positions].unsqueeze(1)  # [T, 1, D]
        sin = self.rope[1][positions].unsqueeze(1)

        hooks = self.kv_layer_hooks

        def layers(x: torch.Tensor) -> torch.Tensor:
            for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
                if hooks is not None:
                    hooks.wait_for_layer_load(i)
                x = layer(x, cos, sin, kv_cache, attn_metadata)
                if hooks is not None:
                    hooks.save_kv_layer(i, kv_cache)
            return x

        pp = self.pp
        if pp is None:
            logits = self._logits(layers(self._embed(input_ids)), logits_indices)
            if self.eplb is not None:
                self.eplb.after_forward()
            return logits

        def stage(x: Optional[torch.Tensor], last: bool) -> torch.Tensor:
            x = layers(self._embed(input_ids) if x is None else x)
            return self._logits(x, logits_indices) if last else x

        logits = pp.run(stage, (input_ids.shape[0], self.arch.hidden_size), self.rope[0].dtype, input_ids.device)
        if self.eplb is not None:  # this stage's sparse layers, balanced over its ranks
            self.eplb.after_forward()
        return logits

    def idle_forward(self) -> None:
        """An engine core with nothing to run, while its data-parallel peers
        step: each sparse layer's exchange with no rows of its own, in layer
        order, so the peers' collectives line up (expert parallelism across
        engine cores)."""
        assert self.rope is not None, "call rope_cache() once before idle_forward"
        empty = torch.empty((0, self.arch.hidden_size), dtype=self.rope[0].dtype, device=self.rope[0].device)
        for layer in self.model.layers:
            if layer.sparse:
                layer.mlp.exchange(empty)
        if self.eplb is not None:
            self.eplb.after_forward()

    def _logits(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        x = self.model.norm(x[logits_indices])
        if self.lm_head_q is not None:
            logits = self.lm_head_q(x).float()
        else:
            logits = F.linear(x, self.lm_head_weight()).float()
        if self.tp is None:
            return logits
        return torch.cat(self.tp.comm.all_gather(logits), dim=-1)[:, : self.vocab_size]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.model.embed_tokens(input_ids)
        if input_ids.numel() and not (0 <= int(input_ids.min()) and int(input_ids.max()) < self.vocab_size):
            raise ValueError(f"a token id is outside the vocabulary (0..{self.vocab_size - 1})")
        rows = self.arch.vocab_size
        local = input_ids - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        x = self.model.embed_tokens(local.clamp(0, rows - 1))
        x[outside] = 0
        self.tp.comm.all_reduce(x)
        return x
