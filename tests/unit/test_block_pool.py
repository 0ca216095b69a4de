"""Block pool and KV cache manager invariants, as hypothesis state machines."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.core.kv.block_pool import BlockPool
from tokenmill.core.kv.cache_manager import KVCacheManager, cdiv
from tokenmill.sampling_params import SamplingParams
from tokenmill.step.request import Request


def test_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    a, _, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c, a])
    pool.free_blocks([d])
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [c.block_id, a.block_id, d.block_id]


def test_asking_for_more_blocks_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1


def test_a_shared_block_is_free_only_after_its_last_owner_lets_go() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # a second owner
    pool.free_blocks([block])
    assert pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Random allocate/grow/free sequences never leak, double-own or miscount a block."""

    def __init__(self) -> None:
        super().__init__()
        self.block_size = 4
        self.manager = KVCacheManager(num_blocks=24, block_size=self.block_size)
        self.requests: dict[str, Request] = {}
        self.counter = 0

    @rule(num_tokens=st.integers(1, 40))
    def add(self, num_tokens: int) -> None:
        request = Request(f"r{self.counter}", [1] * num_tokens, SamplingParams(), max_tokens=8)
        self.counter += 1
        free_before = self.manager.num_free_blocks
        new_ids = self.manager.allocate_slots(request, num_tokens)
        if new_ids is None:
            assert cdiv(num_tokens, self.block_size) > free_before
            assert self.manager.num_free_blocks == free_before
            return
        assert len(new_ids) == cdiv(num_tokens, self.block_size)
        request.num_computed_tokens = num_tokens
        self.requests[request.sample_id] = request

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), num_new=st.integers(1, 9))
    def grow(self, data: st.DataObject, num_new: int) -> None:
        request = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        before = self.manager.get_block_ids(request.sample_id)
        new_ids = self.manager.allocate_slots(request, num_new)
        if new_ids is None:
            assert self.manager.get_block_ids(request.sample_id) == before
            return
        assert self.manager.get_block_ids(request.sample_id) == before + new_ids
        request.num_computed_tokens += num_new
        request.all_token_ids += [1] * num_new

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request = self.requests.pop(data.draw(st.sampled_from(sorted(self.requests))))
        self.manager.free(request)

    @invariant()
    def every_block_is_owned_once_or_free(self) -> None:
        owned = [b for r in self.requests for b in self.manager.get_block_ids(r)]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        free = {b.block_id for b in self.manager.block_pool.free_block_queue}
        assert not free & set(owned), "an owned block is on the free list"
        assert len(owned) + len(free) == self.manager.num_blocks, "a block leaked"
        assert self.manager.num_free_blocks == len(free)
        for block in self.manager.block_pool.blocks:
            assert block.ref_cnt == (0 if block.block_id in free else 1)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.manager.reset_prefix_cache()

    @invariant()
    def block_states_count_what_a_full_scan_finds(self) -> None:
        states = self.manager.block_states()
        blocks = self.manager.block_pool.blocks
        cached_free = [b for b in blocks if b.ref_cnt == 0 and b.block_hash is not None]
        assert states.num_cached_free == len(cached_free)
        assert states.num_used == sum(1 for b in blocks if b.ref_cnt)
        assert states.block_map.count("2") == len(cached_free)
        assert states.block_map.count("1") == states.num_used

    @invariant()
    def each_request_has_exactly_the_blocks_its_tokens_need(self) -> None:
        for request in self.requests.values():
            num_blocks = len(self.manager.get_block_ids(request.sample_id))
            assert num_blocks == cdiv(request.num_computed_tokens, self.block_size)

    def teardown(self) -> None:
        for request in self.requests.values():
            self.manager.free(request)
        assert self.manager.num_free_blocks == self.manager.num_blocks


TestKVCacheManager = KVCacheManagerMachine.TestCase
TestKVCacheManager.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
