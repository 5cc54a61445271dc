"""Expert-parallel load balancing (``parallel.eplb``).

Each sparse layer has ``num_physical = num_experts + num_redundant_experts``
expert slots, ``num_physical / ep`` on each expert-parallel rank (rank r
holds slots ``r x S .. (r + 1) x S - 1``). ``phys_to_log`` says which
logical expert each slot holds; an expert held by several slots (replicas)
takes its tokens in turn (row ``t`` of the exchanged rows goes to replica
``t mod replicas``, the same choice on every rank). Every forward records
the tokens each slot took; ``window_size`` forwards are kept.

Every ``step_interval`` forwards each rank computes the same new placement
from the window (the greedy policy vLLM took from DeepSeek):
``replicate`` gives each extra slot to the expert with the most load per
replica, then ``pack`` places the slots on the ranks, heaviest first, each
on the least loaded rank with room. The ranks then exchange their slots'
weights (an all-gather per layer) and each keeps its new slots' weights,
so the model computes the same function: only where each expert runs
changes. ``balancedness`` is the mean over the max of the ranks' loads in
the window (1: even).
"""

from __future__ import annotations

import time
from typing import Any

import torch


def replicate(load: torch.Tensor, num_physical: int) -> tuple[list[int], list[int]]:
    """(logical expert of each slot, replicas per logical expert): one slot
    per expert, then each extra slot to the expert whose load per replica
    is highest (ties to the lowest id)."""
    e = load.numel()
    slots, count = list(range(e)), [1] * e
    for _ in range(num_physical - e):
        per = [float(load[i]) / count[i] for i in range(e)]
        best = max(range(e), key=lambda i: (per[i], -i))
        slots.append(best)
        count[best] += 1
    return slots, count


def pack(slot_load: list[float], num_ranks: int) -> list[list[int]]:
    """The slots each rank gets, ``len(slot_load) / num_ranks`` apiece:
    heaviest first (ties to the lowest slot), each onto the least loaded
    rank that has room (ties to the lowest rank)."""
    per_rank = len(slot_load) // num_ranks
    order = sorted(range(len(slot_load)), key=lambda i: (-slot_load[i], i))
    packs: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0.0] * num_ranks
    for i in order:
        r = min((r for r in range(num_ranks) if len(packs[r]) < per_rank), key=lambda r: (loads[r], r))
        packs[r].append(i)
        loads[r] += slot_load[i]
    return packs


def rebalance(load: torch.Tensor, num_physical: int, num_ranks: int) -> list[int]:
    """The new logical expert of every physical slot (rank r's slots first
    for r = 0, 1, ...; within a rank by logical id) for per-expert ``load``."""
    slots, count = replicate(load, num_physical)
    slot_load = [float(load[e]) / count[e] for e in slots]
    placement: list[int] = []
    for members in pack(slot_load, num_ranks):
        placement += sorted(slots[i] for i in members)
    return placement


def initial_placement(num_experts: int, num_physical: int) -> list[int]:
    """Slot i holds expert i, and the redundant slots copies of experts 0, 1, ...: i mod num_experts."""
    return [i % num_experts for i in range(num_physical)]


def balancedness(slot_load: torch.Tensor, num_ranks: int) -> float:
    """Mean over max of the ranks' loads (1.0: even; 1.0 with no load yet)."""
    ranks = slot_load.reshape(num_ranks, -1).sum(dim=1).double()
    top = float(ranks.max())
    return float(ranks.mean()) / top if top > 0 else 1.0


