"""How a model's layers keep their KV: the KV-cache groups and the cache
tensors they share (vLLM's hybrid allocator, uniform page size).

Layers of one attention kind (full, or a sliding window of W tokens) fall
into groups of ``group_size`` layers; every group has its own block table
per request, all drawn from one block pool. The cache is ``group_size``
tensors of ``num_blocks`` pages each, and tensor j holds layer j of every
group: a block handed to a group is page b of each tensor for that group's
layers. So a block costs ``group_size`` layers' KV whichever group holds it,
a model of one kind is one group of all its layers (one tensor per layer),
and a group that gives blocks back (a sliding window) frees memory any
group can use.

``group_size`` is the smallest kind's layer count (a larger kind splits
into several groups, its last padded), or the largest when the counts are
within 25% of each other (fewer groups, little padding), as vLLM chooses.
A window as long as ``max_model_len`` never slides: its layers count as
full attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from appliance.config.schema import ApplianceConfig, ModelConfig

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


@dataclass(frozen=True)
class KVGroup:
    sliding_window: Optional[int]  # None: full attention
    layers: tuple[int, ...]  # the model's layer indices; layer layers[j] lives in cache tensor j

    def describe(self) -> str:
        return "full attention" if self.sliding_window is None else f"sliding window {self.sliding_window}"


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    group_size: int  # cache tensors: each holds one layer of every group

    def placement(self) -> dict[int, tuple[int, int]]:
        """Each layer's (group, cache tensor)."""
        return {layer: (g, j) for g, group in enumerate(self.groups) for j, layer in enumerate(group.layers)}

    def tensors_of(self, layers: range) -> int:
        """Cache tensors that ``layers`` (a pipeline stage's) use."""
        where = self.placement()
        return len({where[i][1] for i in layers})

    def blocks_per_request(self, num_tokens: int, block_size: int, chunk: int) -> list[int]:
        """Blocks each group holds for a request of ``num_tokens`` at most
        (a sliding window's: the window, the step's chunk of at most
        ``chunk`` tokens beside it, and one block the window straddles)."""
        full = -(-num_tokens // block_size)
        return [full if g.sliding_window is None
                else min(full, -(-min(g.sliding_window - 1 + chunk, num_tokens) // block_size) + 1)
                for g in self.groups]


def layer_kinds(m: ModelConfig) -> list[str]:
    """Each layer's declared attention: ``model.layer_types`` where it is set,
    else every layer sliding when ``model.sliding_window`` is set, else full."""
    if m.layer_types is not None:
        return list(m.layer_types)
    return [SLIDING if m.sliding_window is not None else FULL] * m.num_layers


def layer_windows(m: ModelConfig, max_model_len: int) -> list[Optional[int]]:
    """Each layer's attention window (None: full attention, as is a window
    that ``max_model_len`` never outgrows)."""
    window = m.sliding_window if m.sliding_window is not None and m.sliding_window < max_model_len else None
    return [window if kind == SLIDING else None for kind in layer_kinds(m)]


def kv_layout(m: ModelConfig, max_model_len: int) -> KVLayout:
    windows = layer_windows(m, max_model_len)
    kinds: dict[Optional[int], list[int]] = {}
    for layer, w in enumerate(windows):
        kinds.setdefault(w, []).append(layer)
    if len(kinds) <= 1:  # one kind (none: a config validation refuses, which the plan may still read)
        w, layers = next(iter(kinds.items()), (None, []))
        return KVLayout((KVGroup(w, tuple(layers)),), len(layers))
    sizes = [len(v) for v in kinds.values()]
    size = max(sizes) if max(sizes) < 1.25 * min(sizes) else min(sizes)
    order = sorted(kinds, key=lambda w: -1 if w is None else w)  # full attention first: its hit bounds the others
    groups = tuple(KVGroup(w, tuple(kinds[w][i : i + size])) for w in order for i in range(0, len(kinds[w]), size))
    return KVLayout(groups, size)


def kv_group_problems(cfg: ApplianceConfig, max_model_len: int) -> list[str]:
    """What is not built beside KV-cache groups: the KV connectors move one
    group's blocks, all kept; the KV events describe one group's; a draft
    model keeps its KV at the first group's blocks, which must all be kept
    (full attention)."""
    layout = kv_layout(cfg.model, max_model_len)
    slides = [g for g in layout.groups if g.sliding_window is not None]
    if not slides:
        return []
    why = (f"with sliding-window layers (model.sliding_window={cfg.model.sliding_window} < "
           f"max_model_len={max_model_len}: KV-cache groups that give blocks back)")
    problems = []
    if cfg.kv_transfer.connector is not None:
        problems.append(f"kv_transfer.connector={cfg.kv_transfer.connector} {why} is not built yet")
    if cfg.kv_events.enabled and len(layout.groups) > 1:
        problems.append(f"kv_events.enabled=true with {len(layout.groups)} KV-cache groups is not built yet "
                        f"(the events describe one group's blocks)")
    if cfg.speculative.method == "draft_model" and layout.groups[0].sliding_window is not None:
        problems.append(f"speculative.method=draft_model {why} in every layer is not built yet (the draft keeps "
                        f"its KV at blocks of a full-attention group)")
    return problems
