"""The ring the engine thread fills and the dashboard reads: what a reader gets back."""

from __future__ import annotations

import threading

import pytest

from tokenmill.core.kv.block_pool import BlockPool
from tokenmill.metrics.ring import Ring


def test_a_reader_gets_each_record_once_in_order() -> None:
    ring: Ring[int] = Ring(8)
    for n in range(5):
        ring.append(n)
    first, cursor = ring.since(0)
    ring.append(5)
    second, cursor = ring.since(cursor)
    assert (first, second, cursor) == ([0, 1, 2, 3, 4], [5], 6)
    assert ring.since(cursor) == ([], 6)


def test_a_reader_that_fell_behind_gets_only_the_records_still_intact() -> None:
    ring: Ring[int] = Ring(4)
    for n in range(10):
        ring.append(n)
    assert ring.since(0) == ([7, 8, 9], 10)  # slot of 6 is the next to be rewritten


def test_a_ring_needs_room() -> None:
    with pytest.raises(ValueError):
        Ring(0)


def test_reads_while_another_thread_appends_never_return_a_wrong_record() -> None:
    ring: Ring[int] = Ring(16)
    done = threading.Event()

    def write() -> None:
        for n in range(200_000):
            ring.append(n)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    cursor, seen = 0, []
    while not done.is_set():
        records, end = ring.since(cursor)
        seen += records
        assert all(r >= cursor for r in records) and records == sorted(records)
        cursor = end
    writer.join()
    assert seen == sorted(set(seen))


def test_the_block_map_shows_each_block_or_above_its_cell_limit_the_counts() -> None:
    pool = BlockPool(100)
    blocks = pool.get_new_blocks(4)
    pool.cache_block(blocks[0], b"prefix")
    pool.free_blocks([blocks[0]])  # free, still cached
    assert pool.block_map(100) == "2111" + "0" * 96
    # 10 cells of 10 blocks: 3 in use round up to a cell, so does the cached one.
    assert pool.block_map(10) == "12" + "0" * 8
