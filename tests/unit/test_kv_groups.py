"""Hybrid KV groups (layers/kv_groups.py, core/kv/window_groups.py): a sliding group's blocks
behind the window go back to the pool; a prefix hit takes only the window's blocks."""

from __future__ import annotations

from tokenmill.core.kv.cache_manager import KVCacheManager
from tokenmill.layers.kv_groups import kv_group_layout
from tokenmill.sampling_params import SamplingParams
from tokenmill.step.request import Request

# Gemma-3-1B: 26 layers, every sixth global, a window of 512 tokens.
GEMMA3_1B_WINDOWS = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]


def test_gemma3_1b_layout_and_kv_at_8k() -> None:
    layout = kv_group_layout(GEMMA3_1B_WINDOWS, 26)
    assert layout.width == 4 and layout.windows == (None, *[512] * 6)
    assert sorted(zip(layout.layer_group, layout.layer_tensor)) == sorted(
        set(zip(layout.layer_group, layout.layer_tensor))
    )  # no two layers share a (group, tensor)
    # bf16, 1 KV head of 256: 1 KiB a token and layer for K and V.
    hybrid = layout.blocks_per_seq(8192, 16) * 16 * layout.width * 1024
    full = 8192 * 26 * 1024
    assert hybrid < full / 4  # 8k: ~49 MB a sequence instead of ~218 MB
    assert kv_group_layout([None] * 4, 4).hybrid is False
    assert kv_group_layout([8, 8], 2).hybrid is False


def request(tokens: list[int], name: str) -> Request:
    return Request(name, tokens, SamplingParams(), max_tokens=4)


def test_blocks_behind_the_window_return_to_the_pool() -> None:
    # One full and one sliding group (window 8), blocks of 4.
    manager = KVCacheManager(64, 4, windows=(None, 8))
    free = manager.num_free_blocks  # block 0 is the null block
    req = request(list(range(40)), "a")
    assert manager.allocate_slots(req, 40) is not None
    assert free - manager.num_free_blocks == 20  # 10 blocks in each group
    req.num_computed_tokens = 40
    manager.cache_computed_blocks(req)
    assert manager.allocate_slots(req, 1) is not None  # position 40 reads 33..40
    sliding = manager.groups.tables["a"][0]
    null = manager.groups.null_block
    assert [b is null for b in sliding] == [True] * 8 + [False] * 3
    assert free - manager.num_free_blocks == 11 + 3
    # A prompt sharing the first 36 tokens hits 9 blocks: full group all, sliding the window.
    other = request([*range(36), 99, 98, 97, 96, 95], "b")
    hits, num_hit = manager.get_computed_blocks(other)
    assert num_hit == 36
    assert manager.allocate_slots(other, 5, hits) is not None
    table = manager.groups.tables["b"][0]
    assert [b is null for b in table] == [True] * 7 + [False] * 4
    assert table[8] is sliding[8]  # shared with the first request
    manager.free(req)
    manager.free(other)
    assert manager.num_free_blocks == free
