"""Mixture-of-experts layers: Qwen3-MoE and Mixtral.

A sparse layer's router (``gate``, an fp32 linear over the hidden state)
scores every expert; each token goes to the ``num_experts_per_tok`` experts
of highest softmax probability (``torch.topk`` on the probabilities, as
Hugging Face's models pick, ties included), weighted by those
probabilities, renormalized over the chosen ones where the model says so.
An expert is a SiLU-gated MLP; a layer's experts are stored stacked
(``FusedExperts``: ``w13`` = gate | up rows per expert, ``w2`` = down), and
run grouped: the (token, expert) pairs sorted by expert, one GEMM pair per
active expert over its contiguous rows, the weighted rows added back to
their tokens in expert order.

With tensor parallelism (no expert parallelism) every rank holds every
expert's slice of the intermediate dimension, as vLLM splits them; with
expert parallelism (``ExpertParallel``) each rank holds whole experts, a
contiguous run of expert slots (which expert a slot holds may change under
load balancing, ``models/eplb.py``). Either way each rank's sum is partial
and the ranks' sums are all-reduced; ranks that hold different tokens
(data-parallel engine cores) first gather each other's rows
(``SparseMoe.exchange``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional, cast

import torch
from torch import nn
import torch.nn.functional as F

from appliance.kernels import flashinfer_moe
from appliance.models.layers.mlp import MLP


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's experts under expert parallelism: rank ``rank`` of
    ``size`` holds expert slots ``expert_range(slots, rank, size)``, each a
    whole expert.
    ``replicated``: every rank holds the same tokens (the tensor-parallel
    ranks of one engine core), so ``comm.all_reduce`` of the partial sums is
    the whole exchange; else the ranks of each data-parallel engine core
    (cores in lock-step) have that core's tokens and a sparse layer
    exchanges them over ``comm`` (this rank's peers, one per core): by
    all-to-all where it has one, else by gathering every core's rows and
    all-reducing the partial sums over the whole group
    (``SparseMoe.exchange``). ``tp``:
    the core's tensor-parallel ranks, when it has more than one (rank =
    core x tp size + tp rank)."""

    rank: int
    size: int
    comm: Any
    replicated: bool = True
    tp: Any = None

    @property
    def core(self) -> int:
        """Which engine core's rows are this rank's (across cores)."""
        return self.rank // (self.tp.world_size if self.tp is not None else 1)

    @property
    def dispatches(self) -> bool:
        """Whether a sparse layer sends each core's (token, expert) pairs to
        the ranks holding the experts and back by all-to-all
        (``SparseMoe.dispatch``: torch.distributed, gloo or NCCL), rather
        than gathering every core's rows (shared memory)."""
        return not self.replicated and getattr(self.comm, "has_all_to_all", False)

    @functools.cached_property
    def group(self) -> Any:
        """Collectives over every rank of the group, in rank order."""
        return self.comm if self.tp is None else CoresOfRanks(self.comm, self.tp)


class CoresOfRanks:
    """The collectives of engine cores' ranks as one group (rank = core x
    ranks per core + rank in the core) from ``cores`` (this rank's peers, one
    per core) and ``ranks`` (its core's ranks); the sums are the same bits on
    every rank (each comm sums in its rank order)."""

    def __init__(self, cores: Any, ranks: Any):
        self.cores, self.ranks = cores, ranks
        self.world_size = cores.world_size * ranks.world_size

    def all_reduce(self, t: torch.Tensor) -> None:
        self.cores.all_reduce(t)
        self.ranks.all_reduce(t)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        core = torch.stack(self.ranks.all_gather(t))
        return [x for c in self.cores.all_gather(core) for x in c.unbind(0)]


