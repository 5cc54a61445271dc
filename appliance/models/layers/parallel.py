"""Tensor and pipeline parallelism: which part of the model a rank holds
(``shard_arch``: its dimensions; ``tensor_shard``/``shard_blocks``: the
rows or columns of each checkpoint tensor: a projection's as its linear
declares, ``layers.linear``; the vocabulary-parallel embedding and LM head),
and a pipeline stage's hand-offs (``PipelineParallel``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from appliance.config.architectures import ARCHITECTURES
from appliance.models.arch import ModelArch
from appliance.models.layers.linear import Projections


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


def row_parallel_output(proj: nn.Module, x: torch.Tensor, tp: Optional[TensorParallel]) -> torch.Tensor:
    """A row-parallel projection's output: ``proj(x)`` alone, or with ``tp``
    this rank's partial sum all-reduced over the ranks, a bias counted once
    (rank 0's). ``proj`` is the linear or the module that replaced it."""
    if tp is None:
        return proj(x)
    if tp.rank == 0 or getattr(proj, "bias", None) is None:
        out = proj(x)
    else:  # the weight alone: the ranks after the first leave the bias out of their partial sums
        out = F.linear(x, cast(torch.Tensor, proj.weight))
    tp.comm.all_reduce(out)
    return out


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
        link = self.receive
        assert link is not None, "the first stage receives nothing"
        link.comm.broadcast(buf, link.src)
        if check and float(buf[-1]) != _OK:
            raise RuntimeError(f"pipeline stage {self.stage - 1} failed this step; stage {self.stage} cannot run it")
        return buf[:-1]

    def _hand_on(self, flat: torch.Tensor, status: float) -> None:
        buf = torch.empty(flat.numel() + 1, dtype=torch.float32, device=flat.device)
        buf[:-1] = flat
        buf[-1] = status
        self._sent = True
        link = self.send
        assert link is not None, "the last stage hands nothing on"
        link.comm.broadcast(buf, link.src)


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    unit = 64 * tp_size
    return -(-vocab_size // unit) * unit


def shard_arch(arch: ModelArch, tp_size: int, expert_parallel: bool = False) -> ModelArch:
    """The dimensions one rank holds: its heads, KV heads, MLP rows and
    vocabulary rows, and its slice of every expert's rows (whole experts
    under expert parallelism, ``models/layers/moe.py``)."""
    kv = arch.num_kv_heads // tp_size if arch.num_kv_heads % tp_size == 0 else 1
    moe_inter = arch.moe_intermediate_size if expert_parallel else arch.moe_intermediate_size // tp_size
    return dataclasses.replace(arch, num_heads=arch.num_heads // tp_size, num_kv_heads=kv,
                               intermediate_size=arch.intermediate_size // tp_size, moe_intermediate_size=moe_inter,
                               shared_expert_intermediate_size=arch.shared_expert_intermediate_size // tp_size,
                               vocab_size=padded_vocab(arch.vocab_size, tp_size) // tp_size)


def _spans(arch: ModelArch, rank: int, tp_size: int) -> dict[str, tuple[int, int]]:
    """(first row, rows) of rank ``rank``'s q heads, KV heads (a replicated KV head's, when fewer than the ranks)
    and MLP rows in the full model's projections (``layers.linear.SPANS``)."""
    local, d = shard_arch(arch, tp_size), arch.head_dim
    kv_start = (rank * local.num_kv_heads if arch.num_kv_heads % tp_size == 0
                else rank * arch.num_kv_heads // tp_size)
    return {"q": (rank * local.num_heads * d, local.num_heads * d), "kv": (kv_start * d, local.num_kv_heads * d),
            "inter": (rank * local.intermediate_size, local.intermediate_size),
            "shared": (rank * local.shared_expert_intermediate_size, local.shared_expert_intermediate_size)}


# gpt-oss's stacked expert tensors a rank cuts: (dim, channels an intermediate row takes there); down_proj_bias is
# every rank's (rank 0 adds it)
_STACKED_EXPERTS = {"gate_up_proj": (2, 2), "gate_up_proj_bias": (1, 2), "down_proj": (1, 1)}

# the Llama family's experts, one checkpoint tensor per expert projection (their layer stacks them; no linears):
# split as the dense MLP's, over each expert's intermediate rows
_EXPERT_SPLIT = {"gate_proj": "column", "up_proj": "column", "down_proj": "row"}


def fused_shard_rows(arch: ModelArch, rank: int, tp_size: int, name: str,
                     projections: Projections) -> Optional[list[tuple[int, int]]]:
    """The row ranges of a checkpoint's fused projection tensor ``name``
    (one tensor filling every part of a linear: Phi-3's q | k | v and
    gate | up; ``arch`` the full model's) whose rows, in order, are rank
    ``rank``'s of the linear; None for any other tensor."""
    fill = projections.find(name)
    if fill is None or fill.packed or len(fill.parts) < 2:
        return None
    d = arch.head_dim
    whole = {"q": arch.num_heads * d, "kv": arch.num_kv_heads * d, "inter": arch.intermediate_size}
    mine = _spans(arch, rank, tp_size)
    rows, offset = [], 0
    for part in fill.linear.parts:
        start, n = mine[part.span]
        rows.append((offset + start, offset + start + n))
        offset += whole[part.span]
    return rows


def tensor_shard(arch: ModelArch, rank: int, tp_size: int, name: str,
                 projections: Projections) -> Optional[tuple[int, int, int]]:
    """(dim, start, stop) of the checkpoint tensor ``name`` (full ``arch``)
    that rank ``rank`` of ``tp_size`` holds; None: every rank holds it whole
    (norms, a row-parallel bias). A projection is cut as its linear declares
    (``projections``: the model's); vocabulary rows may stop past the
    checkpoint's (padding)."""
    local = shard_arch(arch, tp_size)
    spans = _spans(arch, rank, tp_size)
    leaf = name.rsplit(".", 1)[-1]
    if name.startswith(("model.embed_tokens.", "lm_head.")):
        return 0, rank * local.vocab_size, (rank + 1) * local.vocab_size
    if name.endswith(".self_attn.sinks"):  # gpt-oss's: a sink per q head
        return 0, rank * local.num_heads, (rank + 1) * local.num_heads
    if ".mlp.experts." in name:  # every rank's slice of each expert's intermediate rows (no expert parallelism)
        start, n = rank * local.moe_intermediate_size, local.moe_intermediate_size
        stacked = _STACKED_EXPERTS.get(leaf)
        if stacked is not None:  # gpt-oss's, as the checkpoint stacks them (its gate and up channels interleaved)
            dim, pairs = stacked
            return dim, pairs * start, pairs * (start + n)
        split = _EXPERT_SPLIT.get(name.rsplit(".", 2)[-2])
        if split == "column":
            return 0, start, start + n
        return (1, start, start + n) if split == "row" and leaf == "weight" else None
    fill = projections.find(name)
    if fill is not None:
        if len(fill.parts) > 1:  # not one range: the unquantized reader takes fused_shard_rows
            raise ValueError(f"{name}: a fused projection's rows of one tensor-parallel rank are cut for "
                             f"unquantized weights only; serve this checkpoint with parallel.tensor_parallel_size=1")
        start, n = spans[fill.linear.parts[fill.parts[0]].span]
        if fill.linear.split == "column":
            return 0, start, start + n
        return (1, start, start + n) if leaf == "weight" else None
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    row = ARCHITECTURES.get(arch.architecture)
    if module in ("q_norm", "k_norm") and row is not None and row.qk_norm_over_all_heads:
        start, n = spans["q" if module == "q_norm" else "kv"]  # a norm weight per element of all heads: the rank's
        return 0, start, start + n
    return None


def shard_blocks(arch: ModelArch, rank: int, tp_size: int, blocks: dict[str, tuple],
                 projections: Projections) -> dict[str, tuple]:
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
        span = tensor_shard(arch, rank, tp_size, name, projections)
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
