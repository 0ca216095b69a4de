"""KV cache blocks: reference counts, an O(1) LRU free list, and the prefix cache.

The pool only knows block ids, counts and content hashes; which request owns which block is
the `KVCacheManager`'s business, and the tensors themselves live in the model runner.

A full block can carry the hash of its content (and of everything before it). Freed blocks
keep their hash and stay findable until they are handed out again, so the free list doubles
as the prefix cache's LRU eviction order: the head is evicted first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tokenmill.core.kv.events import AllBlocksCleared, BlockRemoved, KVEventLog, external_block_hash


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's KV cache."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while the block is in the prefix cache
        # Links of the intrusive free list; None when the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """A doubly linked list threaded through the blocks themselves.

    Intrusive links make `remove` of a block from the middle O(1), which prefix caching needs
    when a freed-but-cached block is hit again; a deque would make that O(n).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: never handed out
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.num_cached_free_blocks = 0  # of those, holding a prefix (evictable cache)
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None and block.next_free is None and block.prev_free is None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1
        self.num_cached_free_blocks += block.block_hash is not None

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free list"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
        self.num_cached_free_blocks -= block.block_hash is not None

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All KV cache blocks, handed out least-recently-freed first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.events: KVEventLog | None = None  # set when KV cache events are published
        # Told each block id handed out again (a hybrid model's state snapshots drop theirs).
        self.on_reuse: Callable[[int], None] | None = None

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Make a full block findable by its hash. If another block already holds the same
        content, keep that one: two copies would only waste an entry. True if it was added."""
        if block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block
            if block.prev_free is not None:  # a free block: now evictable cache
                self.free_block_queue.num_cached_free_blocks += 1
            return True
        return False

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks a new owner reuses; a free one leaves the free
        list (O(1), thanks to the intrusive links)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Blocks in use keep their contents and owners."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        self.free_block_queue.num_cached_free_blocks = 0
        if self.events is not None:
            self.events.add(AllBlocksCleared())

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks still holding a cached prefix: reusable until evicted."""
        return self.free_block_queue.num_cached_free_blocks

    def block_map(self, max_cells: int) -> str:
        """One character per block: "0" free, "1" in use, "2" free but holding a cached prefix.
        Above `max_cells` blocks, each character stands for k blocks and the map shows the
        counts in that order (in use, cached, free; a non-zero count gets at least one cell):
        a scan of every block would cost the engine thread GIL time at a few reads a second.
        Read from another thread it is a picture of a moment, not an exact snapshot."""
        if self.num_blocks <= max_cells:
            return "".join(
                "1" if block.ref_cnt else "2" if block.block_hash is not None else "0"
                for block in self.blocks
            )
        num_used = self.num_blocks - self.num_free_blocks
        used = -(-num_used * max_cells // self.num_blocks)
        cached = min(
            max_cells - used, -(-self.num_cached_free_blocks * max_cells // self.num_blocks)
        )
        return ("1" * used + "2" * cached).ljust(max_cells, "0")

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} are free")
        new_blocks, evicted = [], []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0
            if block.block_hash is not None:  # evict it from the prefix cache
                del self.cached_blocks[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            new_blocks.append(block)
            if self.on_reuse is not None:
                self.on_reuse(block.block_id)
        if evicted and self.events is not None:
            self.events.add(BlockRemoved([external_block_hash(h) for h in evicted]))
        return new_blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go back on the free list
        in the order given (so callers pass tail blocks first to have them reused first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"{block} freed more often than allocated"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
