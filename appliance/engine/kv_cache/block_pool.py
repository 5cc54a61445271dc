"""The physical KV block pool (torch-free).

Block 0 is a null placeholder that is never handed out. Free blocks sit in a
doubly linked queue in eviction order (LRU at the head). A block's object is
made the first time it is handed out: blocks never used yet are the queue's
head, in id order, and are allocated before any freed one, so a pool of
millions of blocks starts in no time. A block keeps its hash after its last
holder lets go, so a later request can still hit it; only when the block is
popped for a new allocation is the hash dropped (eviction).

    free queue:  head -> [never used, by id] [LRU ... MRU] <- tail
    allocate:    pop from head (evict its hash if cached)
    free:        append to tail, a request's blocks in reverse order, so its
                 last (least shareable) block is evicted first
    cache hit:   a free cached block is removed from the middle in O(1)

Every KV-cache group (``single_type``) draws from the one pool; the cache
maps a group's block hashes to its blocks (``cached_blocks[group]``), since
equal tokens hold different layers' KV in each group. The null block is no
one's: tables of sliding-window groups point at it where they gave a block
back, and taking or dropping it changes no count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from appliance.engine.kv_cache.hashing import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "group", "token_ids", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None
        self.group = 0  # the KV-cache group whose cache holds it under block_hash
        self.token_ids: Optional[tuple[int, ...]] = None  # of a cached block, to rule out collisions
        self.prev_free: Optional[KVCacheBlock] = None
        self.next_free: Optional[KVCacheBlock] = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with sentinels; every operation O(1)."""

    def __init__(self, blocks: Sequence[KVCacheBlock]):
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def popleft(self) -> KVCacheBlock:
        first = self.head.next_free
        if first is None or first is self.tail:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self):
        cur = self.head.next_free
        while cur is not None and cur is not self.tail:
            yield cur
            cur = cur.next_free


@dataclass
class KVCacheEvent:
    """BlockStored / BlockRemoved / AllBlocksCleared, as vLLM publishes them."""

    kind: str
    block_hashes: tuple = ()
    parent_block_hash: Any = None
    token_ids: tuple = ()
    block_size: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, enable_events: bool = False,
                 num_groups: int = 1):
        if num_blocks < 2:
            raise ValueError(f"the pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # The blocks handed out so far: ids 0 .. len - 1, block i at index i. The
        # rest are free and ahead of every block in free_block_queue (freed ones).
        self.blocks: list[KVCacheBlock] = []
        self.free_block_queue = FreeKVCacheBlockQueue(())
        self.cached_blocks: list[dict[BlockHash, KVCacheBlock]] = [{} for _ in range(num_groups)]
        self.null_block = self._pop_free()
        self.null_block.is_null = True
        self.events: Optional[list[KVCacheEvent]] = [] if enable_events else None

    # -- lookup and caching -------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int], group: int = 0) -> Optional[KVCacheBlock]:
        block = self.cached_blocks[group].get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None  # miss, or a hash collision that must not serve wrong KV
        return block

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int],
                         parent: Optional[BlockHash], group: int = 0) -> None:
        """Register a full block of ``group`` under its hash; a hash already
        served by another block keeps that block (this one stays uncached)."""
        cached = self.cached_blocks[group]
        if block.block_hash is not None or block_hash in cached:
            return
        block.block_hash, block.group = block_hash, group
        block.token_ids = tuple(token_ids)
        cached[block_hash] = block
        if self.events is not None:
            self.events.append(
                KVCacheEvent("BlockStored", (block_hash,), parent, block.token_ids, self.block_size)
            )

    def evict_cached(self, block: KVCacheBlock) -> None:
        """Drop a block's hash from the cache (its KV stays where it is)."""
        if block.block_hash is None:
            return
        del self.cached_blocks[block.group][block.block_hash]
        if self.events is not None:
            self.events.append(KVCacheEvent("BlockRemoved", (block.block_hash,)))
        block.block_hash = None
        block.token_ids = None


    # -- allocation ---------------------------------------------------------
    @property
    def num_never_used(self) -> int:
        return self.num_blocks - len(self.blocks)

    def _pop_free(self) -> KVCacheBlock:
        """The free queue's head: the lowest block never used, else the LRU freed one."""
        if self.num_never_used:
            block = KVCacheBlock(len(self.blocks))
            self.blocks.append(block)
            return block
        return self.free_block_queue.popleft()

    def free_block_ids(self) -> list[int]:
        """Every free block's id in eviction order (the next allocation first)."""
        return [*range(len(self.blocks), self.num_blocks), *(b.block_id for b in self.free_block_queue)]

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks; {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self._pop_free()
            self.evict_cached(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks; a free one leaves the queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue's tail
        in the given order (callers pass a request's blocks reversed)."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while blocks are held."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        for cached in self.cached_blocks:
            cached.clear()
        if self.events is not None:
            self.events.append(KVCacheEvent("AllBlocksCleared"))
        return True

    # -- accounting ---------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.num_never_used + self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.num_free_blocks

    def usage(self) -> float:
        return self.num_used_blocks / (self.num_blocks - 1)

    def take_events(self) -> list[KVCacheEvent]:
        if self.events is None:
            return []
        out, self.events[:] = list(self.events), []
        return out