def expert_range(slots: int, rank: int, size: int) -> tuple[int, int]:
    """The slots [start, end) rank ``rank`` of ``size`` holds (an even split; validation checks it divides)."""
    per = slots // size
    return rank * per, (rank + 1) * per


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int64 [T, k]) of each token's top-k
    experts by softmax probability (``torch.topk``, so ties fall as in
    Hugging Face's models), renormalized to sum to one with ``renormalize``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_route(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (GLM-4.5's), as transformers computes it: sigmoid scores; each token's experts
    chosen by score plus the checkpoint's correction ``bias``, within the ``topk_group`` groups (of ``n_group``)
    whose two best corrected scores sum highest; weighted by their uncorrected scores (renormalized with
    ``renormalize``) times ``scale``. (weights fp32 [T, k], expert ids int64 [T, k])."""
    scores = router_logits.float().sigmoid()
    choice = scores + bias.float()
    t, experts = choice.shape
    group_scores = choice.view(t, n_group, experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
    choice = choice.masked_fill(~keep.repeat_interleave(experts // n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def dispatch_order(ids: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (token, slot) pairs routed to experts ``first .. first + count - 1``,
    sorted by expert (a stable sort, so each expert's tokens stay in order):
    (token index per pair, flat [T * k] position per pair, pairs per local
    expert)."""
    flat = ids.reshape(-1)
    local = flat - first
    mine = (local >= 0) & (local < count)
    positions = torch.nonzero(mine).squeeze(1)
    order = torch.argsort(local[positions], stable=True)
    positions = positions[order]
    counts = torch.bincount(local[positions], minlength=count).tolist()
    return positions // ids.shape[1], positions, counts


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first: int, count: int,
                    expert: Callable[[int, torch.Tensor], torch.Tensor], weigh_input: bool = False) -> torch.Tensor:
    """Sum over each token's routed experts ``first .. first + count - 1`` of weight x ``expert(e, its rows)``
    (``e`` local), or of ``expert(e, weight x its rows)`` (``weigh_input``: Llama 4's), one call per active
    expert on the rows routed to it (``dispatch_order``)."""
    out = torch.zeros_like(x)
    tokens, positions, counts = dispatch_order(ids, first, count)
    pair_weights = weights.reshape(-1)[positions]
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows, w = tokens[start:start + n], pair_weights[start:start + n, None].to(x.dtype)
            out.index_add_(0, rows, expert(e, x[rows] * w) if weigh_input else expert(e, x[rows]) * w)
        start += n
    return out


