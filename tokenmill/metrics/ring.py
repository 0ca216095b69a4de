"""A fixed-size ring of recent records: one writer thread appends, readers on other threads
copy what is new since their last read, without a lock.

The engine thread fills rings with what it already knows (a step's token counts, a finished
request's latencies); the dashboard reads them a few times per second from the event loop.
Appending is one list store and one integer store, so the step loop pays nothing it would
notice. A reader gets back at most the last `capacity - 1` records: the oldest slot may be
the one being rewritten.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Ring(Generic[T]):
    """The last `capacity` records appended, numbered from 0 since start."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a ring needs room for at least one record, got {capacity}")
        self.capacity = capacity
        self._slots: list[T | None] = [None] * capacity
        self.num_appended = 0  # counted after the store: a reader never sees an empty slot

    def append(self, record: T) -> None:
        self._slots[self.num_appended % self.capacity] = record
        self.num_appended += 1

    def since(self, seq: int) -> tuple[list[T], int]:
        """Records numbered `seq` and later still held, and the number to ask from next."""
        end = self.num_appended
        start = max(seq, end - self.capacity + 1, 0)
        records = [self._slots[n % self.capacity] for n in range(start, end)]
        # The writer may have gone on while we copied, overwriting the oldest slots we read.
        first_intact = max(start, self.num_appended - self.capacity + 1)
        return [r for r in records[first_intact - start :] if r is not None], end
