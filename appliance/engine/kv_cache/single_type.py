"""One KV-cache group's block tables over the shared pool (torch-free).

A model's layers fall into groups by attention kind (``KVCacheGroupSpec``);
every group holds its own table of blocks per request, all drawn from one
``BlockPool``, so any free block serves any group. A group's manager knows
its kind's rules:

- full attention keeps every block, and a prefix hit is the longest run of
  cached blocks from the start;
- a sliding window of W tokens (a token attends to itself and the W - 1
  before it) needs only the blocks that hold the last W - 1 computed
  tokens: blocks wholly before them are given back to the pool (their table
  entries become the null block) as the sequence moves on, and a prefix hit
  needs only the cached blocks inside the window at the hit's end;
- chunked local attention over chunks of C tokens (a token attends to the
  tokens of its chunk up to itself; C a multiple of the block size) needs
  only the blocks of the current chunk: blocks of finished chunks are given
  back, and a prefix hit needs only the cached blocks of the chunk the hit
  ends in (a hit may end where a chunk begins with nothing cached).

A state group (Mamba, linear attention) would be another manager here; the
coordinator (``manager.KVCacheManager``) and the scheduler see only this
interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from appliance.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from appliance.engine.kv_cache.hashing import BlockHash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """The attention kind of a group's layers: full (both None), a sliding
    window of ``sliding_window`` tokens, or chunked local attention over
    chunks of ``attention_chunk`` tokens."""

    sliding_window: Optional[int] = None
    attention_chunk: Optional[int] = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"a sliding window holds at least one token, got {self.sliding_window}")
        if self.attention_chunk is not None and self.attention_chunk < 1:
            raise ValueError(f"an attention chunk holds at least one token, got {self.attention_chunk}")
        if self.sliding_window is not None and self.attention_chunk is not None:
            raise ValueError("a KV-cache group has a sliding window or attention chunks, not both")

    @property
    def gives_back(self) -> bool:
        """Its blocks behind what the next token reads are given back (a window or chunks)."""
        return self.sliding_window is not None or self.attention_chunk is not None


FULL_ATTENTION = KVCacheGroupSpec()


class SingleTypeManager:
    """The block tables of one group: ``req_to_blocks[rid]`` is a request's
    blocks in position order (the null block where a block was given back)."""

    def __init__(self, pool: BlockPool, block_size: int, group: int, spec: KVCacheGroupSpec):
        self.pool, self.block_size, self.group, self.spec = pool, block_size, group, spec
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the cache (or given back).
        self.num_cached_block: dict[str, int] = {}

    def find_cache_hit(self, hashes: Sequence[BlockHash], tokens: Sequence[int], max_blocks: int) -> list[KVCacheBlock]:
        """The blocks of the longest prefix of at most ``max_blocks`` blocks
        this group can serve from the cache (its length is the hit)."""
        raise NotImplementedError

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks no later token attends to (none for full attention)."""

    def _give_back(self, request_id: str, num_skipped: int) -> None:
        """The request's first ``num_skipped`` blocks back to the pool, their entries the null block."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        null, gone = self.pool.null_block, []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break  # every block before it was given back already
            gone.append(blocks[i])
            blocks[i] = null
        self.pool.free_blocks(gone)

    def num_new_blocks(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        """Blocks the pool must hand out so the request holds ``num_tokens`` slots."""
        held = len(self.req_to_blocks.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - held - num_hit_blocks)

    def most_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` holds here, computing at most ``chunk`` tokens a step."""
        return cdiv(num_tokens, self.block_size)

    def take_hits(self, request_id: str, hits: list[KVCacheBlock]) -> None:
        """Append the prefix-cache hit blocks, a reference taken on each."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
            self.num_cached_block[request_id] = len(blocks)

    def take_new(self, request_id: str, num_new: int) -> list[KVCacheBlock]:
        """Append ``num_new`` fresh blocks (after every group took its hits:
        a hit sitting in the free queue must not be handed out first)."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if not num_new:
            return []
        new = self.pool.get_new_blocks(num_new)
        blocks.extend(new)
        return new

    def cache_full_blocks(self, request_id: str, hashes: Sequence[BlockHash], tokens: Sequence[int],
                          num_full_blocks: int) -> None:
        """Register the request's full blocks up to ``num_full_blocks`` in the prefix cache."""
        start = self.num_cached_block.get(request_id, 0)
        end = min(num_full_blocks, len(hashes))
        if end <= start:
            return
        blocks, bs = self.req_to_blocks[request_id], self.block_size
        for i in range(start, end):
            if not blocks[i].is_null:
                parent = hashes[i - 1] if i else None
                self.pool.cache_full_block(blocks[i], hashes[i], tokens[i * bs : (i + 1) * bs], parent, self.group)
        self.num_cached_block[request_id] = end

    def free(self, request_id: str) -> None:
        """Release a request's blocks, last block first into the queue."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def fork(self, parent_id: str, child_id: str, num_blocks: int) -> None:
        """``child_id`` holds the parent's first ``num_blocks`` blocks too (a reference on each)."""
        blocks = self.req_to_blocks.get(parent_id, [])[:num_blocks]
        self.pool.touch(blocks)
        self.req_to_blocks[child_id] = blocks
        self.num_cached_block[child_id] = min(num_blocks, self.num_cached_block.get(parent_id, 0))

    def move(self, parent_id: str, child_id: str, num_blocks: int) -> None:
        """``child_id`` takes the parent's first ``num_blocks`` blocks; the rest are freed."""
        blocks = self.req_to_blocks.pop(parent_id, [])
        self.pool.free_blocks(reversed(blocks[num_blocks:]))
        self.req_to_blocks[child_id] = blocks[:num_blocks]
        self.num_cached_block[child_id] = min(num_blocks, self.num_cached_block.pop(parent_id, 0))

    def make_private(self, request_id: str, index: int) -> tuple[int, int]:
        """Replace the request's block at ``index`` by a fresh one (the old
        keeps its other holders): (old id, new id), for the KV copy."""
        blocks = self.req_to_blocks[request_id]
        old, new = blocks[index], self.pool.get_new_blocks(1)[0]
        blocks[index] = new
        self.pool.free_blocks([old])
        return old.block_id, new.block_id

    def uncache(self, request_id: str, first_block: int) -> None:
        for block in self.req_to_blocks.get(request_id, [])[first_block:]:
            self.pool.evict_cached(block)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]


