"""Snapshots of a hybrid model's linear-attention states at KV block boundaries, for prefix
caching (vLLM's approach): a prefix hit of N full blocks skips the linear layers' first
N * block_size tokens too, so their conv and recurrent states at that boundary must be kept.

A snapshot is keyed by the id of the KV block that ends at its boundary: the block's hash
stands for every token before the boundary, and so does the state. It is dropped when the
block is handed out again (`drop`, called by the block pool) and, when every snapshot slot is
taken, the least recently used one is given to the new boundary. The KV cache manager cuts a
hit back to the last block holding a snapshot (`holds`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class StateSnapshots:
    """`num_slots` snapshots of every linear layer's conv and recurrent state, shaped as
    the state cache's slots (`conv`, `recurrent`: its per-layer tensors)."""

    def __init__(
        self, conv: list[torch.Tensor], recurrent: list[torch.Tensor], num_slots: int
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"state snapshots need at least one slot, got {num_slots}")
        self.conv = [t.new_zeros((num_slots, *t.shape[1:])) for t in conv]
        self.recurrent = [t.new_zeros((num_slots, *t.shape[1:])) for t in recurrent]
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # block id -> slot, oldest first

    def holds(self, block_id: int) -> bool:
        return block_id in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def slot_to_read(self, block_id: int) -> int:
        """The snapshot at the end of `block_id` (a hit), now the most recently used."""
        self._slot_of.move_to_end(block_id)
        return self._slot_of[block_id]

    def slot_to_write(self, block_id: int) -> int:
        """Where the snapshot at the end of `block_id` goes: its own slot, a free one, or the
        least recently used one's (that block then hits no further than before it)."""
        slot = self._slot_of.pop(block_id, None)
        if slot is None:
            slot = self._free.pop() if self._free else self._slot_of.popitem(last=False)[1]
        self._slot_of[block_id] = slot
        return slot

    def drop(self, block_id: int) -> None:
        """`block_id` is handed out again: its snapshot no longer matches what it holds."""
        slot = self._slot_of.pop(block_id, None)
        if slot is not None:
            self._free.append(slot)

    def save(self, layer: int, slot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv[layer][slot].copy_(conv)
        self.recurrent[layer][slot].copy_(recurrent)
