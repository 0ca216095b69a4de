"""A hybrid model's state snapshots (layers/state_snapshots.py): slots reused per block,
least-recently-used eviction, dropped when their block is handed out again; the KV cache
manager's prefix hits cut back to a block holding one."""

from __future__ import annotations

import torch

from tokenmill.core.kv.cache_manager import KVCacheManager
from tokenmill.layers.state_snapshots import StateSnapshots
from tokenmill.sampling_params import SamplingParams
from tokenmill.step.request import Request


def snapshots(num_slots: int) -> StateSnapshots:
    return StateSnapshots([torch.zeros(2, 3, 3)], [torch.zeros(2, 1, 2, 2)], num_slots)


def test_slots_reused_per_block_and_least_recently_used_evicted() -> None:
    snaps = snapshots(2)
    first, second = snaps.slot_to_write(10), snaps.slot_to_write(11)
    assert first != second and snaps.slot_to_write(10) == first  # its own slot again
    snaps.slot_to_read(10)  # 11 is now the least recently used
    assert snaps.slot_to_write(12) == second
    assert not snaps.holds(11) and snaps.holds(10) and snaps.holds(12)
    snaps.save(0, first, torch.ones(3, 3), torch.full((1, 2, 2), 2.0))
    assert snaps.conv[0][first].sum() == 9 and snaps.recurrent[0][first].sum() == 8
    snaps.drop(10)
    assert not snaps.holds(10) and len(snaps) == 1
    assert snaps.slot_to_write(13) == first  # the freed slot


def test_hits_end_at_a_snapshot_and_snapshots_leave_with_their_blocks() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=2)
    snaps = snapshots(4)
    manager.hit_ends, manager.block_pool.on_reuse = snaps.holds, snaps.drop
    params = SamplingParams(max_tokens=1)
    first = Request("a", list(range(9)), params, max_tokens=1)
    blocks = manager.allocate_slots(first, 9)
    assert blocks is not None
    first.num_computed_tokens = 9
    manager.cache_computed_blocks(first)
    snaps.slot_to_write(blocks[1])  # a snapshot after 4 tokens only
    hits, num_tokens = manager.get_computed_blocks(
        Request("b", list(range(9)), params, max_tokens=1)
    )
    assert [b.block_id for b in hits] == blocks[:2] and num_tokens == 4
    manager.free(first)
    manager.allocate_slots(Request("c", [99] * 16, params, max_tokens=1), 16)  # evicts every block
    assert len(snaps) == 0