class FullAttentionManager(SingleTypeManager):
    def find_cache_hit(self, hashes: Sequence[BlockHash], tokens: Sequence[int], max_blocks: int) -> list[KVCacheBlock]:
        bs, hits = self.block_size, []
        for i, h in enumerate(hashes[:max_blocks]):
            block = self.pool.get_cached_block(h, tokens[i * bs : (i + 1) * bs], self.group)
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeManager):
    """A sliding window of W tokens: the first token after a hit of n blocks
    attends to the W - 1 before it, which lie in the last cdiv(W - 1, bs)
    blocks of the hit; the hit's earlier blocks may be anything (null)."""

    def __init__(self, pool: BlockPool, block_size: int, group: int, spec: KVCacheGroupSpec):
        super().__init__(pool, block_size, group, spec)
        assert spec.sliding_window is not None
        self.window = spec.sliding_window
        self.window_blocks = cdiv(self.window - 1, block_size)

    def find_cache_hit(self, hashes: Sequence[BlockHash], tokens: Sequence[int], max_blocks: int) -> list[KVCacheBlock]:
        bs = self.block_size
        n = min(max_blocks, len(hashes))
        if self.window_blocks == 0:  # a window of one token needs nothing cached
            return [self.pool.null_block] * n
        found: list[KVCacheBlock] = [self.pool.null_block] * n
        run = 0
        for i in range(n - 1, -1, -1):  # from the longest: the last run of window_blocks cached blocks
            block = self.pool.get_cached_block(hashes[i], tokens[i * bs : (i + 1) * bs], self.group)
            if block is None:
                run = 0
                continue
            found[i] = block
            run += 1
            if run == self.window_blocks:
                return found[: i + run]
        return found[:run]  # no whole window: the cached run from the start, if any

    def most_blocks(self, num_tokens: int, chunk: int) -> int:
        """The window, a step's chunk beside it, and the block the window straddles (as the plan counts a
        group's blocks per request: ``config.kv_groups.KVLayout.blocks_per_request``)."""
        return min(cdiv(num_tokens, self.block_size), cdiv(min(self.window - 1 + chunk, num_tokens), self.block_size) + 1)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        # the next token (at num_computed_tokens) attends back to num_computed_tokens - W + 1
        self._give_back(request_id, max(0, num_computed_tokens - self.window + 1) // self.block_size)


class ChunkedLocalAttentionManager(SingleTypeManager):
    """Chunked local attention over chunks of C tokens (a multiple of the
    block size): the first token after a hit of n blocks attends to the
    tokens of its chunk before it, which lie in the hit's blocks from the
    chunk's first; the earlier ones may be anything (null). Blocks are given
    back a whole chunk at a time, as the sequence enters the next."""

    def __init__(self, pool: BlockPool, block_size: int, group: int, spec: KVCacheGroupSpec):
        super().__init__(pool, block_size, group, spec)
        assert spec.attention_chunk is not None
        if spec.attention_chunk % block_size:
            raise ValueError(f"an attention chunk of {spec.attention_chunk} tokens is not whole blocks of "
                             f"{block_size}")
        self.chunk_blocks = spec.attention_chunk // block_size

    def find_cache_hit(self, hashes: Sequence[BlockHash], tokens: Sequence[int], max_blocks: int) -> list[KVCacheBlock]:
        bs = self.block_size
        n = min(max_blocks, len(hashes))
        first = n // self.chunk_blocks * self.chunk_blocks  # the first block of the chunk a hit of n blocks ends in
        found: list[KVCacheBlock] = [self.pool.null_block] * first
        for i in range(first, n):  # the chunk's cached run from its first block
            block = self.pool.get_cached_block(hashes[i], tokens[i * bs : (i + 1) * bs], self.group)
            if block is None:
                break
            found.append(block)
        return found

    def most_blocks(self, num_tokens: int, chunk: int) -> int:
        """The current chunk's tokens before a step and the step's chunk, from the chunk's first block (as the plan
        counts them: ``config.kv_groups.KVLayout.blocks_per_request``)."""
        c = self.chunk_blocks * self.block_size
        return min(cdiv(num_tokens, self.block_size), cdiv(min(c - 1 + chunk, num_tokens), self.block_size))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        # the next token (at num_computed_tokens) attends back to its chunk's first token
        self._give_back(request_id, num_computed_tokens // self.block_size // self.chunk_blocks * self.chunk_blocks)


def single_type_manager(pool: BlockPool, block_size: int, group: int, spec: KVCacheGroupSpec) -> SingleTypeManager:
    cls = (ChunkedLocalAttentionManager if spec.attention_chunk is not None
           else FullAttentionManager if spec.sliding_window is None else SlidingWindowManager)
    return cls(pool, block_size, group, spec)