def install_checkpoint_experts(sparse: list[tuple[int, SparseMoe]], parts: dict[str, Any], method: str,
                               build: Callable[[list[str]], nn.Module]) -> set[str]:
    """Each sparse layer's experts (``sparse``: the model's ``sparse_mlps``) from a checkpoint's per-expert tensors
    (``parts`` by checkpoint weight name, ``...mlp.experts.E.gate_proj.
    weight``): ``build(names)`` makes one linear of the named projections
    stacked in row order, gate|up and then down for each local expert; the
    experts ``quantized`` as ``method``. Returns the module weights filled."""
    filled = set()
    for i, mlp in sparse:
        experts, pre = mlp.experts, f"model.layers.{i}.mlp.experts."
        linears = []
        for e in experts.slot_experts:
            names = [f"{pre}{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
            missing = [n for n in names if n not in parts]
            if missing:
                raise ValueError(f"{missing[0]}: the checkpoint has no {method} tensors for this expert's projection")
            linears.append((build(names[:2]), build(names[2:])))
        experts.install(method, linears)
        filled |= {f"{pre}w13", f"{pre}w2"}
    return filled


class FusedExperts(nn.Module):
    """Expert slots ``first .. first + num_local - 1`` of a sparse layer
    (slot ``first + s`` holds logical expert ``slot_experts[s]``: its own id,
    a redundant slot id mod num_experts, until load balancing places experts
    anew, ``models/eplb.py``), stacked: ``w13`` [slots, 2 x inter, hidden]
    (gate rows, then up rows) and ``w2`` [slots, hidden, inter]; routed ids
    are slot ids. ``quantize`` turns them into int8
    (a scale per output channel) or int4 (groups) weight-only, as the
    dense projections are; the torch path then dequantizes an expert's
    weights when a step routes tokens to it. ``num_slots``: every rank's
    slots (default: up to this rank's last). Where FlashInfer's fused MoE
    runs them (``appliance/kernels/flashinfer_moe.py``), ``w13`` holds up rows first
    from their first forward on (``up_first``)."""

    def __init__(self, num_local: int, hidden: int, inter: int, first: int = 0,
                 slot_experts: Optional[list[int]] = None, num_slots: Optional[int] = None):
        super().__init__()
        self.num_local, self.hidden, self.inter, self.first = num_local, hidden, inter, first
        self.num_slots = first + num_local if num_slots is None else num_slots
        self.up_first = False  # w13's halves swapped for FlashInfer's kernel
        self.slot_experts = list(range(first, first + num_local)) if slot_experts is None else list(slot_experts)
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, inter), requires_grad=False)
        self.quantized: Optional[str] = None  # None, or the method: int8_wo, w8a8_int8, int4_wo, fp8, gguf, awq, gptq
        self._q: list[tuple[nn.Module, nn.Module]] = []  # per expert (w13, w2) as quantized linears

    def quantize(self, method: str, make: Any) -> None:
        """Every expert's w13 and w2 as ``make(weight)``, the weight-only
        linears of ``method`` (``models/quant.py``); the float weights are
        freed."""
        self.install(method, [(make(self.w13.data[e]), make(self.w2.data[e])) for e in range(self.num_local)])

    def install(self, method: str, linears: list[tuple[nn.Module, nn.Module]]) -> None:
        """Every local expert's (gate|up, down) as the given linears of
        ``method`` (a GGUF file's blocks, or ``quantize``'s); the float
        weights are freed."""
        if len(linears) != self.num_local:
            raise ValueError(f"{len(linears)} experts' linears for {self.num_local} local experts")
        self._q = list(linears)
        self._experts_q = nn.ModuleList(nn.ModuleList(pair) for pair in self._q)  # so .to() moves them
        self.quantized = method
        self.release_float()

    def release_float(self) -> None:
        """Free the stacked float weights (the native forward holds packed copies)."""
        self.w13 = nn.Parameter(torch.empty(0, dtype=self.w13.dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, dtype=self.w2.dtype), requires_grad=False)

    def projections(self, e: int) -> tuple[Any, Any]:
        """Local expert ``e``'s (gate|up, down) as linear-like objects the
        native backend packs: the quantized linears, or views of the stacked
        float weights."""
        if self._q:
            return self._q[e]
        views = []
        for w in (self.w13.data[e], self.w2.data[e]):
            views.append(SimpleNamespace(weight=SimpleNamespace(data=w), bias=None, out_features=w.shape[0],
                                         in_features=w.shape[1]))
        return views[0], views[1]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` on rows ``x``: down(silu(gate x) * up x)."""
        if self._q:
            gu = self._q[e][0](x)
        else:
            gu = F.linear(x, self.w13[e])
        gate, up = gu.split(self.inter, dim=-1)
        if self.up_first:
            gate, up = up, gate
        h = F.silu(gate) * up
        return self._q[e][1](h) if self._q else F.linear(h, self.w2[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over each token's routed experts held here of weight x
        expert(token), grouped by expert: on GPUs by FlashInfer's fused MoE
        where it runs, else by the Triton fused kernel
        (``appliance/kernels/triton_moe.py``); elsewhere one torch GEMM pair per
        active expert."""
        if not self._q and flashinfer_moe.usable(x):
            if not self.up_first:  # once: the kernel's layout
                self.w13.data = flashinfer_moe.up_first(self.w13.data)
                self.up_first = True
            return flashinfer_moe.fused_experts(x, self.w13, self.w2, weights, ids, self.first, self.num_slots)
        if x.device.type != "cpu" and not self._q:
            from appliance.kernels.triton_moe import fused_experts

            return fused_experts(x, self.w13, self.w2, weights, ids, self.first)
        return grouped_experts(x, weights, ids, self.first, self.num_local, self.expert)

    def forward_per_token(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same sum one token and expert at a time (the naive loop a
        benchmark compares the grouped execution with)."""
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j]) - self.first
                if 0 <= e < self.num_local:
                    out[t] += self.expert(e, x[t:t + 1])[0] * weights[t, j].to(x.dtype)
        return out


class SparseMoe(nn.Module):
    """A sparse layer's MLP: the fp32 router (its softmax, or DeepSeek-V3's
    routing: ``grouped_route``, the checkpoint's ``gate.e_score_correction_bias``),
    then this rank's experts; ``comm`` (tensor or expert parallelism)
    all-reduces the partial sums. Shared experts where the model has them
    (``shared_experts``, a tensor-parallel MLP every token goes through, its
    output gated per token where the model gates it: Qwen2-MoE's) are added
    to the routed ones' sum."""

    def __init__(self, arch: Any, comm: Any = None, ep: Optional[ExpertParallel] = None, tp: Any = None):
        super().__init__()
        self.ep = ep
        self.top_k, self.renormalize = arch.num_experts_per_tok, arch.norm_topk_prob
        self.num_experts = arch.num_experts
        self.grouped = arch.scoring_func == "sigmoid"
        self.n_group, self.topk_group, self.scale = arch.n_group, arch.topk_group, arch.routed_scaling_factor
        slots = arch.num_physical_experts or arch.num_experts  # redundant slots for load balancing
        first, end = (0, slots) if ep is None else expert_range(slots, ep.rank, ep.size)
        self.gate = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)
        if self.grouped:
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(arch.num_experts), requires_grad=False)
        self.shared_experts = MLP(arch, tp, span="shared") if arch.shared_expert_intermediate_size else None
        # Qwen2-MoE's: the shared expert's output gated per token (every rank the whole gate)
        self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False) if arch.shared_expert_gate else None
        self.experts = FusedExperts(end - first, arch.hidden_size, arch.moe_intermediate_size, first,
                                    [p % arch.num_experts for p in range(first, end)],  # eplb.initial_placement
                                    num_slots=slots)
        self.comm = comm
        self.per_token = False  # the naive loop instead of grouped execution (benchmarks)
        self.eplb: Any = None  # the load balancer (models/eplb.py), with its placement of this layer's slots
        self.eplb_index = 0
        self.placement: Any = None

    def attach_eplb(self, eplb: Any, index: int, placement: Any) -> None:
        if placement.phys_to_log[self.experts.first:self.experts.first + self.experts.num_local].tolist() \
                != self.experts.slot_experts:
            raise ValueError("the load balancer's placement differs from the slots this layer loaded")
        self.eplb, self.eplb_index, self.placement = eplb, index, placement

    def move_experts(self, old: Any, new: Any, comm: Any) -> None:
        """Take up placement ``new``: every rank's slots gathered (in rank
        order, so physical order), each of this rank's new slots copied from
        a slot that held its expert."""
        ex = self.experts
        mine = new.phys_to_log[ex.first:ex.first + ex.num_local].tolist()
        source = old.replica_slots[mine, 0]

        def moved(local: torch.Tensor) -> torch.Tensor:  # [num_local, ...]: this rank's new slots' copies
            raw = local.contiguous()
            if raw.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # gathered as bytes (gloo has no fp8)
                return torch.cat(comm.all_gather(raw.view(torch.uint8)))[source].view(raw.dtype).clone()
            return torch.cat(comm.all_gather(raw))[source].clone()

        if ex.quantized is None:
            ex.w13.data = moved(ex.w13.data)
            ex.w2.data = moved(ex.w2.data)
        else:  # each projection's buffers (int8 or int4 weights, scales, mins), stacked over the slots
            for p in range(2):
                modules = [pair[p] for pair in ex._q]
                for name, _ in modules[0].named_buffers():
                    for m, t in zip(modules, moved(torch.stack([getattr(m, name) for m in modules])).unbind(0)):
                        setattr(m, name, t)
        ex.slot_experts = mine
        self.placement = new

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.gate.weight.float())

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) [T, top_k] of each token (``route``, or ``grouped_route``)."""
        if self.grouped:
            bias = cast(torch.Tensor, self.gate.e_score_correction_bias)
            return grouped_route(router_logits, bias, self.top_k, self.n_group, self.topk_group, self.renormalize,
                                 self.scale)
        return route(router_logits, self.top_k, self.renormalize)

    def _slots(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, slot ids) [T, top_k] of rows ``x``: routed, and with load
        balancing each pair sent to a slot of its expert, the slots' loads
        recorded."""
        weights, ids = self.route(self.router_logits(x))
        if self.placement is not None:
            ids = self.placement.to_slots(ids)
            self.eplb.record(self.eplb_index, ids)
        return weights, ids

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the layer for rows ``x``: route, then its experts."""
        run = self.experts.forward_per_token if self.per_token else self.experts
        return run(x, *self._slots(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep is not None and not self.ep.replicated:
            out = self.exchange(x)
        else:
            out = self._experts(x)
            if self.comm is not None:
                self.comm.all_reduce(out)
        if self.shared_experts is None:
            return out
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Expert parallelism over cores with their own tokens (``x`` of no
        rows: an idle core, which takes part all the same so the ranks'
        collectives line up): ``dispatch`` where the comm has all-to-all,
        else ``gather``."""
        return self.dispatch(x) if self._parallel().dispatches else self.gather(x)

    def _parallel(self) -> ExpertParallel:
        assert self.ep is not None, "an exchange runs under expert parallelism across cores"
        return self.ep

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """Each (token, expert) pair of this core's rows sent to the rank
        holding its slot, run there, and its output sent back (all-to-all,
        rows in rank order); the weighted outputs added to their tokens. With
        tensor-parallel ranks in the cores (every one holding the core's
        rows), rank t carries the pairs of the ranks of its tensor-parallel
        index, and the core's ranks sum their parts."""
        ep, ex = self._parallel(), self.experts
        tp_size = ep.tp.world_size if ep.tp is not None else 1
        weights, ids = self._slots(x)
        slots, k = ids.reshape(-1), ids.shape[1]
        owner = slots // ex.num_local  # the rank of the group holding each pair's slot
        pairs = torch.nonzero(torch.eq(owner % tp_size, ep.rank % tp_size)).squeeze(1)
        pairs = pairs[torch.argsort(owner[pairs] // tp_size, stable=True)]  # by the core they go to
        send = torch.bincount(owner[pairs] // tp_size, minlength=ep.comm.world_size).tolist()
        rows, recv = ep.comm.all_to_all(x[pairs // k], send)
        got_slots, _ = ep.comm.all_to_all(slots[pairs].unsqueeze(1), send, recv)
        done = ex(rows, torch.ones(rows.shape[0], 1, dtype=torch.float32, device=x.device), got_slots)
        back, _ = ep.comm.all_to_all(done, recv, send)
        out = torch.zeros_like(x)
        out.index_add_(0, pairs // k, back * weights.reshape(-1)[pairs, None].to(x.dtype))
        if ep.tp is not None:
            ep.tp.all_reduce(out)
        return out

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every core's rows gathered (padded to the longest), this rank's
        experts run on all of them, the partial sums all-reduced over every
        rank (in rank order, the same bits on every rank); this core's rows
        returned."""
        ep = self._parallel()
        comm = ep.comm
        counts = [int(c) for c in comm.all_gather(torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device))]
        most = max(counts)
        if most == 0:
            return x
        padded = x.new_zeros(most, x.shape[1])
        padded[:x.shape[0]] = x
        gathered = comm.all_gather(padded)
        rows = torch.cat([g[:n] for g, n in zip(gathered, counts)])
        partial = self._experts(rows)
        out = x.new_zeros(len(counts) * most, x.shape[1])
        start = 0
        for r, n in enumerate(counts):
            out[r * most:r * most + n] = partial[start:start + n]
            start += n
        ep.group.all_reduce(out)
        me = ep.core
        return out[me * most:me * most + x.shape[0]]
