"""KV cache manager: block tables per request over one BlockPool (torch-free)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from appliance.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from appliance.engine.kv_cache.hashing import get_hash_fn, update_block_hashes
from appliance.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    ):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_fn(hash_algo)
        self.pool = BlockPool(num_blocks, block_size, enable_caching, enable_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the cache.
        self.num_cached_block: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    # ----------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""
        return self.pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request`` as (blocks, num_tokens).

        Capped at num_tokens - 1: the last token is always recomputed so the
        step produces its logits. None for a request that asks for prompt
        logprobs: every prompt position must run to score the next token.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = update_block_hashes(request, self.block_size, self.hash_fn)
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens = request.all_token_ids
        hits: list[KVCacheBlock] = []
        for i, h in enumerate(hashes[:max_blocks]):
            block = self.pool.get_cached_block(h, tokens[i * self.block_size : (i + 1) * self.block_size])
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    # ----------------------------------------------------------------------
    #  Block layout of a request when allocate_slots is called:
    #
    #  |<-------- computed -------->|<- new computed ->|<-- new -->|<- lookahead ->|
    #  | request.num_computed_tokens| cache hits (this | tokens to | draft tokens  |
    #  |  (blocks already held)     | step's prefix)   | compute   | (spec decode) |
    #
    #  Blocks are appended to the request's table (append-only); full blocks
    #  whose KV this step computes are registered in the prefix cache at once:
    #  a later request in the same step may hit them, because every layer
    #  writes the whole step's K/V before it attends.
    def _num_new_blocks(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: list[KVCacheBlock],
        num_lookahead_tokens: int,
    ) -> int:
        """Blocks the pool must hand out for the step, beyond those held and hit."""
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_held = len(self.req_to_blocks.get(request.request_id, ()))
        return max(0, cdiv(total, self.block_size) - num_held - len(new_computed_blocks))

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed.

        The one place the block arithmetic lives: the scheduler asks it to
        decide how much to preempt, allocate_slots asks it before taking.
        """
        new_computed_blocks = new_computed_blocks or []
        n = self._num_new_blocks(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                 num_lookahead_tokens)
        # Hit blocks that sit in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return n <= self.pool.num_free_blocks - num_evictable_hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> Optional[list[KVCacheBlock]]:
        """New blocks for the step, or None when the pool cannot fit them.
        ``delay_cache_blocks``: the new full blocks enter the prefix cache
        later, with the allocation that runs past them (a KV connector fills
        them in the background; nobody may hit them before)."""
        if num_new_tokens <= 0 and num_lookahead_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        new_computed_blocks = new_computed_blocks or []
        args = (request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens)
        if not self.can_allocate(*args):
            return None
        num_new_blocks = self._num_new_blocks(*args)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(req_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            num_computed = request.num_computed_tokens + num_new_computed_tokens
            self._cache_full_blocks(request, (num_computed + num_new_tokens) // self.block_size)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        rid = request.request_id
        start = self.num_cached_block.get(rid, 0)
        if num_full_blocks <= start:
            return
        hashes = update_block_hashes(request, self.block_size, self.hash_fn)
        blocks = self.req_to_blocks[rid]
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(start, min(num_full_blocks, len(hashes))):
            parent = hashes[i - 1] if i else None
            self.pool.cache_full_block(blocks[i], hashes[i], tokens[i * bs : (i + 1) * bs], parent)
        self.num_cached_block[rid] = min(num_full_blocks, len(hashes))

    def free(self, request: Request) -> None:
        """Release a request's blocks, last block first into the queue."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def uncache_blocks(self, request_id: str, first_block: int) -> None:
        """Forget the prefix-cache entries of a request's blocks from
        ``first_block`` on: after a failed step their KV may never have been
        written, and no later request may hit it."""
        for block in self.req_to_blocks.get(request_id, [])[first_block:]:
            self.pool.evict_cached(block)

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset_prefix_cache()
        if ok:
            self.stats.resets += 1
        return ok

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

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
        for rid, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), f"{rid} holds a block twice: {ids}"
            for b in blocks:
                assert not b.is_null, f"{rid} holds the null block"
                holders[b.block_id] += 1
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
                assert pool.cached_block_hash_to_block.get(b.block_hash) is b, f"block {b.block_id} hash not mapped to it"
                assert b.token_ids is not None and len(b.token_ids) == self.block_size
        for h, b in pool.cached_block_hash_to_block.items():
            assert b.block_hash == h, "hash map entry points at a block with another hash"
        assert pool.num_free_blocks + len(holders) == pool.num_blocks - 1, "blocks leaked"
