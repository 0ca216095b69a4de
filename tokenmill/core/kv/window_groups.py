"""The block tables of a hybrid model's other KV groups (`layers/kv_groups.py`): the groups
beside the primary (group 0, full attention) whose layers attend within a sliding window.

As vLLM's `SlidingWindowManager`: before each allocation, a sliding group's blocks wholly
behind the window of the request's next query are freed and their entries become the null
block (block 0 of the pool, never written, never freed; attention skips those positions). A
prefix-cache hit of k blocks needs, in each sliding group, only the blocks within the window of
position k (those before it are null); in a full-attention group, all k. Each group's blocks
are cached under the request's block hash plus the group's index, so groups never find each
other's blocks. All groups' tables have the same length: entry i covers tokens
[i * block_size, (i + 1) * block_size).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.core.kv.block_pool import BlockPool, KVCacheBlock


def group_hash(block_hash: bytes, group: int) -> bytes:
    return block_hash + group.to_bytes(2, "little")


def free_behind(
    pool: BlockPool, table: list[KVCacheBlock], first: int, null_block: KVCacheBlock
) -> None:
    """Give back `table`'s blocks before entry `first`, oldest first (so they are evicted
    from the prefix cache first), the null block in their place."""
    behind = []
    for index in range(min(first, len(table)) - 1, -1, -1):
        if table[index] is null_block:
            break
        behind.append(table[index])
        table[index] = null_block
    pool.free_blocks(reversed(behind))


class WindowGroups:
    def __init__(self, pool: BlockPool, block_size: int, windows: Sequence[int | None]) -> None:
        self.pool = pool
        self.block_size = block_size
        self.windows = tuple(windows)  # of groups 1.. (group 0 is the manager's table)
        self.null_block = pool.get_new_blocks(1)[0]  # held forever: never on the free list
        self.tables: dict[str, list[list[KVCacheBlock]]] = {}
        self.num_sent: dict[str, int] = {}  # entries of each table the runner has been sent
        self.swapped: dict[str, list[list[KVCacheBlock | None]]] = {}

    def first_needed(self, window: int | None, num_computed: int) -> int:
        """The first block the next query (at position `num_computed`) may read."""
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    # ---- prefix cache ------------------------------------------------------------------------

    def hits(self, hashes: Sequence[bytes], num_blocks: int) -> list[list[KVCacheBlock]] | None:
        """Every group's table for a hit of `num_blocks` leading blocks, or None where some
        group lacks a block it needs."""
        tables = []
        for offset, window in enumerate(self.windows):
            first = self.first_needed(window, num_blocks * self.block_size)
            table = [self.null_block] * first
            for index in range(first, num_blocks):
                block = self.pool.get_cached_block(group_hash(hashes[index], offset + 1))
                if block is None:
                    return None
                table.append(block)
            tables.append(table)
        return tables

    def cache(self, sample_id: str, hashes: Sequence[bytes], start: int, end: int) -> None:
        for offset, table in enumerate(self.tables.get(sample_id, ())):
            for index in range(start, min(end, len(table))):
                if table[index] is not self.null_block:
                    self.pool.cache_block(table[index], group_hash(hashes[index], offset + 1))

    # ---- allocation --------------------------------------------------------------------------

    def free_behind_window(self, sample_id: str, num_computed: int) -> None:
        """Give back each sliding group's blocks that no later query reads, oldest first (so
        they are evicted from the prefix cache first)."""
        for window, table in zip(self.windows, self.tables.get(sample_id, ())):
            first = self.first_needed(window, num_computed)
            free_behind(self.pool, table, first, self.null_block)

    def blocks_needed(
        self, sample_id: str, num_blocks: int, hits: list[list[KVCacheBlock]] | None
    ) -> int:
        """Free blocks taking the groups' tables to `num_blocks` entries would use."""
        if hits is not None:  # a new request: adopting its hits, then growing
            adopted = sum(1 for table in hits for b in table if b.ref_cnt == 0)
            return adopted + sum(num_blocks - len(table) for table in hits)
        tables = self.tables.get(sample_id, [[] for _ in self.windows])
        return sum(max(0, num_blocks - len(table)) for table in tables)

    def grow(self, sample_id: str, num_blocks: int, hits: list[list[KVCacheBlock]] | None) -> None:
        if hits is not None:
            for table in hits:
                self.pool.touch(b for b in table if b is not self.null_block)
            self.tables[sample_id] = [list(table) for table in hits]
        tables = self.tables.setdefault(sample_id, [[] for _ in self.windows])
        for table in tables:
            table.extend(self.pool.get_new_blocks(max(0, num_blocks - len(table))))

    def free(self, sample_id: str) -> None:
        for table in self.tables.pop(sample_id, ()):
            self.pool.free_blocks(reversed([b for b in table if b is not self.null_block]))
        self.num_sent.pop(sample_id, None)

    def take_new_ids(self) -> dict[str, list[list[int]]]:
        """Per request, each group's entries the runner has not been sent (a request that
        came to hold blocks again: its whole tables)."""
        new = {}
        for sample_id, tables in self.tables.items():
            sent = self.num_sent.get(sample_id, 0)
            if len(tables[0]) > sent:
                new[sample_id] = [[b.block_id for b in table[sent:]] for table in tables]
                self.num_sent[sample_id] = len(tables[0])
        return new

    # ---- swap --------------------------------------------------------------------------------

    def num_held(self, sample_id: str) -> int:
        tables = self.tables.get(sample_id, ())
        return sum(1 for table in tables for b in table if b is not self.null_block)

    def swap_out(self, sample_id: str, swap_pool: BlockPool) -> list[tuple[int, int]]:
        """Copy pairs of every held block; the caller checked the host pool has room."""
        pairs, host_tables = [], []
        for table in self.tables.get(sample_id, ()):
            host_table: list[KVCacheBlock | None] = []
            for block in table:
                if block is self.null_block:
                    host_table.append(None)
                    continue
                host = swap_pool.get_new_blocks(1)[0]
                pairs.append((block.block_id, host.block_id))
                host_table.append(host)
            host_tables.append(host_table)
        self.swapped[sample_id] = host_tables
        self.free(sample_id)
        return pairs

    def swap_in_needed(self, sample_id: str, num_blocks: int) -> int:
        return sum(
            sum(h is not None for h in table) + max(0, num_blocks - len(table))
            for table in self.swapped[sample_id]
        )

    def swap_in(
        self, sample_id: str, num_blocks: int, swap_pool: BlockPool
    ) -> list[tuple[int, int]]:
        pairs, tables = [], []
        for host_table in self.swapped.pop(sample_id):
            table = []
            for host in host_table:
                if host is None:
                    table.append(self.null_block)
                    continue
                block = self.pool.get_new_blocks(1)[0]
                pairs.append((host.block_id, block.block_id))
                table.append(block)
            table.extend(self.pool.get_new_blocks(max(0, num_blocks - len(table))))
            swap_pool.free_blocks(h for h in host_table if h is not None)
            tables.append(table)
        self.tables[sample_id] = tables
        return pairs

    def drop_swapped(self, sample_id: str, swap_pool: BlockPool) -> None:
        for host_table in self.swapped.pop(sample_id, ()):
            swap_pool.free_blocks(h for h in host_table if h is not None)
