"""Per-request block tables over the block pool: prefix-cache lookups, on-demand growth, swap.
Plain Python over integers."""

from __future__ import annotations

import hashlib
from array import array
from collections import defaultdict
from collections.abc import Callable, Sequence

from tokenmill.core.kv.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.kv.events import BlockStored, KVEventLog, external_block_hash
from tokenmill.core.kv.window_groups import WindowGroups, free_behind
from tokenmill.metrics.stats import KVBlockStates, PrefixCacheStats
from tokenmill.step.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra: bytes) -> bytes:
    """SHA-256 of (parent block's hash, this block's tokens, extra keys).

    Chaining makes a block's hash stand for the whole prefix up to it. A cryptographic hash
    means a collision, which would hand one request another's KV, is not a practical risk.
    """
    digest = hashlib.sha256(parent_hash or b"\0")
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra)
    return digest.digest()


class KVCacheManager:
    """Owns each request's list of blocks (its block table) and grows it on demand.

    `windows`: each KV group's sliding window (`layers/kv_groups.py`; None keeps every
    block). The first is the primary table (`req_to_blocks`, what the connectors and the
    runner's proposers read); the others, for a hybrid model, are `WindowGroups`'. A primary
    with a window (a model-wide one: the only group then) gives back its blocks behind the
    window too, the null block in their place.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_swap_blocks: int = 0,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_blocks: dict[str, int] = {}  # per request: blocks already hashed
        self.prefix_cache_stats = PrefixCacheStats()
        # The host-side pool that swapped-out requests' blocks are copied to.
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks else None
        # None: a windowed primary's entry behind its window (the null block's).
        self.req_to_swapped_blocks: dict[str, list[KVCacheBlock | None]] = {}
        assert windows[0] is None or len(windows) == 1, "a windowed primary is the only group"
        self.window = windows[0]
        self.groups = (
            WindowGroups(self.block_pool, block_size, windows[1:]) if len(windows) > 1 else None
        )
        # Whether a hit may end with a block (a hybrid model's: where a state snapshot is kept).
        self.hit_ends: Callable[[int], bool] | None = None
        # Held forever where the primary table frees blocks: never written, never freed.
        self.null_block = self.block_pool.get_new_blocks(1)[0] if self.window else None

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def block_states(self, max_cells: int = 2048) -> KVBlockStates:
        pool, swap = self.block_pool, self.swap_pool
        return KVBlockStates(
            num_blocks=pool.num_blocks,
            num_used=pool.num_blocks - pool.num_free_blocks,
            num_cached_free=pool.num_cached_free_blocks,
            num_swap_blocks=0 if swap is None else swap.num_blocks,
            num_swapped=0 if swap is None else swap.num_blocks - swap.num_free_blocks,
            num_swapped_reqs=len(self.req_to_swapped_blocks),
            block_map=pool.block_map(max_cells),
        )

    # ---- prefix cache ------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of the request's leading full blocks found in the prefix cache, and
        the number of tokens they hold.

        At most `num_tokens - 1` tokens can hit: the last token must still be computed so that
        there are logits to sample from. Requests that want prompt logprobs get no hits (the
        logits of cached positions are not kept).
        """
        if not self.reads_prefix_cache(request):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.null_block is not None:
            return self._window_hits(request, max_blocks)
        hits = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.groups is not None:  # the longest hit every group has the blocks for
            hashes = self.block_hashes(request)
            while hits and self.groups.hits(hashes, len(hits)) is None:
                hits.pop()
        if self.hit_ends is not None:  # a hybrid model: back to a block with a state snapshot
            while hits and not self.hit_ends(hits[-1].block_id):
                hits.pop()
        return hits, len(hits) * self.block_size

    def _window_hits(self, request: Request, max_blocks: int) -> tuple[list[KVCacheBlock], int]:
        """A windowed primary's longest hit: of its k leading blocks only those within the
        window of position k * block_size must be cached (the null block before them)."""
        assert self.window is not None and self.null_block is not None
        cached = [self.block_pool.get_cached_block(h) for h in self.block_hashes(request)]
        run = 0  # cached blocks ending at index k - 1
        best, best_first = 0, 0
        for k in range(1, max_blocks + 1):
            run = run + 1 if cached[k - 1] is not None else 0
            first = max(0, k * self.block_size - self.window + 1) // self.block_size
            if run >= k - first:
                best, best_first = k, first
        hits = [self.null_block] * best_first + cached[best_first:best]
        return hits, best * self.block_size  # type: ignore[return-value]

    def reads_prefix_cache(self, request: Request) -> bool:
        """Whether the request may take blocks from the prefix cache: not with caching off,
        nor when it wants prompt logprobs (the logits of cached positions are not kept)."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admission's lookup; a request that bypasses the cache made none (vLLM)."""
        if self.reads_prefix_cache(request):
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens

    def publish_events(self) -> KVEventLog:
        """Start logging the prefix cache's events (for `--kv-events-config`)."""
        if self.block_pool.events is None:
            self.block_pool.events = KVEventLog()
        return self.block_pool.events

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
        for req_id in self.num_cached_blocks:
            self.num_cached_blocks[req_id] = len(self.req_to_blocks[req_id])

    def block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks, extended as tokens arrive (kept on the request
        so each block is hashed once)."""
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        salt = (request.cache_salt or "").encode()
        if request.lora_int_id:  # two adapters (or an adapter and the base) never share KV
            salt += f"\0lora:{request.lora_int_id}".encode()
        while len(hashes) < num_full:
            start = len(hashes) * self.block_size
            tokens = request.all_token_ids[start : start + self.block_size]
            extra = salt if not hashes else b""  # the chain carries the salt onward
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens, extra))
        return hashes

    # ---- allocation --------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` after the request's computed tokens, first adopting
        `computed_blocks` (prefix-cache hits that extend its computed tokens), plus
        `num_lookahead_tokens` slots a draft model will write beyond them.

        Returns the ids of the blocks added to its table, or None, changing nothing, when the
        pool has too few free blocks.
        """
        blocks = self.req_to_blocks[request.sample_id]
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, num_needed - len(blocks) - len(computed_blocks))
        # Hits sitting on the free list stop being free when adopted.
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        groups, group_hits = self.groups, None
        num_group_blocks = 0
        if self.window is not None and self.null_block is not None:
            first = max(0, num_computed - self.window + 1) // self.block_size
            free_behind(self.block_pool, blocks, first, self.null_block)
        if groups is not None:
            groups.free_behind_window(request.sample_id, num_computed)
            if computed_blocks:
                group_hits = groups.hits(self.block_hashes(request), len(computed_blocks))
                assert group_hits is not None, "hits checked by get_computed_blocks"
            num_group_blocks = groups.blocks_needed(request.sample_id, num_needed, group_hits)
        num_free = self.block_pool.num_free_blocks
        if num_new_blocks + num_evictable_hits + num_group_blocks > num_free:
            return None
        self.block_pool.touch(self.held(list(computed_blocks)))
        if groups is not None:
            groups.grow(request.sample_id, num_needed, group_hits)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        return [block.block_id for block in (*computed_blocks, *new_blocks)]

    def cache_computed_blocks(self, request: Request) -> None:
        """Make the request's full blocks whose KV is written (those within
        `num_computed_tokens`) findable by their hash. Called once the step that computed them
        has completed, never at allocation: a request can be given slots and then lose them
        unwritten (taken back within `schedule()`, or its step fails), and a later request
        must not find those blocks and read whatever they held."""
        blocks = self.req_to_blocks.get(request.sample_id)
        if not self.enable_caching or not blocks:
            return
        hashes = self.block_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(hashes), len(blocks))
        start = self.num_cached_blocks.get(request.sample_id, 0)
        stored = [
            index
            for index in range(start, num_full)
            if blocks[index] is not self.null_block
            and self.block_pool.cache_block(blocks[index], hashes[index])
        ]
        if self.groups is not None:
            self.groups.cache(request.sample_id, hashes, start, num_full)
        self.num_cached_blocks[request.sample_id] = max(start, num_full)
        if stored and self.block_pool.events is not None:
            self._block_stored_events(request, hashes, stored, self.block_pool.events)

    def _block_stored_events(
        self, request: Request, hashes: list[bytes], stored: list[int], log: KVEventLog
    ) -> None:
        """One `BlockStored` per run of consecutive blocks newly cached (a block whose
        content another block already held adds nothing, and breaks the run)."""
        size = self.block_size
        runs: list[list[int]] = []
        for index in stored:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, last = run[0], run[-1]
            log.add(
                BlockStored(
                    block_hashes=[external_block_hash(hashes[i]) for i in run],
                    parent_block_hash=external_block_hash(hashes[first - 1]) if first else None,
                    token_ids=list(request.all_token_ids[first * size : (last + 1) * size]),
                    block_size=size,
                    lora_id=request.lora_int_id or None,
                )
            )

    def free(self, request: Request) -> None:
        """Give back every block of the request, tail first, so that when they are evicted
        the tail blocks (least likely to be shared by another prompt) go first."""
        blocks = self.held(self.req_to_blocks.pop(request.sample_id, []))
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(request.sample_id, None)
        swapped = self.req_to_swapped_blocks.pop(request.sample_id, None)
        if swapped and self.swap_pool is not None:
            self.swap_pool.free_blocks(h for h in swapped if h is not None)
        if self.groups is not None:
            self.groups.free(request.sample_id)
            if self.swap_pool is not None:
                self.groups.drop_swapped(request.sample_id, self.swap_pool)

    def held(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """`blocks` without the null block (a windowed primary's entries behind its window)."""
        null = self.null_block
        return blocks if null is None else [b for b in blocks if b is not null]

    def holds_blocks(self, request: Request) -> bool:
        """Whether the request has blocks in the pool (a waiting one only after a KV
        connector loaded its prompt's KV into them)."""
        return bool(self.req_to_blocks.get(request.sample_id))

    def get_block_ids(self, sample_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(sample_id, [])]

    def take_group_block_ids(self) -> dict[str, list[list[int]]]:
        """The other KV groups' block ids each request gained since the last call (its whole
        tables where it came to hold blocks again), for the runner; empty for one group."""
        return {} if self.groups is None else self.groups.take_new_ids()

    # ---- swap --------------------------------------------------------------------------------

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host pool: returns (device block, host block) pairs
        to copy, or None, changing nothing, if the host pool can't take them all."""
        blocks = self.req_to_blocks.get(request.sample_id, [])
        held = self.held(blocks)
        groups = self.groups
        num_held = len(held) + (0 if groups is None else groups.num_held(request.sample_id))
        if self.swap_pool is None or num_held > self.swap_pool.num_free_blocks:
            return None
        new_hosts = iter(self.swap_pool.get_new_blocks(len(held)))
        # None for the null block's entries (a windowed primary's, behind its window).
        host_blocks = [None if b is self.null_block else next(new_hosts) for b in blocks]
        self.req_to_swapped_blocks[request.sample_id] = host_blocks
        pairs = [(d.block_id, h.block_id) for d, h in zip(blocks, host_blocks) if h is not None]
        if groups is not None:
            pairs += groups.swap_out(request.sample_id, self.swap_pool)
        del self.req_to_blocks[request.sample_id]
        self.block_pool.free_blocks(reversed(held))
        self.num_cached_blocks.pop(request.sample_id, None)
        return pairs

    def is_swapped(self, request: Request) -> bool:
        return request.sample_id in self.req_to_swapped_blocks

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped request back with room for `num_new_tokens` more: returns (host
        block, device block) pairs to copy, or None, changing nothing, if blocks are short."""
        host_blocks = self.req_to_swapped_blocks[request.sample_id]
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        groups = self.groups
        num_group = 0 if groups is None else groups.swap_in_needed(request.sample_id, num_needed)
        num_null = sum(1 for h in host_blocks if h is None)
        if num_needed - num_null + num_group > self.block_pool.num_free_blocks:
            return None
        new_blocks = iter(self.block_pool.get_new_blocks(num_needed - num_null))
        blocks = [self.null_block if h is None else next(new_blocks) for h in host_blocks]
        blocks.extend(new_blocks)
        self.req_to_blocks[request.sample_id] = blocks  # type: ignore[assignment]
        pairs = [(h.block_id, d.block_id) for h, d in zip(host_blocks, blocks) if h is not None]
        assert self.swap_pool is not None
        swapped = self.req_to_swapped_blocks.pop(request.sample_id)
        self.swap_pool.free_blocks(h for h in swapped if h is not None)
        if groups is not None:
            pairs += groups.swap_in(request.sample_id, num_needed, self.swap_pool)
        return pairs
