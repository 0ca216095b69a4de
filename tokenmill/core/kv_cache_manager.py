"""Per-request block tables over the block pool. Plain Python over integers."""

from __future__ import annotations

from collections import defaultdict

from tokenmill.core.block_pool import BlockPool, KVCacheBlock
from tokenmill.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns each request's list of blocks (its block table) and grows it on demand."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int) -> int:
        num_slots = request.num_computed_tokens + num_new_tokens
        return max(
            0, cdiv(num_slots, self.block_size) - len(self.req_to_blocks[request.request_id])
        )

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` after the request's computed tokens.

        Returns the ids of the blocks added to its table (possibly none), or None, changing
        nothing, when the pool has too few free blocks.
        """
        num_needed = self.num_blocks_to_allocate(request, num_new_tokens)
        if num_needed > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        self.req_to_blocks[request.request_id].extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def free(self, request: Request) -> None:
        """Give back every block of the request, tail first, so the blocks least likely to be
        shared by another prompt are the first to be reused."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]
