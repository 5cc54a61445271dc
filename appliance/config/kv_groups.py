"""How a model's layers keep their KV: the KV-cache groups and the cache
tensors they share (vLLM's hybrid allocator, uniform page size).

Layers of one attention kind (full, a sliding window of W tokens, or
chunked local attention over chunks of C tokens: Llama 4's) fall into
groups of ``group_size`` layers; every group has its own block table per
request, all drawn from one block pool. The cache is ``group_size`` tensors
of ``num_blocks`` pages each, and tensor j holds layer j of every group: a
block handed to a group is page b of each tensor for that group's layers.
So a block costs ``group_size`` layers' KV whichever group holds it, a
model of one kind is one group of all its layers (one tensor per layer),
and a group that gives blocks back (a sliding window, finished chunks)
frees memory any group can use.

``group_size`` is the smallest kind's layer count (a larger kind splits
into several groups, its last padded), or the largest when the counts are
within 25% of each other (fewer groups, little padding), as vLLM chooses.
A window as long as ``max_model_len`` never slides, and a chunk as long
never ends: their layers count as full attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from appliance.config.schema import ApplianceConfig, ModelConfig

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
LAYER_TYPES = (FULL, SLIDING, CHUNKED)


@dataclass(frozen=True)
class KVGroup:
    sliding_window: Optional[int]  # None: no window
    layers: tuple[int, ...]  # the model's layer indices; layer layers[j] lives in cache tensor j
    attention_chunk: Optional[int] = None  # chunked local attention over chunks of this many tokens (None: none)

    @property
    def gives_back(self) -> bool:
        """Its blocks behind what the next token reads are given back (a window or chunks)."""
        return self.sliding_window is not None or self.attention_chunk is not None

    def describe(self) -> str:
        if self.attention_chunk is not None:
            return f"chunked local attention {self.attention_chunk}"
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
        ``chunk`` tokens beside it, and one block the window straddles;
        chunked local attention's: the current chunk's tokens before the
        step and the step's, from the chunk's first block)."""
        full = -(-num_tokens // block_size)
        return [min(full, -(-min(g.attention_chunk - 1 + chunk, num_tokens) // block_size))
                if g.attention_chunk is not None
                else full if g.sliding_window is None
                else min(full, -(-min(g.sliding_window - 1 + chunk, num_tokens) // block_size) + 1)
                for g in self.groups]


def layer_kinds(m: ModelConfig) -> list[str]:
    """Each layer's declared attention: ``model.layer_types`` where it is set,
    else every layer sliding when ``model.sliding_window`` is set, else full."""
    if m.layer_types is not None:
        return list(m.layer_types)
    return [SLIDING if m.sliding_window is not None else FULL] * m.num_layers


# a layer's attention as its KV-cache group keeps it: (sliding window, chunk), each None where it has none
LayerAttention = tuple[Optional[int], Optional[int]]


def layer_attention(m: ModelConfig, max_model_len: int) -> list[LayerAttention]:
    """Each layer's (sliding window, attention chunk); (None, None): full
    attention, as is a window or a chunk that ``max_model_len`` never
    outgrows."""
    window = m.sliding_window if m.sliding_window is not None and m.sliding_window < max_model_len else None
    chunk = m.attention_chunk_size if m.attention_chunk_size is not None and m.attention_chunk_size < max_model_len \
        else None
    return [(window, None) if kind == SLIDING else (None, chunk) if kind == CHUNKED else (None, None)
            for kind in layer_kinds(m)]


def _order(kind: LayerAttention) -> tuple[int, int]:
    """Full attention first (its hit bounds the others'), then windows, then chunks, each by size."""
    window, chunk = kind
    return (0, 0) if kind == (None, None) else (1, window) if window is not None else (2, chunk or 0)


def kv_layout(m: ModelConfig, max_model_len: int) -> KVLayout:
    kinds: dict[LayerAttention, list[int]] = {}
    for layer, kind in enumerate(layer_attention(m, max_model_len)):
        kinds.setdefault(kind, []).append(layer)
    if len(kinds) <= 1:  # one kind (none: a config validation refuses, which the plan may still read)
        (w, c), layers = next(iter(kinds.items()), ((None, None), []))
        return KVLayout((KVGroup(w, tuple(layers), c),), len(layers))
    sizes = [len(v) for v in kinds.values()]
    size = max(sizes) if max(sizes) < 1.25 * min(sizes) else min(sizes)
    groups = tuple(KVGroup(w, tuple(kinds[(w, c)][i : i + size]), c) for w, c in sorted(kinds, key=_order)
                   for i in range(0, len(kinds[(w, c)]), size))
    return KVLayout(groups, size)


def kv_group_problems(cfg: ApplianceConfig, max_model_len: int) -> list[str]:
    """What is not built beside KV-cache groups that give blocks back: the
    KV connectors move one group's blocks, all kept; the KV events describe
    one group's; a draft model keeps its KV at the first group's blocks,
    which must all be kept (full attention)."""
    layout = kv_layout(cfg.model, max_model_len)
    giving = [g for g in layout.groups if g.gives_back]
    if not giving:
        return []
    m = cfg.model
    why = (f"with sliding-window layers (model.sliding_window={m.sliding_window} < max_model_len={max_model_len}: "
           f"KV-cache groups that give blocks back)" if giving[0].sliding_window is not None else
           f"with chunked local attention layers (model.attention_chunk_size={m.attention_chunk_size} < "
           f"max_model_len={max_model_len}: KV-cache groups that give blocks back)")
    problems = []
    if cfg.kv_transfer.connector is not None:
        problems.append(f"kv_transfer.connector={cfg.kv_transfer.connector} {why} is not built yet")
    if cfg.kv_events.enabled and len(layout.groups) > 1:
        problems.append(f"kv_events.enabled=true with {len(layout.groups)} KV-cache groups is not built yet "
                        f"(the events describe one group's blocks)")
    if cfg.speculative.method == "draft_model" and layout.groups[0].gives_back:
        problems.append(f"speculative.method=draft_model {why} in every layer is not built yet (the draft keeps "
                        f"its KV at blocks of a full-attention group)")
    return problems