class LayerPlacement:
    """One sparse layer's slots: the logical expert each holds and, per
    logical expert, its slots (``replica_slots`` [experts, max replicas],
    padded with -1) and how many (``replicas``)."""

    def __init__(self, phys_to_log: list[int], num_experts: int):
        self.phys_to_log = torch.tensor(phys_to_log, dtype=torch.int64)
        slots: list[list[int]] = [[] for _ in range(num_experts)]
        for p, e in enumerate(phys_to_log):
            slots[e].append(p)
        width = max(len(s) for s in slots)
        self.replica_slots = torch.tensor([s + [-1] * (width - len(s)) for s in slots], dtype=torch.int64)
        self.replicas = torch.tensor([len(s) for s in slots], dtype=torch.int64)

    def to_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [T, k] -> the slot each pair goes to: row t to replica t mod replicas."""
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
        choice = rows % self.replicas.to(ids.device)[ids]
        return self.replica_slots.to(ids.device)[ids, choice]


class Eplb:
    """The load balancer of one rank's sparse layers (``layers``: their
    ``SparseMoe`` modules, in model order); every rank of the expert group
    keeps the same records and takes the same decisions."""

    def __init__(self, layers: list[Any], num_experts: int, num_physical: int, ep_rank: int, ep_size: int,
                 comm: Any, window_size: int, step_interval: int, share: Any = None):
        self.layers, self.num_experts, self.num_physical = layers, num_experts, num_physical
        self.ep_rank, self.ep_size, self.comm = ep_rank, ep_size, comm
        # cores whose sparse layers route only their own rows (all-to-all dispatch): each forward's loads summed
        # over them, so every rank keeps the same records
        self.share = share
        self.window_size, self.step_interval = window_size, step_interval
        self.window = torch.zeros(window_size, len(layers), num_physical, dtype=torch.int64)
        self.steps = 0  # forwards recorded
        self.rebalances = 0
        self.rebalance_seconds = 0.0  # spent placing and moving, all rebalances
        self.slot_ratios: list[float] = []  # each rebalance's slot loads over their mean (reported once)
        self._last_window: tuple[float, list[int]] = (1.0, [0] * num_experts)  # figures before the last rebalance
        self._current = torch.zeros(len(layers), num_physical, dtype=torch.int64)
        self._total = torch.zeros(len(layers), num_physical, dtype=torch.int64)  # the window's sum, kept up to date
        placement = initial_placement(num_experts, num_physical)
        for i, layer in enumerate(layers):
            layer.attach_eplb(self, i, LayerPlacement(placement, num_experts))

    def record(self, index: int, slots: torch.Tensor) -> None:
        """Layer ``index`` sent its pairs to ``slots`` this forward."""
        self._current[index] += torch.bincount(slots.reshape(-1).cpu(), minlength=self.num_physical)

    def after_forward(self) -> None:
        """One forward done (every rank calls this at the same forwards): keep
        its loads; rebalance every ``step_interval`` forwards."""
        if self.share is not None:
            self.share.all_reduce(self._current)
        row = self.steps % self.window_size
        self._total += self._current - self.window[row]
        self.window[row] = self._current
        self._current.zero_()
        self.steps += 1
        if self.steps % self.step_interval == 0:
            self.rebalance()

    def slot_load(self) -> torch.Tensor:
        """Tokens each slot took over the window [layers, num_physical]."""
        return self._total

    def balancedness(self) -> float:
        """Over the window and every sparse layer (the ranks' summed loads)."""
        return balancedness(self.slot_load().sum(dim=0), self.ep_size)

    def expert_load(self) -> list[int]:
        """Tokens each logical expert took over the window, all sparse layers."""
        out = torch.zeros(self.num_experts, dtype=torch.int64)
        for i, layer in enumerate(self.layers):
            out.scatter_add_(0, layer.placement.phys_to_log, self.slot_load()[i])
        return out.tolist()

    def rebalance(self) -> None:
        """Place every layer's slots anew from the window's loads and move the
        weights; the window starts again (its loads were by the old slots)."""
        t0 = time.perf_counter()
        self._last_window = (self.balancedness(), self.expert_load())
        loads = self.slot_load()
        for i, layer in enumerate(self.layers):
            old = layer.placement
            logical = torch.zeros(self.num_experts, dtype=torch.int64).scatter_add_(0, old.phys_to_log, loads[i])
            mean = float(loads[i].double().mean())
            if mean > 0:
                self.slot_ratios += (loads[i].double() / mean).tolist()
            new = rebalance(logical, self.num_physical, self.ep_size)
            layer.move_experts(old, LayerPlacement(new, self.num_experts), self.comm)
        self.window.zero_()
        self._total.zero_()
        self.rebalances += 1
        self.rebalance_seconds += time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        """What the engine reports: balancedness, per-expert load, rebalances,
        and the slot load ratios of rebalances since the last call."""
        ratios, self.slot_ratios = self.slot_ratios, []
        fresh = bool(self._total.any())
        balanced, load = (self.balancedness(), self.expert_load()) if fresh else self._last_window
        return {"balancedness": balanced, "expert_load": load, "rebalances": self.rebalances,
                "rebalance_seconds": self.rebalance_seconds, "slot_load_ratios": ratios}
