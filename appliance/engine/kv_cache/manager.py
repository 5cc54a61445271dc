"""KV cache manager: the coordinator of a model's KV-cache groups over one
BlockPool (torch-free).

A model whose layers all attend the same way has one group; one with
sliding-window layers beside full-attention ones (Gemma, gpt-oss, Qwen2's
``use_sliding_window``), or chunked local attention beside them (Llama 4),
has a group per kind, each with its own block table
per request (``single_type``), every group's blocks drawn from the one pool.
The scheduler sees one request-level interface: how many tokens every
group can serve from the prefix cache, whether a step's slots fit in all
groups, and the block ids per group (``get_block_ids``: a tuple, one list a
group, in group order).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from appliance.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from appliance.engine.kv_cache.hashing import get_hash_fn, update_block_hashes
from appliance.engine.kv_cache.single_type import (FULL_ATTENTION, KVCacheGroupSpec, SingleTypeManager, cdiv,
                                                   single_type_manager)
from appliance.engine.request import Request

# A request's blocks of one step or hit, one list per KV-cache group.
GroupBlocks = tuple[list[KVCacheBlock], ...]

__all__ = ["KVCacheManager", "KVCacheGroupSpec", "GroupBlocks", "PrefixCacheStats", "cdiv"]


@dataclass
class PrefixCacheStats:
    """Token-granular, like vLLM's prefix_cache_queries / prefix_cache_hits."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        enable_events: bool = False,
        groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,),
    ):
        if not groups:
            raise ValueError("a KV cache needs at least one group")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_fn(hash_algo)
        self.pool = BlockPool(num_blocks, block_size, enable_caching, enable_events, len(groups))
        self.groups: list[SingleTypeManager] = [single_type_manager(self.pool, block_size, g, spec)
                                                for g, spec in enumerate(groups)]
        self.giving_back = [g for g in self.groups if g.spec.gives_back]  # a window's or chunks' groups
        self.stats = PrefixCacheStats()
        self._copies: list[tuple[int, int]] = []  # (src, dst) block KV the worker copies before the next step

    # ----------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""
        return self.pool.num_blocks

    def empty(self) -> GroupBlocks:
        """No blocks in any group (no prefix hit)."""
        return tuple([] for _ in self.groups)

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Longest cached prefix of ``request`` that every group can serve,
        as (blocks per group, num_tokens).

        Capped at num_tokens - 1: the last token is always recomputed so the
        step produces its logits. None for a request that asks for prompt
        logprobs: every prompt position must run to score the next token.
        Each group is asked for a hit no longer than the shortest so far
        until all agree (a sliding window's hit at a shorter length needs
        other blocks than at the longer one).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.empty(), 0
        hashes = update_block_hashes(request, self.block_size, self.hash_fn)
        tokens = request.all_token_ids
        num_hit_blocks = min((request.num_tokens - 1) // self.block_size, len(hashes))
        while True:
            hits = tuple([g.find_cache_hit(hashes, tokens, num_hit_blocks) for g in self.groups])
            lengths = [len(h) for h in hits]
            shortest = min(lengths)
            if lengths.count(shortest) == len(lengths):
                break
            num_hit_blocks = shortest
        num_hit_tokens = shortest * self.block_size
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    # ----------------------------------------------------------------------
    #  Block layout of a request when allocate_slots is called (each group):
    #
    #  |<-------- computed -------->|<- new computed ->|<-- new -->|<- lookahead ->|
    #  | request.num_computed_tokens| cache hits (this | tokens to | draft tokens  |
    #  |  (blocks already held)     | step's prefix)   | compute   | (spec decode) |
    #
    #  Blocks are appended to the request's table (append-only; a sliding
    #  window's group first gives back the blocks wholly behind its window,
    #  a chunked group those of finished chunks, their entries becoming the
    #  null block); full blocks whose KV this
    #  step computes are registered in the prefix cache at once: a later
    #  request in the same step may hit them, because every layer writes
    #  the whole step's K/V before it attends.
    def _new_block_counts(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int,
                          hits: Optional[GroupBlocks], num_lookahead_tokens: int) -> Optional[list[int]]:
        """Blocks the pool must hand out to each group for the step, beyond
        those held and hit; None when the pool cannot fit them. The one
        place the block arithmetic lives. Blocks behind a sliding window or
        of a finished chunk are given back first (no later token reads them, whatever is decided)."""
        rid = request.request_id
        for g in self.giving_back:
            g.remove_skipped_blocks(rid, request.num_computed_tokens)
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens + num_lookahead_tokens
        if hits is None:
            counts = [g.num_new_blocks(rid, total, 0) for g in self.groups]
            return counts if sum(counts) <= self.pool.num_free_blocks else None
        counts = [g.num_new_blocks(rid, total, len(h)) for g, h in zip(self.groups, hits)]
        # Hit blocks that sit in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for h in hits for b in h if b.ref_cnt == 0 and not b.is_null)
        return counts if sum(counts) <= self.pool.num_free_blocks - num_evictable_hits else None

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[GroupBlocks] = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed
        (the scheduler asks it to decide how much to preempt)."""
        return self._new_block_counts(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks or None,
                                      num_lookahead_tokens) is not None

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[GroupBlocks] = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> Optional[GroupBlocks]:
        """New blocks for the step per group, or None when the pool cannot fit them.
        ``delay_cache_blocks``: the new full blocks enter the prefix cache
        later, with the allocation that runs past them (a KV connector fills
        them in the background; nobody may hit them before)."""
        if num_new_tokens <= 0 and num_lookahead_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        hits = new_computed_blocks or None
        counts = self._new_block_counts(request, num_new_tokens, num_new_computed_tokens, hits, num_lookahead_tokens)
        if counts is None:
            return None
        rid = request.request_id
        if hits is not None:
            for g, h in zip(self.groups, hits):
                g.take_hits(rid, h)
        new = tuple([g.take_new(rid, n) for g, n in zip(self.groups, counts)])
        if self.enable_caching and not delay_cache_blocks:
            num_computed = request.num_computed_tokens + num_new_computed_tokens
            self._cache_full_blocks(request, (num_computed + num_new_tokens) // self.block_size)
        return new

    def _cache_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        rid = request.request_id
        if all(num_full_blocks <= g.num_cached_block.get(rid, 0) for g in self.groups):
            return  # nothing newly full (most decode steps): no hashing
        hashes = update_block_hashes(request, self.block_size, self.hash_fn)
        for g in self.groups:
            g.cache_full_blocks(rid, hashes, request.all_token_ids, num_full_blocks)

    def free(self, request: Request) -> None:
        """Release a request's blocks in every group, last block first into the queue."""
        for g in reversed(self.groups):
            g.free(request.request_id)

    # ----------------------------------------------------------------------
    #  Forks (beam search): a child continues a parent's sequence from its
    #  KV. The child's table is the parent's, a reference taken on each
    #  block; the block its next token writes, if the parent's last and
    #  partly filled, is copied to a block of the child's own (copy on
    #  write), so the siblings' next tokens never write one another's.
    #
    #      parent:  [b0 full][b1 full][b2 partial]
    #      child:   [b0     ][b1     ][b2' = copy of b2]   (b0, b1 shared)
    #
    #  The copies wait in ``take_copies`` for the next step the worker runs,
    #  before any layer writes. The last child may instead take the
    #  parent's table as it stands (``move``): no copy. Blocks past the
    #  computed tokens (a draft model's lookahead slots) are not passed on.
    def fork(self, parent_id: str, child_id: str, num_computed_tokens: int) -> bool:
        """Give ``child_id`` the table of ``parent_id`` (held, not finished) up to
        its ``num_computed_tokens``; False (nothing taken) when the pool has
        no block for the copy."""
        keep = cdiv(num_computed_tokens, self.block_size)
        partial = num_computed_tokens % self.block_size != 0
        if partial and len(self.groups) > self.pool.num_free_blocks:
            return False
        for g in self.groups:
            g.fork(parent_id, child_id, keep)
            if partial:
                self._copies.append(g.make_private(child_id, keep - 1))
        return True

    def move(self, parent_id: str, child_id: str, num_computed_tokens: int) -> None:
        """Hand ``parent_id``'s table to ``child_id`` as it stands, up to its ``num_computed_tokens``."""
        for g in self.groups:
            g.move(parent_id, child_id, cdiv(num_computed_tokens, self.block_size))

    def hold(self, request_id: str, holder_id: str) -> None:
        """A reference on each of a request's blocks under ``holder_id`` (freed
        with ``free_held``): its KV outlives the request."""
        for g in self.groups:
            g.fork(request_id, holder_id, len(g.req_to_blocks.get(request_id, ())))

    def free_held(self, holder_id: str) -> None:
        for g in reversed(self.groups):
            g.free(holder_id)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies forks made since the last call."""
        copies, self._copies = self._copies, []
        return copies

    def uncache_blocks(self, request_id: str, first_block: int) -> None:
        """Forget the prefix-cache entries of a request's blocks from
        ``first_block`` on: after a failed step their KV may never have been
        written, and no later request may hit it."""
        for g in self.groups:
            g.uncache(request_id, first_block)

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset_prefix_cache()
        if ok:
            self.stats.resets += 1
        return ok

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """A request's block ids, one list per group."""
        return tuple(g.block_ids(request_id) for g in self.groups)

    def most_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks of the pool a request of ``num_tokens`` holds over
        every group, computing at most ``chunk`` tokens a step."""
        return sum(g.most_blocks(num_tokens, chunk) for g in self.groups)

    def connector_block_ids(self, request_id: str) -> list[int]:
        """A request's block ids as the KV connectors move them: a cache of
        one group only (validation refuses connectors with more, or with a
        sliding window that gives blocks back)."""
        if len(self.groups) != 1:
            raise RuntimeError(f"KV connectors move a one-group cache; this one has {len(self.groups)} groups")
        return self.groups[0].block_ids(request_id)

    def holds(self, request_id: str) -> bool:
        return any(request_id in g.req_to_blocks for g in self.groups)

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    # ----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert every invariant of pool and tables; raises AssertionError."""
        pool = self.pool
        holders: Counter[int] = Counter()
        for g in self.groups:
            for rid, blocks in g.req_to_blocks.items():
                ids = [b.block_id for b in blocks if not b.is_null]
                assert len(ids) == len(set(ids)), f"{rid} holds a block twice in group {g.group}: {ids}"
                if not g.spec.gives_back:
                    assert len(ids) == len(blocks), f"{rid} holds the null block in full-attention group {g.group}"
                else:  # given-back blocks are a leading run of nulls
                    nulls = len(blocks) - len(ids)
                    assert all(b.is_null for b in blocks[:nulls]), f"{rid}: a null block after a live one"
                holders.update(ids)
        prev = pool.free_block_queue.head
        for b in pool.free_block_queue:
            assert b.prev_free is prev, "free queue back pointer broken"
            prev = b
        assert pool.free_block_queue.tail.prev_free is prev, "free queue tail broken"
        assert [b.block_id for b in pool.blocks] == list(range(len(pool.blocks))), "blocks made out of id order"
        free_ids = pool.free_block_ids()
        assert len(free_ids) == pool.num_free_blocks, "free count differs from the queue"
        assert len(set(free_ids)) == len(free_ids), "a block is in the free queue twice"
        free_set = set(free_ids)
        for b in pool.blocks:
            if b.is_null:
                assert b.block_id not in free_set and holders[b.block_id] == 0
                continue
            assert b.ref_cnt == holders[b.block_id], f"block {b.block_id}: ref_cnt {b.ref_cnt} != holders {holders[b.block_id]}"
            assert (b.block_id in free_set) == (b.ref_cnt == 0), f"block {b.block_id} free={b.block_id in free_set} ref_cnt={b.ref_cnt}"
            if b.block_hash is not None:
                assert pool.cached_blocks[b.group].get(b.block_hash) is b, f"block {b.block_id} hash not mapped to it"
                assert b.token_ids is not None and len(b.token_ids) == self.block_size
        for group, cached in enumerate(pool.cached_blocks):
            for h, b in cached.items():
                assert b.block_hash == h and b.group == group, "hash map entry points at a block with another hash"
        assert pool.num_free_blocks + len(holders) == pool.num_blocks - 1, "blocks leaked"
